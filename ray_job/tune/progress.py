"""What the search prints while it runs (Ray Tune's own table is off): a line when a trial starts,
ends or fails, and every so often the counts and the best trial so far. Also the hook that ends the
search after a stop request (control.py), since Tune calls it after every step of its loop."""

from __future__ import annotations

import time
from typing import Any, Optional

from ray.tune import Callback

from .. import storage
from . import control
from .trial import EARLY_STOP_FILE, FINISHED, STOPPED_EARLY, read_summary, status_of, trial_dirname


def values_text(config: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in config.items())


class SearchProgress(Callback):
    """Progress lines of one search; `every_s`: the longest gap between two status lines."""

    def __init__(self, metric: str, mode: str, epochs: int, num_samples: int, search_dir: str,
                 every_s: float = 30.0):
        self.metric, self.mode, self.epochs, self.num_samples = metric, mode, epochs, num_samples
        self.search_dir, self.every_s = search_dir, every_s
        self._printed, self._counts, self._checked = 0.0, None, 0.0
        self._status: dict[str, str] = {}  # trial folder -> its status once it ended

    def setup(self, **info) -> None:
        control.active().take_signals()

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info) -> None:
        print(f"tune: {trial_dirname(trial)} started: {values_text(trial.config)}", flush=True)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info) -> None:
        name, status = trial_dirname(trial), self.status(trial)
        epochs = (read_summary(self.run_dir(trial)) or {}).get("epochs_completed", 0)
        how = {STOPPED_EARLY: f"stopped early by ASHA after {epochs} epoch(s)",
               FINISHED: f"finished {epochs} epochs"}.get(status, f"{status} after {epochs} epoch(s)")
        if status == FINISHED and storage.at(self.run_dir(trial)).join(EARLY_STOP_FILE).exists():
            how += " (ASHA's stop request came after its last epoch)"
        best = self.best_of(trial)
        print(f"tune: {name} {how}" + (f", best {self.metric} {best:.4f}" if best is not None else ""), flush=True)

    def run_dir(self, trial: Any) -> str:
        return storage.at(self.search_dir).join(trial_dirname(trial)).uri

    def status(self, trial: Any) -> str:
        """An ended trial's status, read once from its run folder (as the report reads it)."""
        name = trial_dirname(trial)
        if name not in self._status:
            self._status[name] = status_of(read_summary(self.run_dir(trial)))
        return self._status[name]

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info) -> None:
        print(f"tune: {trial_dirname(trial)} failed (its run folder and Ray's log above say why)", flush=True)

    def on_step_end(self, iteration: int, trials: list, **info) -> None:
        now = time.monotonic()
        if now - self._checked >= 1.0:
            self._checked = now
            control.active().end_when_parked([t for t in trials if t.status == "RUNNING"])
        counts = self.counts(trials)
        if counts != self._counts or now - self._printed >= self.every_s:
            self._counts, self._printed = counts, now
            print(self.status_line(trials, counts), flush=True)

    def best_of(self, trial: Any) -> Optional[float]:
        return ((getattr(trial, "metric_analysis", None) or {}).get(self.metric) or {}).get(self.mode)

    def counts(self, trials: list) -> dict:
        done = [t for t in trials if t.status == "TERMINATED"]
        early = sum(self.status(t) == STOPPED_EARLY for t in done)
        running = sum(t.status == "RUNNING" for t in trials)
        return dict(running=running, finished=len(done) - early, early=early,
                    failed=sum(t.status == "ERROR" for t in trials),
                    waiting=self.num_samples - len(done) - running - sum(t.status == "ERROR" for t in trials))

    def status_line(self, trials: list, counts: dict) -> str:
        line = (f"tune: {counts['running']} running, {counts['finished']} finished, {counts['early']} "
                f"stopped early, {counts['failed']} failed, {counts['waiting']} to go")
        scored = [(b, t) for t in trials if (b := self.best_of(t)) is not None]
        if scored:
            value, trial = (max if self.mode == "max" else min)(scored, key=lambda bt: bt[0])
            line += f" | best {self.metric} {value:.4f}: {trial_dirname(trial)} ({values_text(trial.config)})"
        return line
