"""The stop request: how a run is asked to checkpoint where it is and stop (preemption, the time
limit, Ctrl-C).

The protocol, all of it here:
  - asking:  `request(run_dir)` writes <run>/.preempt (a local folder or an object store); the
             driver does it on SIGUSR1 (`stop_on_usr1`), which is what slurm_ray_start.sh sends on
             SLURM's pre-timeout signal; a user may also create the file by hand;
  - a new start clears a request left by the previous (requeued) run: `clear(run_dir)`;
  - a sweep forwards its own request to the point that is running: `forward(sweep, point)`;
  - the workers look for it through their step control (control.py), which answers STOP at the
    same step on every rank.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time

from .. import storage
from ..storage import Where
from .runfiles import STOP_FILE

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
