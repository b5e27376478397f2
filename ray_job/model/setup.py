"""The model and its optimizer as every worker trains them, for `train` and the benchmarks alike."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..config import Speed, TrainConfig
from .optim import build_optimizer
from . import sharding, weights, zoo
from .parts import unwrap


def model_and_optimizer(cfg: TrainConfig, num_classes: int, speed: Speed, world: int,
                        place: Callable[..., nn.Module], fresh: bool = True, *, per_node: int = 1,
                        to_device: Callable[[nn.Module], nn.Module] = lambda model: model
                        ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """`cfg`'s model (from --init-weights when `fresh`: not resumed from a checkpoint), NHWC where
    `speed` says, with its activations recomputed under --activation-checkpointing; then for ddp placed
    on the device and wrapped in DDP by `place` (Ray's prepare_model, or by hand), with
    --grad-compression; for fsdp/hsdp moved to the device by `to_device` and sharded over `world` workers,
    `per_node` to a node (sharding.py).
    Its optimizer is built over what the worker holds (a shard under fsdp); compiled last with
    --compile (a checkpoint still loads into it: see `unwrap`)."""
    model = zoo.build(cfg, num_classes)
    if cfg.init_weights and fresh:
        weights.load(model, cfg.init_weights)
    if speed.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.activation_checkpointing:
        sharding.checkpoint_activations(model)
    if cfg.strategy == "ddp":
        model = place_ddp(model, cfg, place)
    else:
        model = to_device(model)
        mesh = sharding.device_mesh(cfg.strategy, world, per_node, next(model.parameters()).device.type)
        model = sharding.shard(model, mesh, bf16=speed.bf16, cpu_offload=cfg.cpu_offload)
    optimizer = build_optimizer(unwrap(model), cfg, world, next(model.parameters()).device)
    if cfg.compile:
        model = torch.compile(model)
    return model, optimizer


def place_ddp(model: nn.Module, cfg: TrainConfig, place: Callable[..., nn.Module]) -> nn.Module:
    # Gradients as views into DDP's buckets save a copy per step; compiled backward graphs may
    # lay gradients out differently from the buckets, which would undo that, so not with --compile.
    model = place(model, gradient_as_bucket_view=not cfg.compile, bucket_cap_mb=cfg.ddp_bucket_mb)
    if cfg.grad_compression == "bf16" and hasattr(model, "register_comm_hook"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    return model
