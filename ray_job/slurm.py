"""What slurm_ray_start.sh needs to know, decided in Python; the script only supervises processes.

    python -m ray_job.slurm plan [train|scale|serve] [FLAGS...]
        Reads the allocation from the batch step's environment (SLURM_*, RJ_STORAGE_PATH,
        RJ_RUN_NAME, RJ_LOG_DIR) and parses the user's mode and flags with the driver's own parser.
        Prints NUL-terminated records, for bash's `mapfile -d ''`: one KEY=VALUE per fact (see
        `plan_records`), then "--", then the driver's flags (the user's, plus the defaults the job
        adds; the script adds only --address). Bad input: one line `error: ...`, exit 2.
    python -m ray_job.slurm cluster-status HOST:PORT
        "<GPU total> <alive node names...>" of the Ray cluster whose GCS is at HOST:PORT, or "down".

Every SLURM environment variable the job uses is read in `Allocation.from_env`, except
SLURM_JOB_ID's presence (checked first, so that the script can say how to submit) and
SLURM_JOB_NODELIST (expanded by `scontrol show hostnames` in the script).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from .config import UsageError, resolve_path

MODES = ("train", "scale", "serve")
NO_GPUS_HINT = ("HINT: submit with sbatch --gpus-per-node=N (or --gres=gpu:N), or train on CPUs "
                "with --no-gpu")


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


def _count(env: Mapping[str, str], name: str, default: str) -> int:
    text = env.get(name) or default
    if not text.isdigit():
        raise UsageError(f"cannot read {name}={text!r} from SLURM as a count")
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


# --- the driver's flags ------------------------------------------------------------------------

@dataclass(frozen=True)
class DriverPlan:
    """How the script runs `python -m ray_job MODE`, and what it reports about the run."""

    mode: str                # train | scale | serve (serve: no driver)
    args: tuple[str, ...]    # flags for the driver; the script adds --address
    storage_path: str        # effective --storage-path, absolute (for the log)
    run_name: str            # effective --name
    use_gpu: bool            # whether the driver trains on GPUs


def split_mode(argv: Sequence[str]) -> tuple[str, list[str]]:
    """The script's first argument is the mode (train when it is a flag or absent)."""
    if not argv or (argv[0].startswith("-") and argv[0] != "--keep-alive"):
        return "train", list(argv)
    first, rest = argv[0], list(argv[1:])
    if first == "--keep-alive":
        return "serve", rest
    if first not in MODES:
        raise UsageError(f"unknown mode {first!r}. HINT: use train (default), scale or serve")
    return first, rest


def train_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    from .cli import build_train_parser

    return build_train_parser(argv)


def scale_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    # Imported here: the scaling sweep (and what it imports) is only needed for scale mode.
    from .scale import build_parser

    return build_parser(argv)


PARSERS: dict[str, Callable[[Sequence[str]], argparse.ArgumentParser]] = {
    "train": train_parser, "scale": scale_parser}

_UNSET = object()


