"""What the loop needs of any model: its plain module under the wrappers, its optimizer parameter groups,
the bytes DDP all-reduces."""

from __future__ import annotations

from torch import nn


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

