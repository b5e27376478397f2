"""Step control: after every step, one answer, the same on every rank -- a `Decision` -- without
stalling the device. The training loop acts on it (worker.py); nothing here saves or reports.

Every POLL_EVERY steps rank 0 (the master process) puts its flags into an asynchronous all-reduce
(MAX; only rank 0 contributes): a stop was requested (stop.py), its checkpoint clock has run out
while no upload is in flight, its background upload is over. POLL_LAG steps later every rank reads
the answer from a host copy made on the device's queue (long done by then), so every rank stops,
checkpoints or reports at the same step. On object storage rank 0 looks at the request from a
thread (`Watcher`), so no step waits for the network.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..storage import StorageError, Where, at
from . import stop
from .engine import EpochSteps, Step

POLL_EVERY = 5  # steps between looks at the request
POLL_LAG = 2    # steps between starting the all-reduce and reading its answer
WATCH_EVERY_S = 1.0  # on object storage, rank 0 looks from a thread this often

log = logging.getLogger("ray_job.stop")


@dataclass(frozen=True)
class Decision:
    """What every rank does after a step, in this order: report rank 0's finished upload, then
    checkpoint here; and stop after that checkpoint."""

    stop: bool = False          # a stop was requested: checkpoint here and stop
    checkpoint: bool = False    # a checkpoint is due here (the timed one, or an epoch's own)
    report_saved: bool = False  # rank 0's background upload is over: every rank reports it now


GO_ON = Decision()


class Watcher:
    """Rank 0's look at the request on object storage, where one costs a network round trip: a
    thread looks every WATCH_EVERY_S seconds (until `done` is set), and a poll reads its latest
    answer without waiting."""

    def __init__(self, run_dir: Where):
        self.run_dir, self.seen, self.done = run_dir, False, threading.Event()
        threading.Thread(target=self._watch, name="stop-watch", daemon=True).start()

    def _watch(self) -> None:
        failing = False
        while not self.seen and not self.done.is_set():
            try:
                self.seen = stop.requested(self.run_dir)
                failing = False
            except StorageError as e:
                if not failing:
                    log.warning("cannot look for a stop request (%s); looking again", e)
                failing = True
            self.done.wait(WATCH_EVERY_S)

    def __call__(self) -> bool:
        return self.seen


class StepControl:
    """Rank 0's flags, for every rank after the same steps: the stop request, `upload_over()`, and its
    checkpoint clock (`checkpoint_every_s`, restarted by `checkpointed()`; nothing falls due while `busy()`)."""

    STOP, CHECKPOINT, SAVED = 1, 2, 4

    def __init__(self, run_dir: Where, master_process: bool, device: torch.device,
                 every: int = POLL_EVERY, lag: int = POLL_LAG, checkpoint_every_s: float = 0.0,
                 busy: Callable[[], bool] = lambda: False, upload_over: Callable[[], bool] = lambda: False):
        self.master_process, self.device = master_process, device
        self.every, self.lag = every, max(0, min(lag, every - 1))
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.checkpoint_every_s = checkpoint_every_s
        self.busy, self.upload_over = busy, upload_over
        self._last_checkpoint = time.monotonic()
        self._pending: Optional[tuple] = None  # (step to read at, work, host tensor, event)
        self._watcher = Watcher(run_dir) if master_process and not at(run_dir).is_local else None
        self._look = self._watcher or (lambda: stop.requested(run_dir))

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.done.set()

    def checkpointed(self) -> None:
        self._last_checkpoint = time.monotonic()

    def after_step(self, step: int, steps_in_epoch: int) -> Decision:
        """GO_ON, or what rank 0's flags say (a timed checkpoint only before the epoch's last step,
        whose own checkpoint comes anyway)."""
        flags = self._poll(step)
        if not flags:
            return GO_ON
        stopping = bool(flags & self.STOP)
        return Decision(stop=stopping, report_saved=bool(flags & self.SAVED),
                        checkpoint=bool(flags & self.CHECKPOINT) and not stopping and step < steps_in_epoch)

    def _poll(self, step: int) -> int:
        if not self.distributed:
            return self._flags() if step % self.every == 0 else 0
        flags = 0
        if self._pending is not None and step >= self._pending[0]:
            flags = self._read()
        if step % self.every == 0 and self._pending is None:
            self._start(step)
            if self.lag == 0:
                flags = self._read()
        return flags

    def look_now(self) -> Decision:
        """A blocking look, after a poll still in flight (so an epoch shorter than `every` steps
        still looks): was a stop asked, is an upload over? Never a timed checkpoint. The caller
        has let rank 0 wait for its upload first, so the checkpoint that follows never waits."""
        flags = self._read() if self._pending is not None else 0
        if self.distributed:
            self._start(-1)
            flags |= self._read()
        else:
            flags |= self._flags()
        return Decision(stop=bool(flags & self.STOP), report_saved=bool(flags & self.SAVED))

    def _flags(self) -> int:
        if not self.master_process:
            return 0
        due = self.checkpoint_every_s > 0 and time.monotonic() - self._last_checkpoint >= self.checkpoint_every_s
        return ((self.STOP if self._look() else 0) | (self.CHECKPOINT if due and not self.busy() else 0)
                | (self.SAVED if self.upload_over() else 0))

    def _start(self, step: int) -> None:
        flag = torch.tensor([self._flags()], dtype=torch.int32, device=self.device)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
        event = None
        if self.device.type == "cuda":
            work.wait()  # orders the copy after the all-reduce on the current stream; no host wait
            host = torch.empty_like(flag, device="cpu").pin_memory()
            host.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = flag
        self._pending = (step + self.lag, work, host, event)

    def _read(self) -> int:
        _, work, host, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        else:
            work.wait()
        return int(host.item())


def controlled_steps(steps: EpochSteps, batches: Iterable, max_steps: int, skip: int, control: StepControl,
                     progress=None) -> Iterator[tuple[Step, Decision]]:
    """Each step of the epoch, shown by rank 0's `progress` (None elsewhere), with its Decision: the
    per-step path of `train` and of `bench vs-ddp`'s "ours"."""
    for step in steps.run(batches, max_steps, skip):
        if progress is not None:
            progress.on_step(step)
        yield step, control.after_step(step.number, max_steps)
