"""Storage failures as one line each: StorageError, the useful part of a pyarrow/AWS error, and
retrying for a while (a short outage of the object store or the shared file system)."""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pyarrow

log = logging.getLogger("ray_job.storage")
T = TypeVar("T")


class StorageError(OSError):
    """A storage operation failed (unreachable, refused, disk full): one line, no credentials."""


def reason(e: BaseException) -> str:
    """The useful part of a pyarrow/AWS error, on one line."""
    text = " ".join(str(e).split())
    text = re.sub(r"\s*\(Request ID: [^)]*\)", "", text)
    text = text.split("; Details:")[0]
    m = re.search(r"AWS Error (\w+) during (\w+) operation: ?(.*)", text)
    if m:
        detail = m[3].strip() if m[3].strip() not in ("", "No response body.") else ""
        text = f"{m[1]} on {m[2]}" + (f": {detail}" if detail else "")
    return text[:240]


@contextlib.contextmanager
def faults(action: str, loc: Any) -> Iterator[None]:
    """Turns a filesystem failure into one StorageError line (FileNotFoundError passes through)."""
    try:
        yield
    except (FileNotFoundError, StorageError):
        raise
    except (OSError, pyarrow.ArrowException) as e:
        raise StorageError(f"cannot {action} {loc.uri}: {reason(e)}") from None


def retrying(fn: Callable[[], T], wait_s: float, what: str = "",
             pause_s: float = 2.0) -> T:
    """fn(), tried again on StorageError until `wait_s` seconds have passed (0: once)."""
    deadline = time.monotonic() + wait_s
    announced = False
    while True:
        try:
            return fn()
        except StorageError as e:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            if not announced and what:
                log.warning("storage: %s failed (%s); trying again for up to %.0f s", what, e, left)
                announced = True
            time.sleep(min(pause_s, left))
