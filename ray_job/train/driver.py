"""The driver of `python -m ray_job train`: checks the input, connects to Ray, runs the
TorchTrainer and summarises (trainer.py).

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
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from contextlib import AbstractContextManager
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
from ..storage.lease import Lease
from . import memplan, metrics, stop, tracked
from .checkpoint import load_checkpoint
from .checkpointer import SCORE_METRIC, SCORE_ORDER, in_thread
from .runfiles import CONFIG_JSON, METRICS_JSONL
from .runlog import read_metrics
from .trainer import (BelowMinimum, aborted, announce_finished, build_trainer, connect, finished_summary,
                      resolve_workers, resources_lost, storage_failed, write_summary)

log = logging.getLogger("ray_job.driver")


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
    cfg = cfg.with_resolved_paths()
    if os.sep in cfg.name or cfg.name in (".", ".."):
        raise UsageError(f"--name {cfg.name!r} must be a plain folder name, not a path")
    if cfg.progress == "auto":  # a live bar when the user watches a terminal, plain lines in log files
        cfg = dataclasses.replace(cfg, progress="bar" if sys.stdout.isatty() else "lines")
    weights_sha256 = check_model(cfg, check_data(cfg))
    try:  # --storage-path takes a write (object storage: endpoint, credentials, bucket), in seconds
        storage.check_writable(cfg.storage_path)
    except StorageError as e:
        raise UsageError(str(e)) from None
    if not cfg.name:
        cfg = dataclasses.replace(cfg, name=cfg.default_name(weights_sha256))
    if cfg.resume_from:
        saved = TrainConfig.from_saved(load_checkpoint(cfg.resume_from).get("config", {}))  # or CheckpointError
        if (saved.model, saved.stem_in_use, saved.model_arg) != (cfg.model, cfg.stem_in_use, cfg.model_arg):
            flags = [f"--model {saved.model}", *(f"--model-arg {a}" for a in saved.model_arg)]
            flags += [f"--stem {saved.stem_in_use}"] if saved.stem_in_use != "none" else []
            raise UsageError(f"--resume-from holds another model: pass {' '.join(flags)}")
    return tracking.check(cfg)  # --mlflow: the store reached (the URI decided), else nothing


def check_model(cfg: TrainConfig, num_classes: int = 10) -> str:
    """The model built on the meta device at --image-size and --init-weights read against it (one
    line each when they do not fit); the weights file's SHA-256, or ''."""
    from ..model import weights, zoo

    model = zoo.check(cfg, num_classes)
    if not cfg.init_weights:
        return ""
    found, digest = weights.check(model, cfg.init_weights)
    log.info("--init-weights %s: %s", cfg.init_weights, found.line())
    return digest


def run_training(cfg: TrainConfig, parent_id: Optional[str] = None) -> int:
    """`python -m ray_job train` (and each point of a scaling sweep), from the checks to the summary;
    the exit code. `parent_id`: the MLflow run of the sweep. From the lease on, SIGUSR1, Ctrl-C and
    SIGTERM are stop requests (stop.py); a second Ctrl-C or SIGTERM aborts at once."""
    started = time.time()
    cfg = preflight(cfg)
    if announce_finished(cfg):
        tracked.complete_finished(cfg)
        return ExitCode.DONE
    return run_in_folder(cfg, started, stop.stop_on_signals, parent_id=parent_id, show_config=True)


def run_in_folder(cfg: TrainConfig, started: float, stopping: Callable[[str], AbstractContextManager[Any]],
                  parent_id: Optional[str] = None, command: str = "train", callbacks: Sequence[Any] = (),
                  tags: Callable[[int], dict] = lambda rc: {}, show_config: bool = False) -> int:
    """One run's lifecycle, the same for `train`, a sweep's point and a search's trial; the exit code.
    `stopping(run_dir)`: a context yielding what fit_and_summarise asks of stop.Signals; the MLflow run is
    a child of `parent_id`, tagged with `command`, completed with `tags(exit code)`; `callbacks`: Ray Train's."""
    with run_folder(cfg), stopping(cfg.run_dir()) as signals:
        try:
            connect(cfg)
            cfg = start_run(cfg)
            if show_config:
                print("config:\n" + cfg.to_json(), flush=True)
            return tracked_fit(cfg, started, signals, parent_id, command, callbacks, tags)
        except KeyboardInterrupt:
            if not isinstance(signals, stop.Signals):  # not this run's own terminal
                raise
            return aborted(cfg, started, signals)


def tracked_fit(cfg: TrainConfig, started: float, signals: Any, parent_id: Optional[str], command: str,
                callbacks: Sequence[Any], tags: Callable[[int], dict]) -> int:
    """fit_and_summarise, with its MLflow run (--mlflow) opened before and completed after."""
    tracking = tracked.start(cfg, parent_id, command)
    if tracking is None:
        return fit_and_summarise(cfg, started, callbacks, signals)
    try:
        rc = fit_and_summarise(cfg, started, [*callbacks, *tracking.callbacks()], signals)
    except KeyboardInterrupt:  # aborted: no waiting for the store; the next run continues it
        raise
    except BaseException:
        tracking.finish(ExitCode.FAILED)
        raise
    tracking.finish(rc, tags(rc))
    return rc


