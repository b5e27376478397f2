"""Files in the run folder that can be read without Ray: metrics (JSON lines + CSV), events,
topology, and TensorBoard scalars. Written by rank 0 only, through ray_job.storage: the run folder
may be a local folder or an object store."""

from __future__ import annotations

import csv
import io
import logging
import os
import shutil
import tempfile
import threading
import time
from typing import Any, Optional

from .. import storage
from ..core.jsonio import dumps, loads
from ..storage import Where
from .metrics import EpochMetrics
from .runfiles import EVENTS_JSONL, METRICS_CSV, METRICS_JSONL, TENSORBOARD

log = logging.getLogger("ray_job")


def read_metrics(path: Where) -> list[EpochMetrics]:
    return [EpochMetrics.from_dict(r) for r in storage.read_jsonl(path)]


def csv_text(rows: list[dict], keys: list[str]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=keys)
    writer.writeheader()
    writer.writerows({k: ("" if r.get(k) is None else r[k]) for k in keys} for r in rows)
    return out.getvalue()


# Rank 0's temporary folder for TensorBoard's files before they are copied to object storage, named
# <prefix><pid>_<random> so that what a killed worker left is found:
TB_PREFIX = "rj_tb_"


class RunLog:
    """Rank 0's writer for one run folder, on any storage; one lock, for the upload thread too.

    Object stores cannot append, so the JSON-lines files are held in memory (small) and written
    whole each time. A write that fails (storage unreachable, disk full) is kept and tried again
    with the next one: an outage costs no training time; `close` waits for them up to a deadline.
    TensorBoard writes into <run>/tensorboard when the run folder is local, else into a temporary
    folder copied at every epoch and removed at `close` (or by the next RunLog on that machine,
    should the worker have been killed).
    """

    def __init__(self, run_dir: Where):
        self.store = storage.at(run_dir)
        self._lock = threading.RLock()
        self._lines = {name: self._existing_lines(name) for name in (METRICS_JSONL, EVENTS_JSONL)}
        self._pending: dict[str, bytes] = {}   # file name in the run folder -> content to write
        self._failing: Optional[str] = None    # the error of the last failed write, if failing
        self._tb = None
        self._tb_dir: Optional[str] = None      # a temporary folder (object storage) or None
        remove_stale_temp_folders()

    def _existing_lines(self, name: str) -> list[str]:
        try:
            return [line for line in self.store.join(name).read_text().splitlines() if line.strip()]
        except FileNotFoundError:
            return []

    def history(self) -> list[EpochMetrics]:
        with self._lock:
            return [EpochMetrics.from_dict(loads(line)) for line in self._lines[METRICS_JSONL]]

    def keep_epochs_up_to(self, last_epoch: int) -> None:
        """Drops rows of epochs that will be recomputed (after a restore from an older checkpoint)."""
        with self._lock:
            self._lines[METRICS_JSONL] = [dumps(r.to_dict()) for r in self.history() if r.epoch <= last_epoch]
            self._put_metrics()
            self.flush()

    def event(self, name: str, **fields: Any) -> None:
        with self._lock:
            self._lines[EVENTS_JSONL].append(dumps({"event": name, "time": time.time(), **fields}))
            self._put_lines(EVENTS_JSONL)
            self.flush()

    def epoch(self, metrics: EpochMetrics) -> None:
        with self._lock:
            self._lines[METRICS_JSONL].append(dumps(metrics.to_dict()))
            self._put_metrics()
            tb = self._writer()
            if tb is not None:
                for key, value in metrics.to_dict().items():
                    if isinstance(value, (int, float)) and key != "epoch":
                        tb.add_scalar(key, value, metrics.epoch)
                tb.flush()
                self._put_tensorboard()
            self.flush()

    def write_json(self, name: str, obj: Any) -> None:
        with self._lock:
            self._pending[name] = dumps(obj, indent=2, sort_keys=True).encode()
            self.flush()

    # --- writing, and catching up after a storage fault ---
    def _put_lines(self, name: str) -> None:
        self._pending[name] = "".join(line + "\n" for line in self._lines[name]).encode()

    def flush(self) -> bool:
        """Writes every pending file; False (and the files kept for later) if the storage fails."""
        with self._lock:
            try:
                self._write_pending()
            except storage.StorageError as e:
                if self._failing is None:
                    log.warning("storage: %s; keeping %d file(s) to write later, training goes on",
                                e, len(self._pending))
                self._failing = str(e)
                return False
            if self._failing is not None:
                log.warning("storage: writing again; the run files in %s have caught up", self.store.uri)
                self._failing = None
            return True

    def _write_pending(self) -> None:
        for name in list(self._pending):
            self.store.join(*name.split("/")).write_bytes(self._pending[name])
            del self._pending[name]

    def _put_metrics(self) -> None:
        self._put_lines(METRICS_JSONL)
        rows = [r.to_dict() for r in self.history()]
        self._pending[METRICS_CSV] = csv_text(rows, list(EpochMetrics.__dataclass_fields__)).encode()

    def _writer(self) -> Optional[Any]:
        """TensorBoard's writer: in the run folder itself, or in a temporary folder (object storage)."""
        if self._tb is None:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:  # TensorBoard files are a convenience, not a requirement
                return None
            if self.store.is_local:
                target = self.store.join(TENSORBOARD).path
            else:
                target = self._tb_dir = tempfile.mkdtemp(prefix=f"{TB_PREFIX}{os.getpid()}_")
            self._tb = SummaryWriter(target)
        return self._tb

    def _put_tensorboard(self) -> None:
        if self._tb_dir is None:  # written in place
            return
        for name in os.listdir(self._tb_dir):
            with open(os.path.join(self._tb_dir, name), "rb") as f:
                self._pending[f"{TENSORBOARD}/{name}"] = f.read()

    def close(self, wait_s: float = 0.0) -> Optional[str]:
        """Writes what is left, retrying for up to `wait_s` seconds; the error if it could not."""
        with self._lock:
            if self._tb is not None:
                self._tb.close()
                self._put_tensorboard()
                self._tb = None
            if self._tb_dir is not None:
                shutil.rmtree(self._tb_dir, ignore_errors=True)
                self._tb_dir = None
            try:
                storage.retrying(self._write_pending, wait_s, "writing the run files")
            except storage.StorageError as e:
                return f"{len(self._pending)} run file(s) not written: {e}"
            return None


def remove_stale_temp_folders() -> None:
    """Temporary folders of ours whose process is gone (a killed worker left them)."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        if not name.startswith(TB_PREFIX):
            continue
        pid = name[len(TB_PREFIX):].split("_", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
