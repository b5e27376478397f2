"""Stopping a server the tests started in its own session (start_new_session=True), by its PID."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_session(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM to the process (it stops what it started), then SIGKILL to its own process group
    (the session it was started in: stragglers of this server only) if that takes too long."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
