"""ASHA on epoch results, stopping a trial the way any run of ours stops: with a checkpoint.

Tune's own stop of a trial ends the trial's actor, and with it the run's Ray Train workers in the
middle of a step, before the run writes its summary. Here ASHA (Ray's AsyncHyperBandScheduler, time
attribute `epoch`) decides as usual, and its decision to stop is passed on as a stop request into
the trial's run folder: the run checkpoints at the step the request reaches it (a few seconds
after the epoch ASHA judged), writes summary.json ("stopped early"), and its trial function
returns. A run whose last epoch ends before the request reaches it has finished: the lines, the
counts and the report then say "finished" (progress.py reads the run folder). The trial's last
epoch is never a reason to stop (the run ends there by itself).

Tune keeps no record of a scheduler across a restore (a requeued search starts it afresh), so each
trial that is added -- a new one, or one restored from the search's state -- tells ASHA the epochs
its run folder already holds: the rungs are the same as before the interruption.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.tune.schedulers import AsyncHyperBandScheduler, TrialScheduler

from .. import storage
from ..storage import StorageError
from ..train import stop
from ..train.runfiles import METRICS_JSONL
from ..train.runlog import read_metrics
from .trial import EARLY_STOP_FILE, REPLAYED, trial_dirname

log = logging.getLogger("ray_job.tune")


class EpochASHA(AsyncHyperBandScheduler):
    """ASHA whose stop is a stop request in the trial's run folder (metric and mode come from the
    TuneConfig, as Tune wants them set in one place)."""

    def __init__(self, search_dir: str, metric: str, epochs: int, grace_epochs: int, reduction_factor: float):
        super().__init__(time_attr="epoch", max_t=epochs, grace_period=grace_epochs,
                         reduction_factor=reduction_factor)
        self.search_dir, self.metric_name, self.epochs = search_dir, metric, epochs
        self.stopped: set[str] = set()  # trial folders asked to stop

    def run_dir(self, trial: Any) -> storage.Location:
        return storage.at(self.search_dir).join(trial_dirname(trial))

    def on_trial_add(self, tune_controller, trial) -> None:
        super().on_trial_add(tune_controller, trial)
        for epoch, value in self.epochs_done(trial):
            super().on_trial_result(tune_controller, trial, {"epoch": epoch, self.metric_name: value})

    def epochs_done(self, trial: Any) -> list[tuple[int, float]]:
        """(epoch, metric) of the epochs the trial's run folder holds, before its last epoch."""
        try:
            rows = read_metrics(self.run_dir(trial).join(METRICS_JSONL))
        except (FileNotFoundError, StorageError, ValueError):
            return []
        return [(r.epoch, getattr(r, self.metric_name)) for r in rows if r.epoch < self.epochs]

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        action = super().on_trial_result(tune_controller, trial, result)
        if result.get(REPLAYED) or result.get("epoch", 0) >= self.epochs:
            return TrialScheduler.CONTINUE
        name = trial_dirname(trial)
        if action == TrialScheduler.STOP or name in self.stopped:
            if name not in self.stopped:  # a request: the run goes on until it reaches the run
                print(f"tune: ASHA asks {name} to stop: {self.metric_name} "
                      f"{result.get(self.metric_name, float('nan')):.4f} after epoch {result['epoch']} is "
                      f"behind the other trials at this rung", flush=True)
            self.stopped.add(name)
            try:
                self.run_dir(trial).join(EARLY_STOP_FILE).write_text(str(result["epoch"]))
                stop.request(self.run_dir(trial))
            except StorageError as e:  # asked again at its next result
                log.warning("tune: cannot ask %s to stop yet: %s", name, e)
        return TrialScheduler.CONTINUE
