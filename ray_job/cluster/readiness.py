"""Is the Ray cluster up? The alive nodes and GPUs of a cluster, and the bounded wait until every
node a job started has joined (slurm_ray_start.sh runs it; it decides nothing else).

The wait fails fast when a node's `ray start` step has already ended (its PID is watched), and by
the deadline otherwise; either way it names the missing nodes and prints the end of their logs.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from . import raypriv

POLL_S = 1.0


@dataclass(frozen=True)
class Status:
    up: bool
    gpus: int
    alive: tuple[str, ...]   # node names, sorted


def cluster_status(address: str, timeout_s: float = 5.0) -> Status:
    """The alive nodes of the cluster whose GCS is at HOST:PORT (a TCP probe first, so that no
    Ray call is made while the GCS is not listening)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        nodes = raypriv.alive_nodes(address, timeout_s)
    except raypriv.PrivateAPIMoved:
        raise
    except Exception:  # not up yet, or going away: the caller polls again
        return Status(False, 0, ())
    return Status(True, int(sum(g for _, g in nodes)), tuple(sorted(n for n, _ in nodes)))


class NotReady(Exception):
    """The cluster did not come up: the message names what is missing."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a child that has exited but is not reaped yet (the script reaps its steps)
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def log_tail(log_dir: str, node: str, n: int = 15) -> str:
    path = os.path.join(log_dir, f"{node}.log")
    try:
        with open(path, errors="replace") as f:
            lines = f.readlines()[-n:]
    except OSError:
        return f"--- (no log at {path}) ---\n"
    return f"--- last lines of {path} (Ray on {node}) ---\n" + "".join(lines)


def wait_for_nodes(address: str, nodes: Sequence[str], gpus: int, timeout_s: float,
                   steps: Mapping[str, int], log_dir: str, say: Callable[[str], None],
                   status: Callable[[str], Status] = cluster_status) -> Status:
    """Polls until exactly `nodes` (and `gpus` GPUs in all) are alive. `steps` maps a node to the
    PID of its `ray start` step: one that has ended fails the wait at once."""
    deadline = time.monotonic() + timeout_s
    last: Optional[Status] = None
    while True:
        for node, pid in steps.items():
            if not _alive(pid):
                raise NotReady(f"Ray on node {node} exited before joining the cluster; missing Ray "
                               f"node(s): {node}\n" + log_tail(log_dir, node))
        now = status(address)
        missing = [n for n in nodes if n not in now.alive]
        if now != last:
            say(f"cluster: alive=[{' '.join(now.alive)}] missing=[{' '.join(missing)}] GPUs={now.gpus}/{gpus}")
            last = now
        if now.up and not missing and len(now.alive) == len(nodes) and now.gpus == gpus:
            return now
        if time.monotonic() >= deadline:
            raise NotReady(f"Ray cluster did not come up within {timeout_s:g}s; missing Ray node(s): "
                           f"{' '.join(missing) or 'none'} (GPUs {now.gpus}/{gpus})\n"
                           + "".join(log_tail(log_dir, n) for n in missing))
        time.sleep(POLL_S)
