"""--strategy fsdp|hsdp: the model's sharding units, the device mesh, activation checkpointing, and
FSDP2's `fully_shard` applied to any model `--model` builds (torch 2.14).

The units, one rule for every model: a *block* is a module whose class occurs at least twice in
the model (ResNet's Bottleneck/BasicBlock, ViT's EncoderBlock, ConvNeXt's CNBlock, Swin's blocks,
EfficientNet's MBConv, DenseNet's _DenseLayer; in a user's MLP, its nn.Linear layers), that is not a
plain nn.Sequential/ModuleList/ModuleDict, and that holds at least 0.1% of the model's parameters
(a one-conv stem or a 10-class head is not worth a collective of its own). From the root down, a
block is a unit unless it is a container subclass holding blocks itself (DenseNet's `_DenseBlock`:
its layers are looked at instead); other modules (ResNet's `layer1`, ViT's `encoder`) are looked
into; a unit never is, so units never nest. A model without blocks falls back to the children with
parameters of the first module, from the root down, that has two or more of them. What no unit
holds (stem, head, a ViT's position embedding) is the root's: `shard` shards the root last, over
the rest. torchvision's classifiers get 6 (MaxViT-T) to 101 (DenseNet-201) units, most 12-40.

    model = zoo.build(cfg, 10).to(device)
    checkpoint_activations(model)                  # --activation-checkpointing, any strategy
    shard(model, device_mesh("fsdp", world, per_node, "cpu"), bf16=False, cpu_offload=False)
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Optional

import torch
from torch import nn

from ..config.run import STRATEGIES
from ..core.errors import UsageError

MIN_UNIT_SHARE = 0.001  # a block holding less of the parameters stays with its parent
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)



def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _block_test(model: nn.Module):
    """A predicate: is this module a block of `model` (see the module's docstring)?"""
    counts = Counter(type(m) for m in model.modules())
    least = MIN_UNIT_SHARE * _params(model)

    def is_block(m: nn.Module) -> bool:
        return type(m) not in CONTAINERS and counts[type(m)] >= 2 and _params(m) >= least
    return is_block


def _blocks_under(module: nn.Module, is_block) -> list[nn.Module]:
    """The outermost blocks under `module`, in registration (forward) order, looking into plain
    containers and containers of blocks."""
    found = []
    for child in module.children():
        holds_blocks = isinstance(child, CONTAINERS) and any(is_block(c) for c in child.children())
        if is_block(child) and not holds_blocks:
            found.append(child)
        else:
            found.extend(_blocks_under(child, is_block))
    return found


def _fallback_units(model: nn.Module) -> list[nn.Module]:
    """The children with parameters of the first module, from the root down, with two or more."""
    module = model
    while True:
        holders = [c for c in module.children() if _params(c) > 0]
        if len(holders) != 1:
            return holders
        module = holders[0]


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The sharding units of `model` in forward order, by the module docstring's rule; every
    parameter is in at most one unit (the rest is the root's)."""
    return _blocks_under(model, _block_test(model)) or _fallback_units(model)


def device_mesh(strategy: str, world: int, per_node: int, device_type: str):
    """None for ddp; a 1-D ("shard",) mesh over all `world` ranks for fsdp; a 2-D ("replicate",
    "shard") mesh of shape (nodes, per_node) for hsdp. Needs the process group to be up."""
    if strategy not in STRATEGIES:
        raise UsageError(f"--strategy {strategy!r} is unknown; use one of {', '.join(STRATEGIES)}")
    if strategy == "ddp":
        return None
    from torch.distributed.device_mesh import init_device_mesh

    if strategy == "fsdp":
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    if per_node < 1 or world % per_node or world == per_node:
        raise UsageError(f"--strategy hsdp shards within a node and replicates across nodes: {world} workers "
                         f"at {per_node} per node is not two or more whole nodes; use --strategy fsdp, or a "
                         f"worker count that is a multiple of the workers per node")
    return init_device_mesh(device_type, (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))


@contextlib.contextmanager
def _batchnorm_stats_kept(unit: nn.Module):
    """Recomputing a unit's forward must not update its BatchNorm running statistics a second time:
    they are put back as they were before the recomputation."""
    norms = [m for m in unit.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [[b.clone() for b in m.buffers()] for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, buffers in zip(norms, saved):
                for b, old in zip(m.buffers(), buffers):
                    b.copy_(old)


def checkpoint_activations(model: nn.Module) -> int:
    """Recompute each unit's activations in the backward pass instead of keeping them (torch's
    composable, non-reentrant `checkpoint`: in place, the parameter names unchanged, composes with
    fully_shard and DDP). Call it before `shard`. Returns the number of units."""
    from torch.distributed._composable import checkpoint

    units = shard_units(model)
    for unit in units:
        checkpoint(unit, context_fn=lambda unit=unit: (contextlib.nullcontext(), _batchnorm_stats_kept(unit)))
    return len(units)


def _policies(mesh, bf16: bool, cpu_offload: bool) -> dict:
    """fully_shard's keyword arguments: mixed precision (bf16 compute, fp32 gradient reduction)
    and CPU offload."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    kwargs = {"mesh": mesh}
    if bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cpu_offload:
        if mesh.device_type == "cpu":
            raise UsageError("--cpu-offload moves sharded states from GPU to host memory; this run has no "
                             "GPUs: leave --cpu-offload out")
        kwargs["offload_policy"] = CPUOffloadPolicy()
    return kwargs


def shard(model: nn.Module, mesh, *, bf16: bool, cpu_offload: bool) -> nn.Module:
    """FSDP2: `fully_shard` each unit, then the root, on `mesh` (the model is on its device
    already). In place: the model's parameters become DTensors; returns the model."""
    from torch.distributed.fsdp import fully_shard

    kwargs = _policies(mesh, bf16, cpu_offload)
    for unit in shard_units(model):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether the model's parameters are DTensors (sharded by `shard`)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def sync_buffers(model: nn.Module) -> None:
    """Every rank takes rank 0's buffers (BatchNorm's running statistics), as DDP gives every rank
    rank 0's before each forward. Sharded, each rank would keep the statistics of its own batches:
    the ranks would evaluate with different ones, and a checkpoint would hold whichever copy DCP
    wrote. Called before every evaluation and every checkpoint; nothing to do for a model that is not
    sharded."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and is_sharded(model)):
        return
    groups: dict = {}
    for b in model.buffers():
        groups.setdefault((b.dtype, b.device), []).append(b)
    with torch.no_grad():
        for buffers in groups.values():  # one broadcast per dtype: e.g. the statistics, the batch counts
            flat = torch.cat([b.reshape(-1) for b in buffers])
            dist.broadcast(flat, src=0)
            for b, part in zip(buffers, flat.split([b.numel() for b in buffers])):
                b.copy_(part.view_as(b))


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else _local(t).numel() * _local(t).element_size()


def local_state_bytes(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> dict:
    """This rank's bytes of parameters, gradients (present after a backward) and optimizer state
    (every tensor in it, step counters included): the local shards under fsdp/hsdp."""
    params = list(model.parameters())
    states = optimizer.state.values() if optimizer is not None else ()
    return dict(params=sum(_nbytes(p) for p in params), grads=sum(_nbytes(p.grad) for p in params),
                optimizer=sum(_nbytes(v) for s in states for v in s.values() if isinstance(v, torch.Tensor)))
