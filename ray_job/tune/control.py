"""The search while it runs, on the driver: progress lines, and how a stop request ends it.

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
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from typing import Any, Optional
from collections.abc import Callable

from .. import storage
from ..storage import StorageError
from ..storage.lease import STALE_S, Lease
from ..train import stop
from .trial import trial_dirname

log = logging.getLogger("ray_job.tune")
STOP_WAIT_S = 600.0  # the longest the search waits for its trials to checkpoint after a stop request


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
            owner = Lease(storage.at(self.search_dir).join(trial_dirname(trial))).current()
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
