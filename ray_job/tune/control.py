"""The search while it runs, on the driver: progress lines, ASHA, and how a stop request ends it.

SearchProgress, a Tune callback (Tune's own table is off), prints a line when a trial starts, ends
or fails, and every so often the counts and the best trial so far; Tune calls it after every step of
its loop, so it also ends the search after a stop request.

Stop requests (SIGUSR1 from slurm_ray_start.sh, Ctrl-C, SIGTERM, or a `.preempt` file in the search
folder) go to every running trial (each trial forwards the search's request to its run, as a
scaling sweep does to its point). The runs checkpoint and stop; each trial function then parks
(trial.py). Once no running trial still holds its run folder's lease, the search ends Tune the way
Tune ends on SIGUSR1: it saves its state -- the parked trials as unfinished -- and returns. A second
Ctrl-C or SIGTERM aborts at once (the trials resume from their last checkpoints all the same).

Tune runs on the main thread and installs its own SIGINT/SIGUSR1 handler when it starts; the
callback's `setup` (called right after) puts ours in its place and keeps Tune's, to end the run
with it. Tune pickles its callbacks with the search (tuner.pkl) and restores them from there, so
the callback holds only plain settings and finds this process's live state in `ACTIVE`.

ASHA: Tune's own stop of a trial ends its actor, and with it the run's workers mid-step, before the
run writes its summary. So EpochASHA's stop is a stop request in the trial's run folder: the run
checkpoints at the step it reaches (a few seconds after the epoch ASHA judged), writes summary.json
("stopped early") and its trial function returns; a run whose last epoch ends first has finished
(the lines, counts and report read the run folder). Tune keeps no scheduler across a restore, so
each trial added tells ASHA the epochs its run folder holds: the rungs stay as they were.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any, Optional

from ray.tune import Callback
from ray.tune.schedulers import AsyncHyperBandScheduler, TrialScheduler

from .. import storage
from ..storage import StorageError
from ..storage.lease import STALE_S, Lease
from ..train import stop
from ..train.runfiles import METRICS_JSONL
from ..train.runlog import read_metrics
from .options import values_text
from .trial import EARLY_STOP_FILE, FINISHED, REPLAYED, STOPPED_EARLY, read_summary, status_of, trial_dirname

log = logging.getLogger("ray_job.tune")
STOP_WAIT_S = 600.0  # the longest the search waits for its trials to checkpoint after a stop request


def run_dir(search_dir: str, trial: Any) -> storage.Location:
    return storage.at(search_dir).join(trial_dirname(trial))


class SearchControl:
    """This process's search: its stop signals, and the handle that ends Tune."""

    def __init__(self, search_dir: str):
        self.search_dir = search_dir
        self.signals = stop.Signals(search_dir)
        self.end_tune: Optional[Callable[[int, Any], None]] = None
        self.previous: dict = {}  # the handlers before the search's
        self.stop_seen: Optional[float] = None
        self.ended = False

    def take_signals(self) -> None:
        """SIGUSR1, Ctrl-C and SIGTERM become stop requests (stop.Signals). Called at the start, and
        on the main thread again once Tune has installed its own handler, which is kept to end Tune."""
        current = signal.getsignal(signal.SIGUSR1)
        if callable(current) and getattr(current, "__self__", None) is not self.signals:
            self.end_tune = current
        for signum in stop.SIGNALS:
            self.previous.setdefault(signum, signal.getsignal(signum))
            signal.signal(signum, self.signals.handle)

    def give_back_signals(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def stop_requested(self) -> bool:
        if self.signals.first is not None:
            return True
        try:
            return stop.requested(self.search_dir)
        except StorageError:
            return False

    def end_when_parked(self, running: list[Any]) -> None:
        """After a stop request: ends Tune once no running trial's run holds its folder."""
        if self.ended or not self.stop_requested():
            return
        now = time.monotonic()
        self.stop_seen = self.stop_seen or now
        busy = [trial_dirname(t) for t in running if self.holds_lease(t)]
        if busy and now - self.stop_seen < STOP_WAIT_S:
            return
        if busy:
            log.warning("tune: %s still running %.0f s after the stop request; ending the search anyway",
                        ", ".join(busy), STOP_WAIT_S)
        print("tune: every running trial has checkpointed; saving the search's state", flush=True)
        self.ended = True
        if self.end_tune is not None:
            self.end_tune(signal.SIGUSR1, None)

    def holds_lease(self, trial: Any) -> bool:
        """A live run holds the trial's folder (a parked trial gave its lease back). Not the lease's
        own takeover rule: to it, every owner of this SLURM job is gone (it was there before a
        requeue), and the trials are this job's."""
        try:
            owner = Lease(run_dir(self.search_dir, trial)).current()
        except StorageError:
            return True  # cannot tell yet: ask again
        if owner is None or time.time() - owner.heartbeat > STALE_S:
            return False
        return not (owner.host == socket.gethostname() and not os.path.exists(f"/proc/{owner.pid}"))


ACTIVE: Optional[SearchControl] = None


def active() -> SearchControl:
    if ACTIVE is None:
        raise RuntimeError("no search is running in this process")
    return ACTIVE


class SearchProgress(Callback):
    """Progress lines of one search; `every_s`: the longest gap between two status lines."""

    def __init__(self, metric: str, mode: str, epochs: int, num_samples: int, search_dir: str,
                 every_s: float = 30.0):
        self.metric, self.mode, self.epochs, self.num_samples = metric, mode, epochs, num_samples
        self.search_dir, self.every_s = search_dir, every_s
        self._printed, self._counts, self._checked = 0.0, None, 0.0
        self._status: dict[str, str] = {}  # trial folder -> its status once it ended

    def setup(self, **info) -> None:
        active().take_signals()

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info) -> None:
        print(f"tune: {trial_dirname(trial)} started: {values_text(trial.config)}", flush=True)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info) -> None:
        status, folder = self.status(trial), run_dir(self.search_dir, trial)
        epochs = (read_summary(folder) or {}).get("epochs_completed", 0)
        how = {STOPPED_EARLY: f"stopped early by ASHA after {epochs} epoch(s)",
               FINISHED: f"finished {epochs} epochs"}.get(status, f"{status} after {epochs} epoch(s)")
        if status == FINISHED and folder.join(EARLY_STOP_FILE).exists():
            how += " (ASHA's stop request came after its last epoch)"
        best = self.best_of(trial)
        print(f"tune: {trial_dirname(trial)} {how}" + (f", best {self.metric} {best:.4f}" if best is not None else ""),
              flush=True)

    def status(self, trial: Any) -> str:
        """An ended trial's status, read once from its run folder (as the report reads it)."""
        name = trial_dirname(trial)
        if name not in self._status:
            self._status[name] = status_of(read_summary(run_dir(self.search_dir, trial)))
        return self._status[name]

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info) -> None:
        print(f"tune: {trial_dirname(trial)} failed (its run folder and Ray's log above say why)", flush=True)

    def on_step_end(self, iteration: int, trials: list, **info) -> None:
        now = time.monotonic()
        if now - self._checked >= 1.0:
            self._checked = now
            active().end_when_parked([t for t in trials if t.status == "RUNNING"])
        counts = self.counts(trials)
        if counts != self._counts or now - self._printed >= self.every_s:
            self._counts, self._printed = counts, now
            line = (f"tune: {counts['running']} running, {counts['finished']} finished, {counts['early']} "
                    f"stopped early, {counts['failed']} failed, {counts['waiting']} to go")
            scored = [(b, t) for t in trials if (b := self.best_of(t)) is not None]
            if scored:
                value, trial = (max if self.mode == "max" else min)(scored, key=lambda bt: bt[0])
                line += f" | best {self.metric} {value:.4f}: {trial_dirname(trial)} ({values_text(trial.config)})"
            print(line, flush=True)

    def best_of(self, trial: Any) -> Optional[float]:
        return ((getattr(trial, "metric_analysis", None) or {}).get(self.metric) or {}).get(self.mode)

    def counts(self, trials: list) -> dict:
        done = [t for t in trials if t.status == "TERMINATED"]
        early = sum(self.status(t) == STOPPED_EARLY for t in done)
        running = sum(t.status == "RUNNING" for t in trials)
        failed = sum(t.status == "ERROR" for t in trials)
        return dict(running=running, finished=len(done) - early, early=early, failed=failed,
                    waiting=self.num_samples - len(done) - running - failed)


