"""One writer per run folder: a lease (`<run>/.lease.json`) that a run's driver takes before any worker
starts, refreshes while it runs, and gives back at its end.

The lease names its owner (a random id, host, PID, SLURM job id) and carries a heartbeat. It is taken
when there is none, or when its owner is gone: the heartbeat is older than STALE_S, the owner was a
process of this host that no longer exists, or it was this same SLURM job before a requeue. A live
owner's lease is refused with one line naming it.

The same on a local folder and on object storage, which pyarrow gives no conditional write: the
lease is written, then read back after SETTLE_S -- of two drivers that start together, the one whose
write came last keeps it and the other sees a foreign owner and stops. A takeover between a check
and a write further apart than SETTLE_S is caught by the next heartbeat, which checks the owner
before it writes (and says so loudly).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Optional

from ..core.errors import UsageError
from ..core.jsonio import dumps, loads
from .faults import StorageError
from .location import Location

LEASE_FILE = ".lease.json"
HEARTBEAT_S = 10.0
STALE_S = 60.0
SETTLE_S = 1.0

log = logging.getLogger("ray_job.lease")


@dataclass(frozen=True)
class Owner:
    id: str
    host: str
    pid: int
    slurm_job_id: str
    started: float
    heartbeat: float

    @classmethod
    def me(cls) -> Owner:
        now = time.time()
        return cls(uuid.uuid4().hex, socket.gethostname(), os.getpid(), os.environ.get("SLURM_JOB_ID", ""), now, now)

    def describe(self) -> str:
        job = f", SLURM job {self.slurm_job_id}" if self.slurm_job_id else ""
        return f"pid {self.pid} on {self.host}{job}, started {time.strftime('%H:%M:%S', time.localtime(self.started))}"

    def gone(self, now: float) -> Optional[str]:
        """Why this owner no longer holds its lease, or None while it does."""
        if now - self.heartbeat > STALE_S:
            return f"its last heartbeat was {now - self.heartbeat:.0f} s ago"
        if self.host == socket.gethostname() and not os.path.exists(f"/proc/{self.pid}"):
            return "its process is gone"
        if self.slurm_job_id and self.slurm_job_id == os.environ.get("SLURM_JOB_ID"):
            return "it was this SLURM job before its requeue"
        return None


class Lease:
    """The lease on one run folder, held by this process once `take()` returned."""

    def __init__(self, run_dir: Location):
        self.file = run_dir.join(LEASE_FILE)
        self.me = Owner.me()
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def current(self) -> Optional[Owner]:
        try:
            return Owner(**loads(self.file.read_text()))
        except (FileNotFoundError, ValueError, TypeError):  # none, torn or foreign: nobody holds it
            return None

    def take(self) -> None:
        """Takes the lease, or raises UsageError naming the run that holds it."""
        try:
            holder = self.current()
            if holder is not None and holder.id != self.me.id:
                why = holder.gone(time.time())
                if why is None:
                    raise UsageError(f"run folder {self.file.parent().uri} is in use by another run "
                                     f"({holder.describe()}, last seen {time.time() - holder.heartbeat:.0f} s "
                                     f"ago); wait for it to end, or use another --name")
                log.warning("taking over run folder %s from %s: %s", self.file.parent().uri, holder.describe(), why)
            self._write()
            time.sleep(SETTLE_S)
            holder = self.current()
        except StorageError as e:
            raise UsageError(f"cannot take the run folder's lease: {e}") from None
        if holder is None or holder.id != self.me.id:
            other = holder.describe() if holder else "someone"
            raise UsageError(f"run folder {self.file.parent().uri} was taken at the same moment by another run "
                             f"({other}); use another --name, or run only one of them")
        self._thread = threading.Thread(target=self._beat, name="lease-heartbeat", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        self.me = replace(self.me, heartbeat=time.time())
        self.file.write_text(dumps(asdict(self.me)))

    def _beat(self) -> None:
        failing = False
        while not self._done.wait(HEARTBEAT_S):
            try:
                holder = self.current()
                if holder is not None and holder.id != self.me.id:
                    log.error("run folder %s was taken over by %s while this run holds it: two runs may "
                              "now write there", self.file.parent().uri, holder.describe())
                    return
                self._write()
                failing = False
            except StorageError as e:
                if not failing:
                    log.warning("cannot refresh the run folder's lease (%s); trying again", e)
                failing = True

    def __enter__(self) -> Lease:
        self.take()
        return self

    def __exit__(self, *exc) -> None:
        self.give_back()

    def give_back(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(5)
        try:
            holder = self.current()
            if holder is not None and holder.id == self.me.id:
                self.file.delete()
        except StorageError as e:
            log.warning("cannot give the run folder's lease back (%s); the next run takes it over", e)
