"""Holding a run at a chosen step (RJ_HOLD_FILE): a debugging aid, and what the tests use to act on
a run at a known point (a signal, a lost node, a stopped server) on a machine of any speed.

With RJ_HOLD_FILE set (the driver passes it on to every worker), rank 0 looks at that file after
every step. When it names a position "EPOCH STEP" (as the progress lines count: epoch from 1, the
step within it) that this step has reached, rank 0 writes where it is and its PID ("EPOCH STEP
PID") to RJ_HOLD_FILE + ".held" and waits until the file is gone or names a later position; the
other ranks wait in their next collective. Nothing else changes: a stop request, a lost peer or a
signal acts on a held run as on a running one. Without RJ_HOLD_FILE nothing is looked at. A
search's trials share the variable: each is held at the step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Optional

ENV = "RJ_HOLD_FILE"
HELD = ".held"  # beside the file: "EPOCH STEP PID" of rank 0, while it waits
LOOK_EVERY_S = 0.1

log = logging.getLogger("ray_job")


def target(path: str) -> Optional[tuple[int, int]]:
    """The position the file names, or None (no file: no hold)."""
    try:
        with open(path) as f:
            epoch, step = f.read().split()
    except FileNotFoundError:
        return None
    return int(epoch), int(step)


class Hold:
    """Rank 0's look after each step; `path` None: never holds."""

    def __init__(self, path: Optional[str]):
        self.path = path

    @classmethod
    def from_env(cls, master_process: bool) -> Hold:
        return cls(os.environ.get(ENV) or None if master_process else None)

    def after_step(self, epoch: int, step: int) -> None:
        """Waits here while the file names a position at or before (epoch, step)."""
        if self.path is None:
            return
        at = target(self.path)
        if at is None or (epoch, step) < at:
            return
        log.info("held at epoch %d step %d while %s names it (%s)", epoch, step, self.path, ENV)
        with open(self.path + HELD, "w") as f:
            f.write(f"{epoch} {step} {os.getpid()}\n")
        try:
            while (at := target(self.path)) is not None and (epoch, step) >= at:
                time.sleep(LOOK_EVERY_S)
        finally:
            with contextlib.suppress(FileNotFoundError):  # runs sharing the file (a search's trials)
                os.unlink(self.path + HELD)
        log.info("released at epoch %d step %d", epoch, step)