def flags_given(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The destinations that `argv` sets, in any form argparse accepts: `--x V`, `--x=V`,
    abbreviations (`--storage V`), and every alias of a dest (--no-use-gpu, --no-gpu)."""
    dests = vars(parser.parse_args([]))
    # argparse fills in defaults only for attributes the namespace lacks: start with all of them
    # set to a sentinel, and whatever is no longer the sentinel was set by the user.
    ns = parser.parse_args(list(argv), namespace=argparse.Namespace(**dict.fromkeys(dests, _UNSET)))
    return {dest for dest, value in vars(ns).items() if value is not _UNSET}


def plan_driver(argv: Sequence[str], alloc: Allocation) -> DriverPlan:
    """The driver's final flags: the user's, plus --storage-path, --name and a GPU flag unless the
    user gave one in any form. Raises UsageError for input the job would fail on."""
    from .cli import config_from_args

    mode, flags = split_mode(argv)
    if mode == "serve":
        if flags:
            raise UsageError(f"serve takes no flags (got {' '.join(flags)}). HINT: give them to the "
                             f"jobs: ray job submit ... -- python -m ray_job train FLAGS")
        return DriverPlan("serve", (), resolve_path(alloc.storage_path), "", alloc.gpus_per_node > 0)
    build = PARSERS[mode]
    given = flags_given(build(flags), flags)
    if "address" in given:
        raise UsageError("--address is set by this script; do not pass it")
    added: list[str] = []
    if "storage_path" not in given:
        added += ["--storage-path", alloc.storage_path]
    if "name" not in given:
        added += ["--name", alloc.run_name]
    if "use_gpu" not in given:
        added.append("--use-gpu" if alloc.gpus_per_node else "--no-gpu")
    args = [*added, *flags]  # ours first: a user's `--` cannot swallow them
    cfg = config_from_args(build(args).parse_args(args))  # validates values, as the driver will
    if cfg.use_gpu and not alloc.gpus_per_node:
        raise UsageError(f"--use-gpu was given but SLURM gave this job no GPUs. {NO_GPUS_HINT}")
    if not cfg.storage_path or not cfg.name:
        raise UsageError("--storage-path and --name need a value (a requeued job resumes its run by name)")
    return DriverPlan(mode, tuple(args), resolve_path(cfg.storage_path), cfg.name, bool(cfg.use_gpu))


def plan_records(alloc: Allocation, plan: DriverPlan) -> list[str]:
    """What `plan` prints; the keys are the script's variable names."""
    facts = dict(JOB_ID=alloc.job_id, RESTART_COUNT=alloc.restart_count,
                 CPUS_PER_NODE=alloc.cpus_per_node, GPUS_PER_NODE=alloc.gpus_per_node,
                 LOG_DIR=alloc.log_dir, MODE=plan.mode, STORAGE_PATH=plan.storage_path,
                 RUN_NAME=plan.run_name, WANT_GPU=int(plan.use_gpu))
    return [f"{key}={value}" for key, value in facts.items()] + ["--", *plan.args]


def warnings_for(alloc: Allocation, plan: DriverPlan) -> list[str]:
    if plan.mode != "serve" and alloc.gpus_per_node and not plan.use_gpu:
        return [f"{alloc.gpus_per_node} GPU(s) per node allocated but the driver was told not to "
                f"use them (--no-use-gpu / --no-gpu)"]
    return []


# --- cluster readiness -------------------------------------------------------------------------

def cluster_status(address: str, timeout_s: float = 5.0) -> str:
    """'<GPU total> <alive node names, sorted...>' for the Ray cluster at HOST:PORT, or 'down'.

    Polled every second while the cluster comes up, so it is kept light: a TCP probe first (no
    Ray import while the GCS is not listening), then one GCS call. Ray 2.60 has no light public
    way to ask: ray.nodes() needs ray.init(), a driver connected per poll; ray.util.state's
    list_nodes() and `ray list nodes` go through the dashboard, which is off with RJ_DASHBOARD=0
    and comes up after the GCS; `ray status` prints text for people and imports the autoscaler.
    So this uses the GCS client those are built on (ray._raylet.GcsClient, private): if it changes,
    only this function does.
    """
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        from ray._raylet import GcsClient
        from ray.core.generated.gcs_pb2 import GcsNodeInfo

        infos = GcsClient(address=address).get_all_node_info(timeout=timeout_s).values()
    except Exception:  # not up yet, or going away: the caller polls again
        return "down"
    alive = [i for i in infos if i.state == GcsNodeInfo.ALIVE]
    gpus = int(sum(i.resources_total.get("GPU", 0) for i in alive))
    return " ".join([str(gpus), *sorted(i.node_name for i in alive)])


# --- command line ------------------------------------------------------------------------------

def main(argv: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    try:
        if command == "plan":
            alloc = Allocation.from_env(os.environ if env is None else env)
            # stdout carries the records only: --help (argparse prints it and exits 0, and then
            # there are no records: nothing to run) and anything else go to the job's log.
            with contextlib.redirect_stdout(sys.stderr):
                try:
                    plan = plan_driver(rest, alloc)
                except SystemExit as e:
                    return e.code if isinstance(e.code, int) else 2
            for line in warnings_for(alloc, plan):
                print(f"warning: {line}", file=sys.stderr)
            sys.stdout.write("".join(f"{record}\0" for record in plan_records(alloc, plan)))
            return 0
        if command == "cluster-status" and len(rest) == 1:
            print(cluster_status(rest[0]))
            return 0
        raise UsageError("usage: python -m ray_job.slurm plan [MODE] [FLAGS...] | "
                         "cluster-status HOST:PORT")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
