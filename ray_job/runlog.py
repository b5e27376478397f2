"""Files in the run folder that can be read without Ray: metrics (JSON lines + CSV), events,
topology, and TensorBoard scalars. Written by rank 0 only."""

from __future__ import annotations

import csv
import json
import math
import os
import time
from typing import Any, Optional

from .metrics import EpochMetrics

METRICS_JSONL = "metrics.jsonl"
METRICS_CSV = "metrics.csv"
EVENTS_JSONL = "events.jsonl"
TOPOLOGY_JSON = "topology.json"
SUMMARY_JSON = "summary.json"
CONFIG_JSON = "config.json"


def finite(obj: Any) -> Any:
    """`obj` with every NaN/Infinity replaced by None, so it can be written as strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, **kw: Any) -> str:
    """Strict JSON (no NaN/Infinity: they become null), readable by any JSON parser."""
    return json.dumps(finite(obj), allow_nan=False, default=str, **kw)


def _no_constants(name: str) -> Any:
    raise ValueError(f"not strict JSON: {name}")


def loads(text: str) -> Any:
    """Parses strict JSON only: a NaN/Infinity in the file is an error, not a float."""
    return json.loads(text, parse_constant=_no_constants)


def read_json(path: str) -> Any:
    with open(path) as f:
        return loads(f.read())


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [loads(line) for line in f if line.strip()]


def read_metrics(path: str) -> list[EpochMetrics]:
    return [EpochMetrics.from_dict(r) for r in read_jsonl(path)]


def write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(dumps(obj, indent=2, sort_keys=True))
    os.replace(tmp, path)


class RunLog:
    """Rank 0's writer for one run folder."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        self._tb = None

    def path(self, name: str) -> str:
        return os.path.join(self.run_dir, name)

    def history(self) -> list[EpochMetrics]:
        return read_metrics(self.path(METRICS_JSONL))

    def keep_epochs_up_to(self, last_epoch: int) -> None:
        """Drops rows of epochs that will be recomputed (after a restore from an older checkpoint)."""
        rows = [r for r in self.history() if r.epoch <= last_epoch]
        with open(self.path(METRICS_JSONL) + ".tmp", "w") as f:
            f.writelines(dumps(r.to_dict()) + "\n" for r in rows)
        os.replace(self.path(METRICS_JSONL) + ".tmp", self.path(METRICS_JSONL))
        self._write_csv(rows)

    def event(self, name: str, **fields: Any) -> None:
        with open(self.path(EVENTS_JSONL), "a") as f:
            f.write(dumps({"event": name, "time": time.time(), **fields}) + "\n")

    def epoch(self, metrics: EpochMetrics) -> None:
        with open(self.path(METRICS_JSONL), "a") as f:
            f.write(dumps(metrics.to_dict()) + "\n")
        self._write_csv(self.history())
        tb = self._writer()
        if tb is not None:
            for key, value in metrics.to_dict().items():
                if isinstance(value, (int, float)) and key != "epoch":
                    tb.add_scalar(key, value, metrics.epoch)
            tb.flush()

    def _write_csv(self, rows: list[EpochMetrics]) -> None:
        keys = list(EpochMetrics.__dataclass_fields__)
        with open(self.path(METRICS_CSV), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows({k: ("" if v is None else v) for k, v in r.to_dict().items()}
                             for r in rows)

    def _writer(self) -> Optional[Any]:
        if self._tb is None:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:  # TensorBoard files are a convenience, not a requirement
                return None
            self._tb = SummaryWriter(self.path("tensorboard"))
        return self._tb

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
