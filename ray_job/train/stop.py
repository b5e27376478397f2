"""The stop request: how a run is asked to checkpoint where it is and stop (preemption, the time
limit, Ctrl-C). The protocol, all of it here:
  - asking: `request(run_dir)` writes <run>/.preempt (local or object storage); the driver does it
    on SIGUSR1 (what slurm_ray_start.sh sends on SLURM's pre-timeout signal), Ctrl-C and SIGTERM
    (`stop_on_signals`); a user may also create the file;
  - a new start clears a request left by the previous (requeued) run: `clear(run_dir)`;
  - a sweep forwards its own request to the point that is running: `forward(sweep, point)`;
  - the workers look for it through their step control (control.py): STOP at the same step on every rank.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time

from .. import storage
from ..core.exits import ExitCode
from ..storage import Where
from .runfiles import STOP_FILE

log = logging.getLogger("ray_job.stop")


def request(run_dir: Where) -> None:
    storage.at(run_dir).join(STOP_FILE).write_text(str(time.time()))


def requested(run_dir: Where) -> bool:
    return storage.at(run_dir).join(STOP_FILE).exists()


def clear(run_dir: Where) -> None:
    """A requeued job must not stop at once because of its previous run's request."""
    storage.at(run_dir).join(STOP_FILE).delete()


# What each signal is, to the user and to the exit code (core/exits.py).
SIGNALS = {signal.SIGUSR1: ("SIGUSR1", ExitCode.STOPPED), signal.SIGINT: ("Ctrl-C", ExitCode.INTERRUPTED),
           signal.SIGTERM: ("SIGTERM", ExitCode.TERMINATED)}


class Signals:
    """What the signals of one run asked for: the first SIGUSR1, SIGINT or SIGTERM (`ray job stop`, a
    terminal closing) writes the stop request; a second SIGINT or SIGTERM aborts at once
    (KeyboardInterrupt in the main thread). `reason` and `exit_code`: the first signal's."""

    def __init__(self, run_dir: Where):
        self.run_dir, self.first = run_dir, None
        self.reason, self.exit_code = "a stop request", ExitCode.STOPPED

    def handle(self, signum, frame) -> None:
        if self.first is not None:
            if signum != signal.SIGUSR1:
                raise KeyboardInterrupt(f"second {SIGNALS[signum][0]}")
            return
        self.first = signum
        self.reason, self.exit_code = SIGNALS[signum]
        again = "" if signum == signal.SIGUSR1 else f" ({self.reason} again to abort at once)"
        try:
            request(self.run_dir)
        except storage.StorageError as e:
            log.warning("%s: cannot write the stop request yet (%s); retrying", self.reason, e)
            threading.Thread(target=_request_until_written, args=(self.run_dir,), name="stop-request",
                             daemon=True).start()
            return
        log.info("%s: asked the workers to checkpoint and stop%s", self.reason, again)


@contextlib.contextmanager
def stop_on_signals(run_dir: Where, signums=tuple(SIGNALS)):
    """While the block runs, these signals are stop requests (see Signals); the previous handlers
    come back after it (a sweep's own, between its points)."""
    signals = Signals(run_dir)
    previous = {s: signal.signal(s, signals.handle) for s in signums}
    try:
        yield signals
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _request_until_written(run_dir: Where, every_s: float = 2.0) -> None:
    while True:
        time.sleep(every_s)
        try:
            request(run_dir)
        except storage.StorageError:
            continue
        log.info("stop request written; asked the workers to checkpoint and stop")
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
