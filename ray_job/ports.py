"""Free ports for Ray clusters that share a host with other clusters (SLURM jobs, tests).

    python -m ray_job.ports SLOT SIZE LO HI    prints the first port of SIZE consecutive free ports
"""

from __future__ import annotations

import socket
import sys


def is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


def free_port_block(size: int, lo: int, hi: int, slot: int = 0) -> int:
    """First port of `size` consecutive free ports in [lo, hi], searching from block `slot` on.

    Callers derive `slot` from something unique (a job id, a PID) so that concurrent clusters look
    at different blocks first; the bind test catches what others already hold.
    """
    nslots = (hi - lo + 1) // size
    for k in range(nslots):
        base = lo + (slot + k) % nslots * size
        if all(is_free(p) for p in range(base, base + size)):
            return base
    raise RuntimeError(f"no block of {size} free ports in {lo}-{hi}")


def free_port() -> int:
    """Any free port, chosen by the kernel."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    try:
        slot, size, lo, hi = map(int, sys.argv[1:])
        print(free_port_block(size, lo, hi, slot))
    except (ValueError, RuntimeError) as e:
        sys.exit(f"error: {e} (usage: python -m ray_job.ports SLOT SIZE LO HI)")
