"""A learnable CIFAR-shaped dataset generated in memory: no files, and accuracy far above chance
proves that a run learns."""

from __future__ import annotations

import numpy as np
import torch

from .arrays import Split


def make_synthetic(n: int, seed: int, train: bool, num_classes: int = 10) -> Split:
    """Each class has its own colour and stripe pattern, plus noise: colour survives crops and flips, so
    a model that learns anything beats 10%; the noise keeps it from being trivial. Train and test are
    different draws of the same classes."""
    g = torch.Generator().manual_seed(seed)
    palette = torch.rand(num_classes, 3, generator=g) * 160 + 48          # class colours
    freq = torch.arange(num_classes, dtype=torch.float32) % 5 + 1          # class stripes
    g.manual_seed(seed * 2 + (0 if train else 1) + 1)
    labels = torch.randint(0, num_classes, (n,), generator=g)
    xs = torch.arange(32, dtype=torch.float32)
    stripes = torch.sin(xs[None, :] * freq[:, None] * np.pi / 16)          # (C, 32)
    base = palette[labels][:, None, None, :] + 24 * stripes[labels][:, None, :, None]
    images = base + torch.randn(n, 32, 32, 3, generator=g) * 40
    return Split(images.clamp(0, 255).to(torch.uint8), labels, tuple(f"class{i}" for i in range(num_classes)))
