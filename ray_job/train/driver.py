"""The driver of `python -m ray_job train`: checks the input, connects to Ray, runs the
TorchTrainer (trainer.py) and summarises (summary.py).

Every check that can fail fast runs before any worker starts, so bad input costs seconds. The run
folder (local or object storage) is reached through ray_job.storage only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Optional

from .. import storage, tracking
from ..cluster import raypriv
from ..config import TrainConfig
from ..core.errors import UsageError
from ..core.exits import ExitCode
from ..core.flags import flag_name
from ..core.paths import is_uri
from ..data.datasets import check_data
from ..storage import StorageError
from . import stop, tracked
from .checkpoint import load_checkpoint
from .runfiles import CONFIG_JSON
from .summary import finished_summary, latest_checkpoint, summary_table, write_summary
from .trainer import BelowMinimum, build_trainer, connect, missing_resources, resolve_workers


def with_default_name(cfg: TrainConfig) -> TrainConfig:
    if cfg.name:
        if os.sep in cfg.name or cfg.name in (".", ".."):
            raise UsageError(f"--name {cfg.name!r} must be a plain folder name, not a path")
        return cfg
    return dataclasses.replace(cfg, name=cfg.default_name())


def with_progress(cfg: TrainConfig) -> TrainConfig:
    """--progress auto: a live bar when the user watches a terminal, plain lines in log files."""
    if cfg.progress != "auto":
        return cfg
    return dataclasses.replace(cfg, progress="bar" if sys.stdout.isatty() else "lines")


def check_storage(cfg: TrainConfig) -> None:
    """--storage-path takes a write: a local folder, or object storage (endpoint reachable,
    credentials accepted, bucket there, writes allowed), checked in seconds."""
    try:
        storage.check_writable(cfg.storage_path)
    except StorageError as e:
        raise UsageError(str(e)) from None


def check_resume_from(cfg: TrainConfig) -> None:
    if cfg.resume_from:
        state = load_checkpoint(cfg.resume_from)  # raises a one-line CheckpointError
        saved = state.get("config", {})
        if saved.get("model") != cfg.model or saved.get("stem") != cfg.stem:
            raise UsageError(f"--resume-from holds a {saved.get('model')}/{saved.get('stem')} stem "
                             f"model; pass --model {saved.get('model')} --stem {saved.get('stem')}")


def check_sizes(cfg: TrainConfig, world: int) -> None:
    per_worker = cfg.per_worker_batch(world)
    if cfg.data == "synthetic" and cfg.synthetic_train_size < per_worker * world:
        raise UsageError(f"--synthetic-train-size {cfg.synthetic_train_size} is smaller than one "
                         f"global batch ({per_worker * world}); raise it or lower --batch-size")


def check_submitted_job_paths(cfg: TrainConfig) -> None:
    """Under `ray job submit` the driver runs in a temporary copy of --working-dir on the cluster:
    a relative path would put the results there, where nobody finds them again."""
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" not in os.environ:  # set by Ray's job supervisor
        return
    fields = ["storage_path", "resume_from"] + ([] if cfg.data == "synthetic" else ["data_dir"])
    for name in fields:
        value = getattr(cfg, name)
        if value and not os.path.isabs(os.path.expanduser(value)) and not is_uri(value):
            raise UsageError(f"--{flag_name(name)} {value} is relative, but a submitted job runs "
                             f"in a temporary copy of --working-dir: give an absolute path on a file "
                             f"system that every node shares")


def preflight(cfg: TrainConfig) -> TrainConfig:
    """Decisions made once, on the driver, and checks that fail in seconds before Ray starts."""
    check_submitted_job_paths(cfg)
    cfg = with_progress(with_default_name(cfg.with_resolved_paths()))
    check_storage(cfg)
    check_data(cfg)
    check_resume_from(cfg)
    return tracking.check(cfg)  # --mlflow: the store reached (the URI decided), else nothing


def run_training(cfg: TrainConfig, parent_id: Optional[str] = None) -> int:
    """`python -m ray_job train`: the whole run, from the checks to the summary; the exit code.
    `parent_id`: the MLflow run of a sweep or search this run belongs to (with --mlflow).

    The run folder's lease is taken before anything else is written there (one writer per run
    folder), and from then until the end SIGUSR1, Ctrl-C and SIGTERM are stop requests (stop.py);
    a second Ctrl-C or SIGTERM aborts at once."""
    started = time.time()
    cfg = preflight(cfg)
    if announce_finished(cfg):
        tracked.complete_finished(cfg)
        return ExitCode.DONE
    with run_lease(cfg):
        open_run_folder(cfg)
        with stop.stop_on_signals(storage.at(cfg.run_dir())) as signals:
            try:
                connect(cfg)
                cfg = start_run(cfg)
                print("config:\n" + cfg.to_json(), flush=True)
                return tracked_fit(cfg, started, signals, parent_id)
            except KeyboardInterrupt:
                return aborted(cfg, started, signals)


def tracked_fit(cfg: TrainConfig, started: float, signals: stop.Signals, parent_id: Optional[str]) -> int:
    """fit_and_summarise, with its MLflow run (--mlflow) opened before and completed after."""
    tracking = tracked.start(cfg, parent_id)
    if tracking is None:
        return fit_and_summarise(cfg, started, signals=signals)
    try:
        rc = fit_and_summarise(cfg, started, callbacks=tracking.callbacks(), signals=signals)
    except KeyboardInterrupt:  # aborted: no waiting for the store; the next run continues it
        raise
    except BaseException:
        tracking.finish(ExitCode.FAILED)
        raise
    tracking.finish(rc)
    return rc


@contextlib.contextmanager
def run_lease(cfg: TrainConfig):
    """This run holds its folder's lease (storage/lease.py) while the block runs."""
    from ..storage.lease import Lease

    run_dir = storage.at(cfg.run_dir())
    try:
        run_dir.makedirs()
    except StorageError as e:
        raise UsageError(str(e)) from None
    lease = Lease(run_dir)
    lease.take()
    try:
        yield lease
    finally:
        lease.give_back()


