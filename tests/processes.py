"""Processes the tests start, and the ones inside them they look at: stopping a server started in
its own session (start_new_session=True) by its PID, finding a run's Ray Train workers, holding one
still."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import psutil


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


def train_workers(pid: int) -> list[psutil.Process]:
    """The Ray Train workers (`ray::RayTrainWorker`) below `pid`: those of a run that started its
    own local Ray cluster."""
    found = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if " ".join(p.cmdline()).startswith("ray::RayTrainWorker"):
                found.append(p)
        except psutil.Error:  # gone meanwhile
            pass
    return found


def alive(p: psutil.Process) -> bool:
    """Running, or stopped: not gone and not a zombie."""
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextlib.contextmanager
def frozen(pid: int):
    """The process stopped (SIGSTOP) while the block runs: a training worker held where it is, and
    with it the whole run (its peers wait in their next collective)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
