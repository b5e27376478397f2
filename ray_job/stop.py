"""The stop request: how a run is asked to checkpoint where it is and stop (preemption, time limit).

The whole protocol lives here:
  - asking:     `request(run_dir)` writes <run>/.preempt; the driver does it on SIGUSR1
                (`stop_on_usr1`), which is what slurm_ray_start.sh sends on SLURM's pre-timeout
                signal; a user may also create the file by hand;
  - a new start clears a request left by the previous (requeued) run: `clear(run_dir)`;
  - a sweep forwards its own request to the point that is running: `forward(sweep, point)`;
  - the workers poll with `StopPoller`: rank 0 looks at the file, an all-reduce tells every rank,
    and the answer is read a few steps later, so the device's queue never drains for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

STOP_FILE = ".preempt"
POLL_EVERY = 5  # steps between looks at the request
POLL_LAG = 2    # steps between starting the all-reduce and reading its answer

log = logging.getLogger("ray_job.stop")


def path(run_dir: str) -> str:
    return os.path.join(run_dir, STOP_FILE)


def request(run_dir: str) -> None:
    with open(path(run_dir), "w") as f:
        f.write(str(time.time()))


def requested(run_dir: str) -> bool:
    return os.path.exists(path(run_dir))


def clear(run_dir: str) -> None:
    """A requeued job must not stop at once because of its previous run's request."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(path(run_dir))


def stop_on_usr1(run_dir: str) -> None:
    """SIGUSR1 (SLURM's pre-timeout signal, forwarded by slurm_ray_start.sh) requests a stop."""
    def handler(signum, frame):
        request(run_dir)
        log.info("SIGUSR1: asked the workers to checkpoint and stop")
    signal.signal(signal.SIGUSR1, handler)


@contextlib.contextmanager
def forward(sweep_dir: str, point_dir: str, every_s: float = 1.0):
    """While the block runs, a request for the sweep becomes a request for the running point."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(every_s):
            if requested(sweep_dir) and os.path.isdir(point_dir):
                request(point_dir)

    thread = threading.Thread(target=watch, name="forward-stop", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


class StopPoller:
    """Answers "stop now?" after a step, the same on every rank, without stalling the device.

    Every POLL_EVERY steps rank 0 reads the file and an asynchronous all-reduce (MAX) starts;
    POLL_LAG steps later every rank waits for it (long done by then) and reads the answer from a
    host copy made on the device's queue. Every rank calls `__call__` after the same steps, so all
    stop at the same step.
    """

    def __init__(self, run_dir: str, is_rank0: bool, device: torch.device,
                 every: int = POLL_EVERY, lag: int = POLL_LAG):
        self.run_dir, self.is_rank0, self.device = run_dir, is_rank0, device
        self.every, self.lag = every, max(0, min(lag, every - 1))
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self._pending: Optional[tuple] = None  # (step to read at, work, host tensor, event)

    def __call__(self, step: int) -> bool:
        if not self.distributed:
            return step % self.every == 0 and self.is_rank0 and requested(self.run_dir)
        answer = False
        if self._pending is not None and step >= self._pending[0]:
            answer = self._read()
        if step % self.every == 0 and self._pending is None:
            self._start(step)
            if self.lag == 0:
                answer = self._read()
        return answer

    def finish(self) -> bool:
        """At the end of an epoch: the answer of a poll still in flight (False if none)."""
        return self._read() if self._pending is not None else False

    def _start(self, step: int) -> None:
        flag = torch.tensor([1 if self.is_rank0 and requested(self.run_dir) else 0],
                            dtype=torch.int32, device=self.device)
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

    def _read(self) -> bool:
        _, work, host, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        else:
            work.wait()
        return bool(host.item())
