"""Ray Train's advice that does not apply to a run of ours, kept out of the user's terminal.

A continued run makes Ray Train's controller log "A run snapshot was found ... please configure a
new, unique `RunConfig(name)`": advice for a user who set a RunConfig, given to one who was told to
run the same command again. `Quiet`, one of the run's Ray Train callbacks, turns such notices into
DEBUG records when the controller unpickles it (before it reads the snapshot): Ray's console handler
drops them, its log files (ray-train-sys-controller-*.log) keep them.
"""

from __future__ import annotations

import logging

from ray.train import UserCallback

NOTICES = ("A run snapshot was found",)


class Quiet(UserCallback):
    """Installs the demotion in the process that unpickles it (Ray Train's controller)."""

    def __init__(self) -> None:
        self.notices = NOTICES  # a state to restore: pickle calls __setstate__ only then

    def __setstate__(self, state: dict) -> None:
        """Records of NOTICES are made at DEBUG from now on in this process (once)."""
        self.__dict__.update(state)
        make = logging.getLogRecordFactory()
        if getattr(make, "demotes", False):
            return

        def demoted(*args, **kwargs) -> logging.LogRecord:
            record = make(*args, **kwargs)
            if record.levelno == logging.INFO and str(record.msg).startswith(NOTICES):  # as Ray 2.60 words it
                record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return record

        demoted.demotes = True  # type: ignore[attr-defined]
        logging.setLogRecordFactory(demoted)
