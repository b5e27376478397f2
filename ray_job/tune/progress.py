"""What the search prints while it runs (Ray Tune's own table is off): a line when a trial starts,
ends or fails, and every so often the counts and the best trial so far. Also the hook that ends the
search after a stop request (control.py), since Tune calls it after every step of its loop."""

from __future__ import annotations

import time
from typing import Any, Optional

from ray.tune import Callback

from . import control
from .trial import trial_dirname


def values_text(config: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in config.items())


class SearchProgress(Callback):
    """Progress lines of one search; `every_s`: the longest gap between two status lines."""

    def __init__(self, metric: str, mode: str, epochs: int, num_samples: int, every_s: float = 30.0):
        self.metric, self.mode, self.epochs, self.num_samples = metric, mode, epochs, num_samples
        self.every_s = every_s
        self._printed, self._counts, self._checked = 0.0, None, 0.0

    def setup(self, **info) -> None:
        control.active().take_signals()

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info) -> None:
        print(f"tune: {trial_dirname(trial)} started: {values_text(trial.config)}", flush=True)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info) -> None:
        epoch = (trial.last_result or {}).get("epoch", 0)
        how = f"finished {epoch} epochs" if epoch >= self.epochs else f"stopped early after epoch {epoch}"
        best = self.best_of(trial)
        print(f"tune: {trial_dirname(trial)} {how}" + (f", best {self.metric} {best:.4f}" if best is not None
                                                       else ""), flush=True)

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
        early = sum((t.last_result or {}).get("epoch", 0) < self.epochs for t in done)
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
