"""Rank 0's progress display: is the job alive, how fast does it go, when will it end. `--progress`:
  lines  after the first step, then every --log-every steps or EVERY_S seconds, whichever comes
         first: step/total, loss, images/s, data vs compute ms (the raw-DDP baseline's fields) and
         the ETA of the epoch and of the run. For SLURM logs and `ray job logs`.
  bar    a live tqdm bar with the same figures, drawn by the driver (Ray's tqdm_ray sends its state
         from the worker, so it works from any node).
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from .engine import Step

EVERY_S = 10.0

log = logging.getLogger("ray_job")


def hms(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """Built once per run: `start_epoch()` at each epoch's start, `on_step` after every step, `close()`
    at the epoch's end."""

    def __init__(self, mode: str, epochs: int, steps: int, global_batch: int, log_every: int,
                 every_s: float = EVERY_S):
        self.mode, self.epochs, self.steps = mode, epochs, steps
        self.global_batch, self.log_every, self.every_s = global_batch, log_every, every_s

    def start_epoch(self, epoch: int, start_step: int, eval_s: Optional[float]) -> None:
        """Epoch `epoch` (0-based) starts at `start_step`; an evaluation takes about `eval_s`."""
        self.epoch, self.eval_s = epoch, eval_s or 0.0
        self.started = time.perf_counter()
        self.last_print = 0.0
        self.done = 0  # steps taken in this process (the first ones may be resumed past)
        self.bar = None
        if self.mode == "bar":
            from ray.experimental.tqdm_ray import tqdm

            self.bar = tqdm(total=self.steps, desc=f"epoch {epoch + 1}/{self.epochs}", unit="step")
            self.bar.n = start_step

    def figures(self, done: Step) -> str:
        loss = float(done.loss.detach())  # waits for the device (so before the clock): never every step
        per_step = (time.perf_counter() - self.started) / max(self.done, 1)
        left_epoch = (self.steps - done.number) * per_step
        left_run = left_epoch + self.eval_s + (self.epochs - self.epoch - 1) * (
            self.steps * per_step + self.eval_s)
        return (f"Loss: {loss:.4f}, {self.global_batch / per_step:.0f} img/s, data "
                f"{done.data_s * 1e3:.1f} ms, train {done.compute_s * 1e3:.1f} ms, ETA epoch "
                f"{hms(left_epoch)}, run {hms(left_run)}")

    def on_step(self, done: Step) -> None:
        step = done.number
        self.done += 1
        now = time.perf_counter()
        due = (self.done == 1 or now - self.last_print >= self.every_s
               or (self.log_every and step % self.log_every == 0) or step == self.steps)
        if self.bar is not None:
            self.bar.n = step
            if due or now - self.last_print >= 1.0:
                self.last_print = now
                self.bar.set_description(f"epoch {self.epoch + 1}/{self.epochs} {self.figures(done)}")
            return
        if not due or not self.log_every:
            return
        self.last_print = now
        log.info("Epoch [%d/%d], Step [%d/%d], %s", self.epoch + 1, self.epochs, step, self.steps,
                 self.figures(done))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
