"""What a tracked run records about its code and where it ran (tags), and its params."""

from __future__ import annotations

import getpass
import os
import subprocess
from typing import Any

from .. import __version__
from ..cluster.slurm import job_facts
from ..config import TrainConfig

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def code_tags(command: str) -> dict:
    import ray
    import torch

    tags = {"mlflow.source.name": f"python -m ray_job {command}", "mlflow.user": getpass.getuser(),
            "ray_job.version": __version__, "ray.version": ray.__version__, "torch.version": torch.__version__}
    try:  # the commit when the code runs from a git checkout (`ray job submit`'s copy has no .git)
        out = subprocess.run(["git", "-C", PACKAGE_DIR, "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5)
    except (OSError, subprocess.SubprocessError):
        return tags
    if out.returncode == 0 and out.stdout.strip():
        tags["mlflow.source.git.commit"] = out.stdout.strip()
    return tags


def cluster_tags() -> dict:
    """Nodes and GPUs of the Ray cluster this driver is connected to, and the SLURM job."""
    import ray

    tags: dict[str, Any] = {}
    if ray.is_initialized():
        tags["ray_job.nodes"] = sum(1 for n in ray.nodes() if n.get("Alive"))
        tags["ray_job.cluster_gpus"] = int(ray.cluster_resources().get("GPU", 0))
    slurm = job_facts(os.environ)
    if slurm:
        tags["slurm.job_id"], tags["slurm.restart_count"] = slurm["job_id"], slurm["restart_count"]
    return tags


def run_params(cfg: TrainConfig) -> dict:
    """The resolved config (flat already: one param per field), the world size and the batch rule."""
    world = cfg.num_workers
    return dict(cfg.to_dict(), world_size=world, per_worker_batch=cfg.per_worker_batch(world),
                global_batch=cfg.global_batch(world), scaled_lr=cfg.scaled_lr(world), batch_rule=batch_rule(cfg, world))


def batch_rule(cfg: TrainConfig, world: int) -> str:
    how = ("split across" if cfg.batch_mode == "global" else "on each of")
    return (f"--batch-mode {cfg.batch_mode}: {cfg.batch_size} {how} {world} worker(s) = "
            f"{cfg.per_worker_batch(world)} per worker, {cfg.global_batch(world)} per step; lr "
            f"{cfg.lr:g} x {cfg.global_batch(world)}/{cfg.lr_ref_batch} = {cfg.scaled_lr(world):g}")
