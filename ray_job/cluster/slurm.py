"""What SLURM gave this job: every SLURM environment variable the job reads is read here
(`Allocation.from_env`), and the nodes' names and addresses are looked up here (`scontrol`)."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from ..core.errors import UsageError


@dataclass(frozen=True)
class NodeRestarts:
    """A worker node's Ray that ended while the job goes on (OOM killer, a crashed raylet) is
    started again on the same node, up to RJ_NODE_RESTARTS times, RJ_NODE_RESTART_S after the end
    and twice as long each time (slurm_ray_start.sh asks `python -m ray_job.cluster node-restart`)."""

    limit: int = 3
    first_s: int = 10

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> NodeRestarts:
        return cls(_count(env, "RJ_NODE_RESTARTS", str(cls.limit)), _count(env, "RJ_NODE_RESTART_S", str(cls.first_s)))

    def next(self, node: str, restarts: int) -> tuple[int, str]:
        """After `restarts` restarts of `node`'s Ray: (seconds until the next, what to log), the
        seconds -1 when there is none left."""
        if restarts >= self.limit:
            return -1, f"not starting Ray on {node} again: it was restarted {restarts} times (RJ_NODE_RESTARTS)"
        delay = self.first_s << restarts
        return delay, f"starting Ray on {node} again in {delay} s (restart {restarts + 1} of {self.limit})"


@dataclass(frozen=True)
class Allocation:
    """What SLURM gave this job, and the job's defaults for where the run goes."""

    job_id: str
    submit_dir: str
    restart_count: int
    cpus_per_node: int
    gpus_per_node: int
    storage_path: str  # default --storage-path: on the shared file system, beside the submit dir
    run_name: str      # default --name: from the job id, so a requeued job resumes the same run
    log_dir: str       # each node's `ray start` output, the token copy and cluster.env

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Allocation:
        job_id = env.get("SLURM_JOB_ID", "")
        if not job_id:
            raise UsageError("SLURM_JOB_ID is not set. HINT: submit with 'sbatch slurm_ray_start.sh ...'")
        submit_dir = env.get("SLURM_SUBMIT_DIR") or os.getcwd()
        NodeRestarts.from_env(env)  # read now, so that a bad RJ_NODE_RESTARTS fails before any node starts
        return cls(
            job_id=job_id,
            submit_dir=submit_dir,
            restart_count=_count(env, "SLURM_RESTART_COUNT", "0"),
            cpus_per_node=_count(env, "SLURM_CPUS_PER_TASK", env.get("SLURM_CPUS_ON_NODE") or "1"),
            gpus_per_node=gpus_per_node(env),
            storage_path=env.get("RJ_STORAGE_PATH") or os.path.join(submit_dir, "ray_results"),
            run_name=env.get("RJ_RUN_NAME") or f"slurm-{job_id}",
            log_dir=env.get("RJ_LOG_DIR") or os.path.join(submit_dir, "ray-logs", job_id),
        )


def job_facts(env: Mapping[str, str]) -> dict:
    """The job id and requeue count when this process runs in a SLURM job ({} otherwise): what a
    run records about where it ran (experiment tracking's tags)."""
    if not env.get("SLURM_JOB_ID"):
        return {}
    count = env.get("SLURM_RESTART_COUNT") or "0"
    return {"job_id": env["SLURM_JOB_ID"], "restart_count": int(count) if count.isdigit() else count}


def _count(env: Mapping[str, str], name: str, default: str) -> int:
    text = env.get(name) or default
    if not text.isdigit():
        raise UsageError(f"cannot read {name}={text!r} as a count: give a whole number")
    return int(text)


def gpus_per_node(env: Mapping[str, str]) -> int:
    """GPUs on each node: SLURM_GPUS_ON_NODE (set whenever the node got GPUs, --gres too), else
    SLURM_GPUS_PER_NODE as --gpus-per-node wrote it ("2", "a100:2", "a100:1,v100:1")."""
    if env.get("SLURM_GPUS_ON_NODE"):
        return _count(env, "SLURM_GPUS_ON_NODE", "0")
    text = env.get("SLURM_GPUS_PER_NODE") or "0"
    counts = [part.rsplit(":", 1)[-1] for part in text.split(",")]
    if not all(c.isdigit() for c in counts):
        raise UsageError(f"cannot read the GPU count from SLURM_GPUS_PER_NODE={text!r}. HINT: "
                         f"request GPUs as --gpus-per-node=N or --gpus-per-node=TYPE:N")
    return sum(int(c) for c in counts)


# --- nodes and their addresses -------------------------------------------------------------------

class NodeError(Exception):
    """The nodes or their addresses cannot be found: the job cannot start a cluster (exit 4)."""


def _scontrol(*args: str) -> str:
    try:
        return subprocess.run(["scontrol", *args], capture_output=True, text=True, check=True,
                              timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NodeError(f"scontrol {' '.join(args)} failed: {e}") from None


def node_names(nodelist: str) -> list[str]:
    """SLURM_JOB_NODELIST ("n[1-3],m7") expanded; the first node hosts the head."""
    names = _scontrol("show", "hostnames", nodelist).split() if nodelist else []
    if not names:
        raise NodeError(f"cannot expand SLURM_JOB_NODELIST={nodelist!r} with scontrol")
    return names


def node_addr(node: str) -> str:
    """A node's NodeAddr in SLURM (its name when SLURM has none)."""
    fields = dict(f.split("=", 1) for f in _scontrol("show", "node", "-o", node).split() if "=" in f)
    return fields.get("NodeAddr") or node


def ipv4(host: str) -> Optional[str]:
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except (OSError, IndexError):
        return None


def node_addresses(nodes: Sequence[str], head_ip: str = "") -> list[str]:
    """Each node's IPv4 address as the other nodes reach it (`head_ip` overrides the head's).
    Loopback addresses are fine only when every node has one (SLURM nodes sharing one machine)."""
    ips = []
    for node in nodes:
        ip = ipv4(node_addr(node))
        if not ip:
            raise NodeError(f"cannot resolve an address for node {node}. HINT: check 'scontrol show node "
                            f"{node}' (NodeAddr) and DNS")
        ips.append(ip)
    if head_ip:
        ips[0] = head_ip
    loopback = {ip.startswith("127.") for ip in ips}
    if len(loopback) == 2 and not head_ip:
        pairs = " ".join(f"{n}={ip}" for n, ip in zip(nodes, ips))
        raise NodeError(f"node addresses mix loopback and routable IPs ({pairs}). HINT: set RJ_HEAD_IP "
                        f"to the head's routable address")
    return ips
