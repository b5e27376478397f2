"""Ports of one Ray node: a block of consecutive ports laid out the same way on every node of
every kind of cluster (SLURM jobs, cluster.yaml machines, the tests' heads), and a free block for
clusters that share a host with other clusters.

Layout of a block starting at B: B+0 the GCS (head), B+1 the dashboard / job server (head), B+2
the Ray client server (head), B+3 node manager, B+4 object manager, B+5 / B+6 the dashboard
agent's HTTP / gRPC, B+7 the runtime-env agent, B+8 metrics export, and B+10 to the block's last
port the worker processes (so the client port stays clear of the worker range).

The blocks are taken from RJ_PORT_BASE to RJ_PORT_MAX (`port_range`), 20000 to 32767 by default:
below Linux's ephemeral range, where outgoing connections take their ports.
"""

from __future__ import annotations

import socket
from collections.abc import Collection, Mapping

from ..core.errors import UsageError

SERVICE_OFFSETS = {
    "port": 0, "dashboard-port": 1, "ray-client-server-port": 2,          # the head only
    "node-manager-port": 3, "object-manager-port": 4, "dashboard-agent-listen-port": 5,
    "dashboard-agent-grpc-port": 6, "runtime-env-agent-port": 7, "metrics-export-port": 8,
}
HEAD_ONLY = ("port", "dashboard-port", "ray-client-server-port")
FIRST_WORKER_OFFSET = 10
BLOCK = 200        # ports per node: the services + 190 worker processes
MIN_BLOCK = 20
BASE, TOP = 20000, 32767  # the default range of every block (RJ_PORT_BASE, RJ_PORT_MAX)


def port_range(env: Mapping[str, str]) -> tuple[int, int]:
    """The ports a cluster's blocks come from: RJ_PORT_BASE to RJ_PORT_MAX, else BASE to TOP."""
    lo, hi = env.get("RJ_PORT_BASE") or str(BASE), env.get("RJ_PORT_MAX") or str(TOP)
    if not (lo.isdigit() and hi.isdigit() and 1024 <= int(lo) and int(lo) + BLOCK - 1 <= int(hi) <= 65535):
        raise UsageError(f"RJ_PORT_BASE={lo} RJ_PORT_MAX={hi} is not a range of at least {BLOCK} ports "
                         f"between 1024 and 65535: give whole numbers, e.g. RJ_PORT_BASE={BASE} RJ_PORT_MAX={TOP}")
    return int(lo), int(hi)


def job_port(env: Mapping[str, str], job_id: int) -> int:
    """One port of the range, the same for every task of a job (the raw-DDP baseline's MASTER_PORT
    under srun); concurrent jobs get different ones."""
    lo, hi = port_range(env)
    return lo + job_id % (hi - lo + 1)


def ray_start_flags(base: int, head: bool, size: int = BLOCK) -> list[str]:
    """`ray start` port flags for a node whose block starts at `base`."""
    if size < MIN_BLOCK:
        raise ValueError(f"a port block needs at least {MIN_BLOCK} ports, not {size}")
    flags = [f"--{name}={base + offset}" for name, offset in SERVICE_OFFSETS.items()
             if head or name not in HEAD_ONLY]
    return flags + [f"--min-worker-port={base + FIRST_WORKER_OFFSET}", f"--max-worker-port={base + size - 1}"]


def gcs_port(base: int) -> int:
    return base + SERVICE_OFFSETS["port"]


def dashboard_port(base: int) -> int:
    return base + SERVICE_OFFSETS["dashboard-port"]


def slot(job_id: int, node_index: int, restarts: int = 0) -> int:
    """Where a job's node starts looking for a free block: concurrent jobs (and the nodes of one
    job on a shared machine) look at different blocks first, and a node's Ray started again after
    it was lost looks past its old block (a raylet on the lost one's ports was marked dead by the
    head ~20 s after it joined, on a loaded machine)."""
    return job_id * 4 + node_index + restarts


def is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


def free_block(size: int, lo: int, hi: int, slot: int = 0) -> int:
    """First port of `size` consecutive free ports in [lo, hi], searching from block `slot` on.

    Callers derive `slot` from something unique (a job id, a PID) so that concurrent clusters look
    at different blocks first; the bind test catches what others already hold.
    """
    nslots = (hi - lo + 1) // size
    if nslots < 1:
        raise ValueError(f"{size} ports do not fit in {lo}-{hi}")
    for k in range(nslots):
        base = lo + (slot + k) % nslots * size
        if all(is_free(p) for p in range(base, base + size)):
            return base
    raise RuntimeError(f"no block of {size} free ports in {lo}-{hi}")


def free_port(avoid: Collection[int] = ()) -> int:
    """Any free port, chosen by the kernel, except those in `avoid`."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port
