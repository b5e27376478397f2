"""The memory plan: the exact bytes of parameters, gradients and optimizer state one worker holds
under --strategy ddp|fsdp|hsdp, computed from the model's parameter shapes before the first step
(the model may be on the meta device), and the one-line refusal of a run whose states cannot fit.

FSDP2 shards each parameter along dim 0 in chunks of ceil(d0 / shard group size), so the largest
rank (rank 0 of each shard group) holds ceil(d0 / n) rows; the plan is that rank's. The shard group
is all workers under fsdp, a node's workers under hsdp; under ddp every worker holds everything.
Activations are not planned: they depend on the batch and are measured on the first step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import nn

# Optimizer state per parameter, in copies of the parameter: SGD with momentum keeps a momentum
# buffer; AdamW keeps exp_avg and exp_avg_sq, plus a 0-d float32 `step` tensor (torch 2.14's default).
STATE_COPIES = {"sgd": 1, "adamw": 2}
STEP_BYTES = {"sgd": 0, "adamw": 4}
MOST_WORKERS = 64  # the largest worker count a refusal proposes


def size(n: float) -> str:
    """Bytes as people read them: 512 B, 48.8 MiB, 146 MiB, 11.2 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            break
        n /= 1024
    return f"{n:.0f} {unit}" if unit == "B" or n >= 100 else f"{n:.1f} {unit}"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Model-state bytes one worker holds (the largest rank's under fsdp/hsdp)."""
    strategy: str
    workers: int
    per_node: int
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def line(self, available: Optional[int] = None) -> str:
        """One line for the run log."""
        of = f", of {size(available)} available" if available else ""
        return (f"memory plan ({self.strategy}, {self.workers} worker{'s' * (self.workers != 1)}): "
                f"{size(self.params)} parameters + {size(self.grads)} gradients + {size(self.optimizer)} "
                f"optimizer state = {size(self.total)} per worker{of}; activations are measured on the "
                f"first step")

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total": self.total}


def shard_group(strategy: str, workers: int, per_node: int) -> int:
    """How many workers share one copy of the states: 1 (ddp), all (fsdp), a node's (hsdp)."""
    return {"ddp": 1, "fsdp": workers, "hsdp": per_node}[strategy]


def local_numel(shape: torch.Size, group: int) -> int:
    """Elements of the largest rank's shard of a parameter of `shape` (FSDP2: dim 0, chunks of
    ceil(d0 / group))."""
    if group == 1 or len(shape) == 0:
        return math.prod(shape)
    return math.ceil(shape[0] / group) * math.prod(shape[1:])


def plan(model: nn.Module, optimizer: str, strategy: str, workers: int, per_node: int) -> MemoryPlan:
    """The exact model-state bytes per worker; `optimizer` is "sgd" (with momentum) or "adamw";
    gradients and optimizer state only for trainable parameters, gradients in the parameters' dtype."""
    group = shard_group(strategy, workers, per_node)
    params = grads = state = 0
    for p in model.parameters():
        local = local_numel(p.shape, group) * p.element_size()
        params += local
        if p.requires_grad:
            grads += local
            state += STATE_COPIES[optimizer] * local + STEP_BYTES[optimizer]
    return MemoryPlan(strategy, workers, per_node, params, grads, state)


def worker_memory(memory_per_worker_gb: float, gpu_memory_bytes: Optional[int], node_memory_bytes: int,
                  workers_per_node: int) -> int:
    """Bytes one worker may use: --memory-per-worker-gb when given (GiB, 2**30 bytes), else its
    GPU's memory, else the node's memory shared by the node's workers."""
    if memory_per_worker_gb > 0:
        return int(memory_per_worker_gb * 2**30)
    if gpu_memory_bytes:
        return int(gpu_memory_bytes)
    return node_memory_bytes // max(1, workers_per_node)


def _alternatives(strategy: str, workers: int, per_node: int):
    """(strategy, workers) to propose, best first: hsdp then fsdp over the same workers, then fsdp
    over more workers."""
    if strategy == "ddp" and per_node >= 1 and workers % per_node == 0 and workers > per_node:
        yield "hsdp", workers
    if strategy != "fsdp":
        yield "fsdp", workers
    yield from (("fsdp", n) for n in range(workers + 1, MOST_WORKERS + 1))


def refusal(model: nn.Module, optimizer: str, strategy: str, workers: int, per_node: int,
            available: int) -> Optional[str]:
    """None when the planned states fit in `available` bytes per worker; else one line naming what
    the run needs, what a worker has, and the first strategy and worker count that would fit."""
    needed = plan(model, optimizer, strategy, workers, per_node).total
    if needed <= available:
        return None
    said = (f"--strategy {strategy} needs {size(needed)} of model states per worker (parameters, gradients, "
            f"optimizer state), more than the {size(available)} a worker has")
    for alt, n in _alternatives(strategy, workers, per_node):
        other = plan(model, optimizer, alt, n, per_node).total
        if other <= available:
            over = f" over {n} workers" if alt == "fsdp" else f" over {n // per_node} nodes of {per_node}"
            return f"{said}; --strategy {alt}{over} needs {size(other)} per worker (or give --memory-per-worker-gb)"
    least = plan(model, optimizer, "fsdp", MOST_WORKERS, per_node).total
    return (f"{said}; even --strategy fsdp over {MOST_WORKERS} workers needs {size(least)} per worker: give "
            f"workers more memory (--memory-per-worker-gb) or choose a smaller --model")