class EpochASHA(AsyncHyperBandScheduler):
    """ASHA whose stop is a stop request in the trial's run folder (metric and mode come from the
    TuneConfig, as Tune wants them set in one place)."""

    def __init__(self, search_dir: str, metric: str, epochs: int, grace_epochs: int, reduction_factor: float):
        super().__init__(time_attr="epoch", max_t=epochs, grace_period=grace_epochs,
                         reduction_factor=reduction_factor)
        self.search_dir, self.metric_name, self.epochs = search_dir, metric, epochs
        self.stopped: set[str] = set()  # trial folders asked to stop

    def on_trial_add(self, tune_controller, trial) -> None:
        """Tells ASHA the epochs the trial's run folder holds, before its last epoch."""
        super().on_trial_add(tune_controller, trial)
        try:
            rows = read_metrics(run_dir(self.search_dir, trial).join(METRICS_JSONL))
        except (FileNotFoundError, StorageError, ValueError):
            rows = []
        for r in rows:
            if r.epoch < self.epochs:
                result = {"epoch": r.epoch, self.metric_name: getattr(r, self.metric_name)}
                super().on_trial_result(tune_controller, trial, result)

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
            folder = run_dir(self.search_dir, trial)
            try:
                folder.join(EARLY_STOP_FILE).write_text(str(result["epoch"]))
                stop.request(folder)
            except StorageError as e:  # asked again at its next result
                log.warning("tune: cannot ask %s to stop yet: %s", name, e)
        return TrialScheduler.CONTINUE
