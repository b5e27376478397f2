"""The stop request: how a run is asked to checkpoint where it is and stop (preemption, time limit).

The whole protocol lives here:
  - asking:     `request(run_dir)` writes <run>/.preempt (a local folder or an object store,
                through storage.py); the driver does it on SIGUSR1
                (`stop_on_usr1`), which is what slurm_ray_start.sh sends on SLURM's pre-timeout
                signal; a user may also create the file by hand;
  - a new start clears a request left by the previous (requeued) run: `clear(run_dir)`;
  - a sweep forwards its own request to the point that is running: `forward(sweep, point)`;
  - the workers poll with `StopPoller`: rank 0 looks at the file, an all-reduce tells every rank,
    and the answer is read a few steps later, so the device's queue never drains for it; on
    object storage rank 0 looks from a thread (`Watcher`), so no step waits for the network.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from . import storage
from .storage import Where

STOP_FILE = ".preempt"
POLL_EVERY = 5  # steps between looks at the request
POLL_LAG = 2    # steps between starting the all-reduce and reading its answer
WATCH_EVERY_S = 1.0  # on object storage, rank 0 looks from a thread this often

log = logging.getLogger("ray_job.stop")


def path(run_dir: Where) -> storage.Location:
    return storage.at(run_dir).join(STOP_FILE)


def request(run_dir: Where) -> None:
    path(run_dir).write_text(str(time.time()))


def requested(run_dir: Where) -> bool:
    return path(run_dir).exists()


def clear(run_dir: Where) -> None:
    """A requeued job must not stop at once because of its previous run's request."""
    path(run_dir).delete()


def stop_on_usr1(run_dir: Where) -> None:
    """SIGUSR1 (SLURM's pre-timeout signal, forwarded by slurm_ray_start.sh) requests a stop.

    The request is written at once; if the storage fails just then, a thread keeps trying."""
    def handler(signum, frame):
        try:
            request(run_dir)
        except storage.StorageError as e:
            log.warning("SIGUSR1: cannot write the stop request yet (%s); retrying", e)
            threading.Thread(target=_request_until_written, args=(run_dir,), name="stop-request",
                             daemon=True).start()
            return
        log.info("SIGUSR1: asked the workers to checkpoint and stop")
    signal.signal(signal.SIGUSR1, handler)


def _request_until_written(run_dir: Where, every_s: float = 2.0) -> None:
    while True:
        time.sleep(every_s)
        try:
            request(run_dir)
        except storage.StorageError:
            continue
        log.info("SIGUSR1: stop request written; asked the workers to checkpoint and stop")
        return


@contextlib.contextmanager
def forward(sweep_dir: Where, point_dir: Where, every_s: float = 1.0):
    """While the block runs, a request for the sweep becomes a request for the running point."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(every_s):
            with contextlib.suppress(storage.StorageError):  # a storage outage: look again later
                if requested(sweep_dir) and storage.at(point_dir).is_dir():
                    request(point_dir)

    thread = threading.Thread(target=watch, name="forward-stop", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


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
                self.seen = requested(self.run_dir)
                failing = False
            except storage.StorageError as e:
                if not failing:
                    log.warning("cannot look for a stop request (%s); looking again", e)
                failing = True
            self._done.wait(every_s)

    def __call__(self) -> bool:
        return self.seen

    def close(self) -> None:
        self._done.set()


class StopPoller:
    """Answers "stop now?" after a step, the same on every rank, without stalling the device; and,
    with `checkpoint_every_s`, "checkpoint now?" (rank 0's clock decides, every rank agrees).

    Every POLL_EVERY steps rank 0 reads the file (and its clock) and an asynchronous all-reduce
    (MAX; only rank 0 contributes: 1 = stop, 2 = checkpoint due) starts; POLL_LAG steps later every
    rank waits for it (long done by then) and reads the answer from a host copy made on the
    device's queue. Every rank calls `__call__` after the same steps, so all stop (or checkpoint)
    at the same step. `checkpoint_due` is then True until `checkpointed()` is called.
    """

    STOP, CHECKPOINT = 1, 2

    def __init__(self, run_dir: Where, is_rank0: bool, device: torch.device,
                 every: int = POLL_EVERY, lag: int = POLL_LAG, checkpoint_every_s: float = 0.0):
        self.is_rank0, self.device = is_rank0, device
        self.every, self.lag = every, max(0, min(lag, every - 1))
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.checkpoint_every_s = checkpoint_every_s
        self.checkpoint_due = False
        self._last_checkpoint = time.monotonic()
        self._pending: Optional[tuple] = None  # (step to read at, work, host tensor, event)
        self._watcher: Optional[Watcher] = None
        if is_rank0 and not storage.at(run_dir).is_local:
            self._watcher = Watcher(run_dir)
        self._look = self._watcher or (lambda: requested(run_dir))

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.close()

    def checkpointed(self) -> None:
        """A checkpoint was just saved: the clock for the next timed one starts now."""
        self.checkpoint_due = False
        self._last_checkpoint = time.monotonic()

    def __call__(self, step: int) -> bool:
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

    def at_epoch_end(self) -> bool:
        """At the end of an epoch: the answer of a poll still in flight, else of a fresh one, so an
        epoch shorter than `every` steps still looks (one blocking all-reduce per epoch). A timed
        checkpoint falls due no earlier than the epoch's own."""
        if not self.distributed:
            stop = bool(self._flags() & self.STOP)
        elif self._pending is not None and self._read() & self.STOP:
            stop = True
        else:
            self._start(-1)
            stop = bool(self._read() & self.STOP)
        self.checkpoint_due = False
        return stop

    def _flags(self) -> int:
        """Rank 0's view: the stop request and the checkpoint clock (0 on the other ranks)."""
        if not self.is_rank0:
            return 0
        due = self.checkpoint_every_s > 0 and time.monotonic() - self._last_checkpoint >= self.checkpoint_every_s
        return (self.STOP if self._look() else 0) | (self.CHECKPOINT if due else 0)

    def _answer(self, flags: int) -> bool:
        if flags & self.CHECKPOINT:
            self.checkpoint_due = True
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
