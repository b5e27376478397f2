"""ResNet models for 32x32 inputs, built from torchvision's definitions."""

from __future__ import annotations

import torchvision
from torch import nn


def build_model(name: str, stem: str, num_classes: int) -> nn.Module:
    """A torchvision ResNet with `num_classes` outputs and the CIFAR or ImageNet stem.

    zero_init_residual starts every residual branch at zero, which makes large-batch training
    stable from the first step (Goyal et al., 2017).
    """
    model = getattr(torchvision.models, name)(weights=None, num_classes=num_classes,
                                              zero_init_residual=True)
    if stem == "cifar":
        # 32x32 images lose too much at a stride-2 7x7 conv + max-pool: keep full resolution.
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model under DDP and torch.compile wrappers (its state_dict has no prefixes)."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if inner is None:
            return model
        model = inner


def param_groups(model: nn.Module, weight_decay: float, decay_norm_bias: bool) -> list[dict]:
    """Optimizer parameter groups; norm weights and biases (all 1-D tensors) optionally skip decay."""
    if decay_norm_bias:
        return [{"params": [p for p in model.parameters() if p.requires_grad],
                 "weight_decay": weight_decay}]
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def gradient_bytes(model: nn.Module, bytes_per_element: int = 4) -> int:
    """Bytes all-reduced per step by DDP (every trainable parameter's gradient once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad) * bytes_per_element

