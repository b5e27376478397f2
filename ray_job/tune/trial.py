"""One trial: Tune's trial function, which runs an ordinary `train` run with the sampled values.

It runs in the trial's Ray actor (which holds no CPU: the run's Train workers take the cluster's)
through the train driver's own run lifecycle (driver.run_in_folder), so a trial is a run like any
other: its folder <search>/trial_NNN/ holds what a run's does, and `python -m ray_job train` with
the same flags continues it.

Only epoch results reach Tune (EpochResults): the worker loop also reports finished background
uploads and timed or stop checkpoints (test_acc UNSCORED); Tune, its scheduler and its searcher see
one result per finished epoch, with `epoch` as the time attribute.

How a trial ends, as Tune must see it:
  - the run finished its epochs, or the scheduler stopped it early (the run checkpointed at the
    step its stop request reached it; a request that came after its last epoch changes nothing,
    and the trial counts as finished): the function returns, Tune marks the trial done;
  - the search was asked to stop: the run checkpoints and stops, and the function *parks* (never
    returns), so Tune still has the trial as running when the search ends it, and saves it as
    unfinished: the same search run again resumes it from its checkpoint;
  - the run failed: the function raises, Tune marks the trial failed.
Run again on a finished or early-stopped run folder (Tune's record of it was older), it reports the
epochs the folder holds and returns, without training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

from ray.tune.integration.ray_train import TuneReportCallback

from .. import storage
from ..config import TrainConfig
from ..core.exits import ExitCode, is_stop
from ..storage import StorageError
from ..tracking.epochs import is_epoch
from ..train import stop
from ..train.driver import make_way, run_in_folder
from ..train.runfiles import METRICS_JSONL, SUMMARY_JSON
from ..train.runlog import read_metrics
from .options import trial_config

log = logging.getLogger("ray_job.tune")

TRIAL_PREFIX = "trial_"
EARLY_STOPPED = "stopped early by the search's scheduler (ASHA)"
SEARCH_STOPPED = "the search was asked to stop"
# A trial's status (status_of): finished all --epochs, stopped early by ASHA (it has a checkpoint to
# extend), interrupted (the search was stopped; the same search run again resumes it), failed, or
# unfinished (the search was aborted while it ran).
FINISHED, STOPPED_EARLY, INTERRUPTED, FAILED, UNFINISHED = (
    "finished", "stopped early", "interrupted", "failed", "unfinished")
REPLAYED = "replayed"  # a result re-sent from the run folder (the trial had already run)
EARLY_STOP_FILE = ".early_stop"  # the scheduler's stop of this trial (beside the run's stop request)


def trial_dirname(trial: Any) -> str:
    """trial_NNN, from the number Tune's search gave the trial (kept across restores). Also the
    trial's name in Tune, so the trial function finds its folder from its context."""
    return f"{TRIAL_PREFIX}{int(str(trial.experiment_tag).split('_')[0]):03d}"


@dataclass(frozen=True)
class TrialSetup:
    """What every trial shares (sent once to the cluster with tune.with_parameters)."""

    base: dict                 # the fixed train flags (TrainConfig.to_dict())
    search_dir: str            # <storage-path>/<search name>
    # The driver's object-storage settings (AWS_*) and tracking credentials, for a trial's actor
    # that may run where the user's shell did not set them.
    env: tuple[tuple[str, str], ...] = ()
    parent_id: str = ""        # --mlflow: the search's MLflow run, each trial's run its child


class EpochResults(TuneReportCallback):
    """Tune's report callback (on Ray Train's controller), passing on epoch results only, without
    the checkpoint path (a trial's checkpoints are its run's, found again by its name)."""

    def after_report(self, run_context, metrics, checkpoint) -> None:
        if metrics and is_epoch(metrics[0]):
            super().after_report(run_context, metrics, None)


@dataclass
class StopReason:
    """Why a trial's run stopped, in the form fit_and_summarise asks of stop.Signals."""

    search_dir: str
    run_dir: str
    exit_code = ExitCode.STOPPED

    @property
    def early(self) -> bool:
        return storage.at(self.run_dir).join(EARLY_STOP_FILE).exists()

    @contextlib.contextmanager
    def forwarded(self, run_dir: str) -> Iterator[StopReason]:
        """The search's stop request forwarded to the trial's run while it runs (run_in_folder)."""
        with stop.forward(self.search_dir, run_dir):
            yield self

    @property
    def reason(self) -> str:
        return EARLY_STOPPED if self.early or not stop.requested(self.search_dir) else SEARCH_STOPPED


class TrialFailed(Exception):
    """The trial's run failed; Tune marks the trial as failed, with this message."""


def run_trial(config: dict, setup: TrialSetup) -> None:
    """Tune's trial function: `config` holds the sampled values of the searched flags."""
    from ray import tune

    started = time.time()
    os.environ.update(dict(setup.env))  # this actor runs this trial only (reuse_actors=False)
    name = tune.get_context().get_trial_name()
    cfg = dataclasses.replace(trial_config(TrainConfig(**setup.base), config),
                              storage_path=setup.search_dir, name=name)
    if stop.requested(setup.search_dir):  # started while the search stops: leave it for the next run
        park(cfg)
    # a folder of this name with other values: the search's record was older than its folders
    make_way(cfg, resume=True, refuse_other=False)
    if status_of(read_summary(cfg.run_dir())) in (FINISHED, STOPPED_EARLY):
        return replay(cfg)
    why = StopReason(setup.search_dir, cfg.run_dir())
    rc = run_in_folder(cfg, started, why.forwarded, setup.parent_id or None, "tune", [EpochResults()],
                       tags=lambda rc: {"ray_job.early_stopped": str(is_stop(rc) and why.early).lower()})
    if is_stop(rc) and why.reason == SEARCH_STOPPED:
        park(cfg)
    if rc != ExitCode.DONE and not is_stop(rc):
        raise TrialFailed(f"{cfg.name}: train exited with {rc}; see {cfg.run_dir()}/{SUMMARY_JSON}")


def park(cfg: TrainConfig) -> None:
    """Never returns: the search ends this trial's actor once every running trial has parked."""
    log.info("%s: checkpointed; waiting for the search to stop", cfg.name)
    while True:
        time.sleep(60)


def read_summary(run_dir: storage.Where, name: str = SUMMARY_JSON) -> Optional[dict]:
    """The run folder's summary.json (or `name`); None if it has none that can be read."""
    try:
        return storage.read_json(storage.at(run_dir).join(name))
    except (FileNotFoundError, StorageError, ValueError):
        return None


def status_of(summary: Optional[dict], error: Optional[str] = None) -> str:
    """A trial's status, from its run's summary.json (the record that survives any restart): the
    progress lines, the counts and the report all say this."""
    if error or (summary or {}).get("error"):
        return FAILED
    if summary is None:
        return UNFINISHED
    if summary.get("finished") and summary.get("epochs_completed", 0) >= summary.get("epochs", 0):
        return FINISHED
    if summary.get("stopped") == EARLY_STOPPED:
        return STOPPED_EARLY
    return INTERRUPTED if summary.get("stopped") else UNFINISHED


def replay(cfg: TrainConfig) -> None:
    """Tune hears the epochs again (its record of this trial was older than the run folder)."""
    from ray import tune

    rows = read_metrics(storage.at(cfg.run_dir()).join(METRICS_JSONL))
    log.info("%s: already ran (%d epochs); reporting them without training", cfg.name, len(rows))
    for row in rows:
        tune.report({**row.to_dict(), REPLAYED: True})

