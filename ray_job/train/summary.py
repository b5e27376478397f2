"""The driver's account of a run: summary.json, the final table, "already finished", and the last
words of a run that ends otherwise (aborted, out of resources, the storage failing)."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Optional

from .. import storage
from ..config import TrainConfig
from ..core.errors import UsageError
from ..core.exits import ExitCode
from ..storage import StorageError
from . import metrics, stop
from .checkpointer import newest_saved_checkpoint
from .runfiles import EVENTS_JSONL, METRICS_JSONL, SUMMARY_JSON, Event
from .runlog import read_metrics
from .trainer import missing_resources


def finished_summary(cfg: TrainConfig) -> Optional[dict]:
    try:
        summary = storage.read_json(storage.at(cfg.run_dir()).join(SUMMARY_JSON))
    except FileNotFoundError:
        return None
    except StorageError as e:
        raise UsageError(f"cannot read the run's summary: {e}") from None
    done = summary.get("finished") and summary.get("epochs_completed", 0) >= cfg.epochs
    return summary if done else None


def announce_finished(cfg: TrainConfig) -> bool:
    """Says so when this run already finished its epochs (the same command run again)."""
    done = finished_summary(cfg)
    if done is not None:
        best = done.get("best_test_acc")
        print(f"run {cfg.name!r} already finished {done['epochs_completed']} epochs (best test "
              f"accuracy {'-' if best is None else f'{best:.4f}'}); results in {cfg.run_dir()}. Use "
              f"a new --name, or more --epochs to continue it.")
    return done is not None


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


def aborted(cfg: TrainConfig, started: float, signals: stop.Signals) -> int:
    """A second Ctrl-C or SIGTERM: no waiting for the checkpoint at the current step; the workers
    end with this driver, and the last complete checkpoint stays the one to continue from."""
    import ray

    latest = latest_checkpoint(cfg)
    with contextlib.suppress(StorageError):
        write_summary(cfg, started, finished=False, stopped=f"{signals.reason}, aborted", latest_checkpoint=latest)
    ray.shutdown()
    saved = f"the last complete checkpoint is {latest}" if latest else "no checkpoint was complete yet"
    print(f"error: aborted by a second {signals.reason} without a new checkpoint; {saved}. Run the same "
          f"command again to continue from it.", file=sys.stderr)
    return signals.exit_code


def resources_lost(cfg: TrainConfig, started: float) -> int:
    """The workers did not fit for --resource-wait-s (a node lost, or the cluster busy): say what
    is missing and exit NO_RESOURCES (5); the checkpoints saved so far stay, nothing new is."""
    missing = missing_resources(cfg)
    latest = latest_checkpoint(cfg)
    with contextlib.suppress(StorageError):
        write_summary(cfg, started, finished=False, latest_checkpoint=latest,
                      error=f"no resources for {cfg.resource_wait_s:g} s: {missing}")
    saved = f"last checkpoint: {latest}" if latest else "no checkpoint yet"
    print(f"error: waited {cfg.resource_wait_s:g} s (--resource-wait-s) for the workers: {missing}. "
          f"Nothing new was saved ({saved}); run the same command when the nodes are back (under "
          f"SLURM the job is requeued), or use --min-workers to go on with fewer", file=sys.stderr)
    return ExitCode.NO_RESOURCES


def storage_failed(cfg: TrainConfig, started: float, error: str, latest: Optional[str]) -> int:
    """The storage failed at the end (after --retry-storage-s): say what was saved, exit 1."""
    with contextlib.suppress(StorageError):
        write_summary(cfg, started, finished=False, error=error, latest_checkpoint=latest)
    saved = f"Last checkpoint saved: {latest}" if latest else "Ray keeps the last checkpoint it recorded"
    print(f"error: storage failed: {error}. {saved}; once the storage works again, run the same "
          f"command: it continues from there", file=sys.stderr)
    return ExitCode.FAILED
