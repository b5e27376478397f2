"""The memory plan, on the driver, before any worker starts: the bytes of parameters, gradients and
optimizer state each worker will hold under --strategy at this worker count (model/memory.py, exact:
from the model's shapes), against what a worker has (the GPU's memory; without GPUs the node's
memory divided by its workers; or --memory-per-worker-gb). Model states that cannot fit stop the run
here with one line naming what would fit; activations are measured on the first step (the run log's
"first step" memory line, worker.py)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from ..config import TrainConfig
from ..core.errors import UsageError
from ..model import memory, zoo
from .trainer import workers_on_node

log = logging.getLogger("ray_job.driver")


def workers_per_node(cfg: TrainConfig, nodes: list) -> int:
    """Workers on a node as Ray Train places them (it packs them: as many on a node as fit)."""
    most = max((workers_on_node(n.get("Resources", {}), cfg.cpus_per_worker, cfg.gpus_in_use)
                for n in nodes if n.get("Alive")), default=1)
    return max(1, min(cfg.num_workers, most))


def gpu_memory(cfg: TrainConfig) -> Optional[int]:
    """Bytes of one worker's share of a GPU, asked of a GPU of the cluster (None without GPUs)."""
    if not cfg.use_gpu:
        return None
    import ray

    @ray.remote(num_gpus=cfg.gpus_per_worker, num_cpus=0)
    def total() -> int:
        import torch

        return torch.cuda.get_device_properties(0).total_memory

    return int(ray.get(total.remote(), timeout=300) * min(1.0, cfg.gpus_per_worker))


def check_memory(cfg: TrainConfig, num_classes: int) -> memory.MemoryPlan:
    """The plan at --num-workers (logged), or UsageError when the model states cannot fit a worker at
    any size the run may take (an elastic run's --min-workers holds the most per worker)."""
    import ray

    nodes, gpu = ray.nodes(), gpu_memory(cfg)
    model = zoo.check(cfg, num_classes)
    for world in sorted({cfg.min_workers or cfg.num_workers, cfg.num_workers}, reverse=True):
        plan, available = _plan_at(cfg, world, nodes, gpu, model)
        if world == cfg.num_workers:
            log.info("%s", plan.line(available))
    return plan


def _plan_at(cfg: TrainConfig, world: int, nodes: list, gpu: Optional[int], model
             ) -> tuple[memory.MemoryPlan, int]:
    """The plan at `world` workers and a worker's bytes, or UsageError: the states cannot fit, or hsdp
    cannot be laid out on these nodes."""
    cfg = dataclasses.replace(cfg, num_workers=world, min_workers=0)
    per_node = workers_per_node(cfg, nodes)
    if cfg.strategy == "hsdp" and (cfg.num_workers <= per_node or cfg.num_workers % per_node):
        raise UsageError(f"--strategy hsdp shards within a node and replicates across nodes, but the "
                         f"{cfg.num_workers} worker(s) fill {-(-cfg.num_workers // per_node)} node(s) of "
                         f"{per_node}: give a --num-workers that fills 2 or more nodes evenly, or use "
                         f"--strategy fsdp")
    node_memory = min((int(n["Resources"].get("memory", 0)) for n in nodes if n.get("Alive")), default=0)
    available = memory.worker_memory(cfg.memory_per_worker_gb, gpu, node_memory, per_node)
    refusal = memory.refusal(model, cfg.optimizer_in_use, cfg.strategy, world, per_node, available)
    if refusal:
        raise UsageError(refusal)
    return memory.plan(model, cfg.optimizer_in_use, cfg.strategy, world, per_node), available
