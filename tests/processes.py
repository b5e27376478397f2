"""Processes the tests start, and the ones inside them they look at: stopping a server started in
its own session (start_new_session=True) by its PID, finding a run's Ray Train workers, holding a
run at a step."""

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


class Hold:
    """A run held at a step through RJ_HOLD_FILE (ray_job/train/hold.py), the file in `folder`: `env`
    goes into the run's environment; `at(epoch, step)` asks for the hold, before the run gets there
    or to move it on; `where()` is (epoch, step, pid) of rank 0 while it waits there, else ();
    `release()` lets the run go on. The held run is where the test put it on a machine of any speed:
    what the test does meanwhile races nothing."""

    def __init__(self, folder):
        from ray_job.train import hold

        self.path = os.path.join(folder, "hold")
        self.held = self.path + hold.HELD
        self.env = {hold.ENV: self.path}

    def at(self, epoch: int, step: int) -> Hold:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path + ".new", "w") as f:
            f.write(f"{epoch} {step}\n")
        os.replace(self.path + ".new", self.path)  # read whole or not at all
        return self

    def where(self) -> tuple:
        try:
            with open(self.held) as f:
                return tuple(int(x) for x in f.read().split())  # () while half-written
        except FileNotFoundError:
            return ()

    def waits_at(self, epoch: int, step: int) -> bool:
        """Rank 0 waits at (epoch, step) (a process alive: not a killed worker's leftover file)."""
        where = self.where()
        return where[:2] == (epoch, step) and psutil.pid_exists(where[2])

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
