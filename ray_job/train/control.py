"""Step control: after every step, the same answer on every rank -- go on, checkpoint here, or
stop here -- without stalling the device. The loop acts on the answer; nothing here saves or
reports anything.

Every POLL_EVERY steps rank 0 looks at the stop request (stop.py) and its checkpoint clock, and an
asynchronous all-reduce (MAX; only rank 0 contributes) starts; POLL_LAG steps later every rank
reads the answer from a host copy made on the device's queue (long done by then). So every rank
stops, or checkpoints, at the same step. On object storage rank 0 looks at the request from a
thread (`Watcher`), so no step waits for the network.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Iterable, Iterator
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


class Action(enum.Enum):
    CONTINUE = "continue"
    CHECKPOINT = "checkpoint"   # the timed checkpoint (--checkpoint-every-min) is due at this step
    STOP = "stop"               # a stop was requested: checkpoint here and stop


class Watcher:
    """Rank 0's look at the request on object storage, where one costs a network round trip:
    a thread looks every `every_s` seconds, and a poll reads its latest answer without waiting."""

    def __init__(self, run_dir: Where, every_s: float = WATCH_EVERY_S):
        self.run_dir, self.seen = run_dir, False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(every_s,), name="stop-watch",
                                        daemon=True)
        self._thread.start()

    def _watch(self, every_s: float) -> None:
        failing = False
        while not self.seen and not self._done.is_set():
            try:
                self.seen = stop.requested(self.run_dir)
                failing = False
            except StorageError as e:
                if not failing:
                    log.warning("cannot look for a stop request (%s); looking again", e)
                failing = True
            self._done.wait(every_s)

    def __call__(self) -> bool:
        return self.seen

    def close(self) -> None:
        self._done.set()


class StepControl:
    """`after_step(step)`: the Action for this step, the same on every rank (every rank calls it
    after the same steps). With `checkpoint_every_s`, rank 0's clock decides when a timed
    checkpoint is due; `checkpointed()` restarts that clock. `at_epoch_end()`: was a stop asked?

    The same poll carries rank 0's checkpoint uploads (`saver`: the Checkpointer): SAVED when an
    upload is over, so that every rank reports it at the same step (`take_report()`), and a timed
    checkpoint falls due only while no upload is in flight. At an epoch's end and before a stop
    (`settle()`) rank 0 first waits for its upload, so the checkpoint that follows never waits.
    """

    STOP, CHECKPOINT, SAVED = 1, 2, 4

    def __init__(self, run_dir: Where, is_rank0: bool, device: torch.device,
                 every: int = POLL_EVERY, lag: int = POLL_LAG, checkpoint_every_s: float = 0.0,
                 saver=None):
        self.is_rank0, self.device = is_rank0, device
        self.every, self.lag = every, max(0, min(lag, every - 1))
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.checkpoint_every_s = checkpoint_every_s
        self.checkpoint_due = self.report_due = False
        self.saver = saver
        self._last_checkpoint = time.monotonic()
        self._pending: Optional[tuple] = None  # (step to read at, work, host tensor, event)
        self._watcher: Optional[Watcher] = None
        if is_rank0 and not at(run_dir).is_local:
            self._watcher = Watcher(run_dir)
        self._look = self._watcher or (lambda: stop.requested(run_dir))

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.close()

    def checkpointed(self) -> None:
        """A checkpoint was just saved: the clock for the next timed one starts now."""
        self.checkpoint_due = False
        self._last_checkpoint = time.monotonic()

    def after_step(self, step: int, steps_in_epoch: int) -> Action:
        """After step `step` of an epoch of `steps_in_epoch`: STOP, CHECKPOINT (a timed one due
        before the epoch's last step, whose own checkpoint comes anyway) or CONTINUE."""
        if self._poll(step):
            return Action.STOP
        if self.checkpoint_due and step < steps_in_epoch:
            return Action.CHECKPOINT
        return Action.CONTINUE

    def _poll(self, step: int) -> bool:
        if not self.distributed:
            return step % self.every == 0 and self._answer(self._flags())
        answer = False
        if self._pending is not None and step >= self._pending[0]:
            answer = self._answer(self._read())
        if step % self.every == 0 and self._pending is None:
            self._start(step)
            if self.lag == 0:
                answer = self._answer(self._read())
        return answer

    def take_report(self) -> bool:
        """Whether rank 0's finished upload is to be reported now (every rank gets the same)."""
        due, self.report_due = self.report_due, False
        return due

    def at_epoch_end(self) -> bool:
        """At the end of an epoch: was a stop asked, by a poll still in flight or by a fresh one
        (so an epoch shorter than `every` steps still looks)? The fresh one follows rank 0's wait
        for its upload, so `take_report()` then tells whether it is to be reported before the
        epoch's own checkpoint. A timed checkpoint falls due no earlier than the epoch's own."""
        stop = self._pending is not None and bool(self._answer(self._read()))
        stop = self.settle() or stop
        self.checkpoint_due = False
        return stop

    def settle(self) -> bool:
        """A blocking look after rank 0 has waited for its upload: was a stop asked? `take_report()`
        then tells whether the upload is to be reported."""
        if self.is_rank0 and self.saver is not None:
            self.saver.wait()
        if not self.distributed:
            return self._answer(self._flags())
        self._start(-1)
        return self._answer(self._read())

    def _flags(self) -> int:
        """Rank 0's view: the stop request and the checkpoint clock (0 on the other ranks)."""
        if not self.is_rank0:
            return 0
        due = self.checkpoint_every_s > 0 and time.monotonic() - self._last_checkpoint >= self.checkpoint_every_s
        idle = self.saver is None or self.saver.idle()
        saved = self.saver is not None and self.saver.saved()
        return ((self.STOP if self._look() else 0) | (self.CHECKPOINT if due and idle else 0)
                | (self.SAVED if saved else 0))

    def _answer(self, flags: int) -> bool:
        if flags & self.CHECKPOINT:
            self.checkpoint_due = True
        if flags & self.SAVED:
            self.report_due = True
        return bool(flags & self.STOP)

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
                     progress=None) -> Iterator[tuple[Step, Action]]:
    """The per-step path of `train` (and of `bench vs-ddp`'s "ours"): each step of the epoch, rank
    0's progress display (`progress`, None on the other ranks), and the step control's answer."""
    for step in steps.run(batches, max_steps, skip):
        if progress is not None:
            progress.on_step(step)
        yield step, control.after_step(step.number, max_steps)
