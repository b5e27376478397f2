"""Optimizer (SGD with Nesterov momentum, or AdamW) and learning-rate schedule built from the config."""

from __future__ import annotations

import math

import torch

from ..config import TrainConfig
from .parts import param_groups


class LRFactor:
    """Multiplier of the peak LR at a given step: linear warmup, then cosine / linear / constant."""

    def __init__(self, kind: str, total_steps: int, warmup_steps: int):
        self.kind, self.total, self.warmup = kind, max(1, total_steps), max(0, warmup_steps)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        if self.kind == "cosine":
            return 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0 - progress  # onecycle: linear down to zero


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, world_size: int,
                    device: torch.device) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay, cfg.decay_norm_bias)
    # fused kernels on CUDA, multi-tensor (foreach) elsewhere: one launch per group, not per tensor.
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    if cfg.optimizer_in_use == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.scaled_lr(world_size), **fast)
    return torch.optim.SGD(groups, lr=cfg.scaled_lr(world_size), momentum=cfg.momentum,
                           nesterov=cfg.momentum > 0, **fast)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, steps_per_epoch: int,
                    start_step: int = 0):
    """A per-step LambdaLR; `start_step` places it where a resumed run stopped."""
    factor = LRFactor(cfg.schedule, cfg.epochs * steps_per_epoch,
                      round(cfg.warmup_epochs * steps_per_epoch))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    if start_step:
        scheduler.last_epoch = start_step
        for group, base in zip(optimizer.param_groups, scheduler.base_lrs):
            group["lr"] = base * factor(start_step)
    return scheduler
