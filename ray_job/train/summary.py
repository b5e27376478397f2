"""The driver's account of a run: summary.json, the final table, and "already finished"."""

from __future__ import annotations

import time
from typing import Optional

from .. import storage
from ..config import TrainConfig
from ..core.errors import UsageError
from ..storage import StorageError
from . import metrics
from .checkpointer import newest_saved_checkpoint
from .runfiles import EVENTS_JSONL, METRICS_JSONL, SUMMARY_JSON, Event
from .runlog import read_metrics


def finished_summary(cfg: TrainConfig) -> Optional[dict]:
    try:
        summary = storage.read_json(storage.at(cfg.run_dir()).join(SUMMARY_JSON))
    except FileNotFoundError:
        return None
    except StorageError as e:
        raise UsageError(f"cannot read the run's summary: {e}") from None
    done = summary.get("finished") and summary.get("epochs_completed", 0) >= cfg.epochs
    return summary if done else None


def latest_checkpoint(cfg: TrainConfig) -> Optional[str]:
    run_dir = storage.at(cfg.run_dir())
    name = newest_saved_checkpoint(run_dir)
    return run_dir.join(name).uri if name else None


def write_summary(cfg: TrainConfig, started: float, finished: bool, **extra) -> dict:
    run_dir = storage.at(cfg.run_dir())
    rows = read_metrics(run_dir.join(METRICS_JSONL))
    events = storage.read_jsonl(run_dir.join(EVENTS_JSONL))
    first = [e["time"] for e in events if e["event"] == Event.FIRST_STEP and e["time"] >= started]
    last = rows[-1] if rows else None
    summary = dict(name=cfg.name, run_dir=cfg.run_dir(), finished=finished,
                   epochs_completed=last.epoch if last else 0, epochs=cfg.epochs,
                   best_test_acc=max((r.test_acc for r in rows), default=None),
                   final=last.to_dict() if last else None, wall_s=time.time() - started,
                   time_to_first_step_s=(first[0] - started) if first else None,
                   # first training step to the last evaluation, as in time-to-accuracy benchmarks
                   train_wall_s=(last.time - first[0]) if first and last else None,
                   num_workers=cfg.num_workers, use_gpu=cfg.use_gpu, **extra)
    storage.write_json(run_dir.join(SUMMARY_JSON), summary)
    return summary


def summary_table(cfg: TrainConfig) -> str:
    return metrics.table(read_metrics(storage.at(cfg.run_dir()).join(METRICS_JSONL)))