@contextlib.contextmanager
def run_folder(cfg: TrainConfig) -> Iterator[storage.Location]:
    """The run folder, made once and held by this run (its lease, storage/lease.py) while the block
    runs, without the stop request a previous (requeued) run left (cleared once the folder is ours)."""
    run_dir = open_folder(cfg.run_dir(), clear_stop=False)
    try:
        with Lease(run_dir):
            open_folder(run_dir, make=False)
            yield run_dir
    except UsageError:  # refused before it wrote anything (workers, memory): no empty folder left
        with contextlib.suppress(StorageError):
            if not run_dir.files():
                run_dir.delete()
        raise


def open_folder(where: storage.Where, clear_stop: bool = True, make: bool = True) -> storage.Location:
    """A run's, a sweep's or a search's folder, made, without a previous (requeued) stop request."""
    folder = storage.at(where)
    try:
        if make:
            folder.makedirs()
        if clear_stop:
            stop.clear(folder)
    except StorageError as e:
        raise UsageError(str(e)) from None
    return folder


def start_run(cfg: TrainConfig) -> TrainConfig:
    """On a connected cluster: the workers decided and checked, config.json written."""
    cfg = resolve_workers(cfg)
    for world in {cfg.min_workers or cfg.num_workers, cfg.num_workers}:  # every size it may run at
        check_sizes(cfg, world)
    memplan.check_memory(cfg, check_data(cfg))
    try:
        storage.write_json(storage.at(cfg.run_dir()).join(CONFIG_JSON), cfg.to_dict())
    except StorageError as e:
        raise UsageError(str(e)) from None
    return cfg


def same_run(cfg: TrainConfig, saved: dict) -> bool:
    """A run's saved config.json holds what `cfg` computes: every field that changes a result
    (`affects_result`) but where the run is written, its name, and what this --data does not read."""
    try:
        return TrainConfig.from_saved(saved).computed() == cfg.computed()
    except UsageError:  # a config this version refuses: not this run
        return False


def make_way(cfg: TrainConfig, resume: bool, refuse_other: bool) -> bool:
    """The run folder made fit for `cfg` before it runs there; True when it holds this run finished.
    A folder of another config is moved aside (`refuse_other`: a finished one is refused instead);
    this run unfinished is continued (`resume`) or moved aside (a sweep's point, whose timings must
    cover the whole run)."""
    folder = storage.at(cfg.run_dir())
    try:
        if not folder.is_dir():
            return False
        saved = storage.read_json(folder.join(CONFIG_JSON))
    except FileNotFoundError:  # a run that stopped before it wrote its config: nothing else
        saved = None
    except (StorageError, ValueError) as e:
        raise UsageError(f"cannot read {folder.join(CONFIG_JSON).uri}: {e}") from None
    same, finished = saved is None or same_run(cfg, saved), finished_summary(cfg) is not None
    if same and (finished or resume):
        return finished
    if finished and refuse_other:
        raise UsageError(f"{folder.uri} holds a finished run with other flags; use a new --name")
    aside = storage.at(f"{folder.uri}.{'interrupted' if same else 'other'}-{time.strftime('%Y%m%d_%H%M%S')}",
                       near=folder)
    log.warning("%s holds %s; moving it aside to %s", folder.uri,
                "an unfinished run" if same else "a run with other flags", aside.uri)
    folder.move_to(aside)
    return False


def fit_and_summarise(cfg: TrainConfig, started: float, callbacks: Sequence[Any], signals: Any) -> int:
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
    best = result.get_best_checkpoint(SCORE_METRIC, SCORE_ORDER) if result.best_checkpoints else None
    best, latest = (root.at_path(c.path).uri if c else None for c in (best, result.checkpoint))
    if outcome.get("storage_error"):
        return storage_failed(cfg, started, outcome["storage_error"], latest)
    preempted = bool(outcome.get("preempted"))
    reason = {"stopped": signals.reason} if preempted else {}
    try:
        summary = write_summary(cfg, started, finished=not preempted, best_checkpoint=best,
                                latest_checkpoint=latest, **reason)
        print(metrics.table(read_metrics(storage.at(cfg.run_dir()).join(METRICS_JSONL))))
    except StorageError as e:
        return storage_failed(cfg, started, str(e), latest)
    if preempted:
        print(f"stopped at epoch {outcome['epoch'] + 1} step {outcome['step']} ({reason['stopped']}); "
              f"checkpoint saved. Run the same command again to continue.")
        return signals.exit_code
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
    result = in_thread(trainer.fit, "fit")
    looked = time.monotonic()
    while not futures.wait([result], timeout=0.5).done:
        if watch is not None and time.monotonic() - looked >= every_s:
            looked = time.monotonic()
            if not result.done() and watch():
                raise ResourcesLost()
    return result.result()  # or what fit raised, raised again in the main thread