def announce_finished(cfg: TrainConfig) -> bool:
    """Says so when this run already finished its epochs (the same command run again)."""
    done = finished_summary(cfg)
    if done is not None:
        best = done.get("best_test_acc")
        print(f"run {cfg.name!r} already finished {done['epochs_completed']} epochs (best test "
              f"accuracy {'-' if best is None else f'{best:.4f}'}); results in {cfg.run_dir()}. Use "
              f"a new --name, or more --epochs to continue it.")
    return done is not None


def open_run_folder(cfg: TrainConfig) -> None:
    """The run folder exists, without the stop request a previous (requeued) run left."""
    run_dir = storage.at(cfg.run_dir())
    try:
        run_dir.makedirs()
        stop.clear(run_dir)
    except StorageError as e:
        raise UsageError(str(e)) from None


def start_run(cfg: TrainConfig) -> TrainConfig:
    """On a connected cluster: the workers decided and checked, config.json written."""
    run_dir = storage.at(cfg.run_dir())
    cfg = resolve_workers(cfg)
    for world in {cfg.min_workers or cfg.num_workers, cfg.num_workers}:  # every size it may run at
        check_sizes(cfg, world)
    try:
        storage.write_json(run_dir.join(CONFIG_JSON), cfg.to_dict())
    except StorageError as e:
        raise UsageError(str(e)) from None
    return cfg


def fit_and_summarise(cfg: TrainConfig, started: float, callbacks: Sequence[Any] = (),
                      signals: Optional[stop.Signals] = None) -> int:
    """Trains (TorchTrainer.fit, with Ray Train `callbacks`) and writes the summary; the exit code
    (a stop request's: `signals` says which)."""
    from ray.train import TrainingFailedError

    try:
        result = fit(build_trainer(cfg, callbacks), BelowMinimum(cfg) if cfg.min_workers else None)
    except ResourcesLost:
        return resources_lost(cfg, started)
    except TrainingFailedError as e:
        reason = " ".join(str(e).split())[:300]  # one line: the error's own text, whitespace folded
        if isinstance(getattr(e, "controller_failure", None), OSError):
            # Ray's controller could not write its record of checkpoints (after --retry-storage-s)
            reason = " ".join(str(e.controller_failure).split())[:300]
            return storage_failed(cfg, started, f"Ray could not record the checkpoints ({reason})",
                                  None)
        if raypriv.is_worker_group_startup_timeout(getattr(e, "controller_failure", None)):
            return resources_lost(cfg, started)
        with contextlib.suppress(StorageError):  # the failure may be the storage's own
            write_summary(cfg, started, finished=False, error=reason)
        print(f"error: training failed after {cfg.max_failures} restart(s): {reason} (worker logs "
              f"above; --max-failures allows more restarts)", file=sys.stderr)
        return ExitCode.FAILED
    outcome = result.return_value or {}
    if outcome.get("usage_error"):  # bad input that only the workers could see: exit 2, one line
        raise UsageError(outcome["usage_error"])
    root = storage.at(cfg.storage_path)
    best = result.get_best_checkpoint("test_acc", "max") if result.best_checkpoints else None
    best, latest = (root.at_path(c.path).uri if c else None for c in (best, result.checkpoint))
    if outcome.get("storage_error"):
        return storage_failed(cfg, started, outcome["storage_error"], latest)
    preempted = bool(outcome.get("preempted"))
    reason = {"stopped": signals.reason if signals else "a stop request"} if preempted else {}
    try:
        summary = write_summary(cfg, started, finished=not preempted, best_checkpoint=best,
                                latest_checkpoint=latest, **reason)
        print(summary_table(cfg))
    except StorageError as e:
        return storage_failed(cfg, started, str(e), latest)
    if preempted:
        print(f"stopped at epoch {outcome['epoch'] + 1} step {outcome['step']} ({reason['stopped']}); "
              f"checkpoint saved. Run the same command again to continue.")
        return signals.exit_code if signals else ExitCode.STOPPED
    best_acc = summary["best_test_acc"]
    print(f"results: {cfg.run_dir()}\nbest checkpoint: {summary['best_checkpoint']} (test accuracy "
          f"{'-' if best_acc is None else f'{best_acc:.4f}'})")
    return ExitCode.DONE


class ResourcesLost(Exception):
    """The cluster has held fewer workers than the run needs for too long."""


def fit(trainer, watch=None, every_s: float = 5.0):
    """TorchTrainer.fit(), on a thread when called from the main thread: Ray Train then installs no
    SIGINT handler of its own, and Ctrl-C stays a stop request (the main thread keeps ours).
    `watch()` is asked every `every_s` meanwhile; a reason from it ends the wait (ResourcesLost)."""
    if threading.current_thread() is not threading.main_thread() and watch is None:
        return trainer.fit()
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = trainer.fit()
        except BaseException as e:  # raised again in the main thread
            box["error"] = e
    thread = threading.Thread(target=run, name="fit", daemon=True)
    thread.start()
    looked = time.monotonic()
    while thread.is_alive():
        thread.join(0.5)
        if watch is not None and time.monotonic() - looked >= every_s:
            looked = time.monotonic()
            if thread.is_alive() and watch():
                raise ResourcesLost()
    if "error" in box:
        raise box["error"]
    return box["result"]


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
