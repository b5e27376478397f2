"""The ceiling: the device's dense matmul FLOP/s (fp32 on CPU; bf16 and fp32 on GPU), measured in
the same run as a benchmark, and a model's FLOPs per image counted once with
torch.utils.flop_counter, so that every images/s figure is also a share of the machine's peak."""

from __future__ import annotations

import time
from typing import Optional

import torch
from torch import nn


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 5) -> float:
    """Dense matmul FLOP/s of this device (best of `repeats`): the peak a training step can use."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    out = torch.empty_like(a)
    inner = 10 if device.type == "cuda" else 1

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.mm(a, b, out=out)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            torch.mm(a, b, out=out)
        sync()
        best = min(best, (time.perf_counter() - t) / inner)
    return 2 * n**3 / best


def device_peaks(cuda: bool, n: int = 0) -> dict:
    """fp32 (and on GPU bf16) matmul FLOP/s, with the size and threads it was measured with."""
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    n = n or (8192 if cuda else 2048)
    peaks = dict(matmul_n=n, threads=torch.get_num_threads(),
                 fp32=matmul_flops(device, torch.float32, n))
    if cuda:
        peaks["bf16"] = matmul_flops(device, torch.bfloat16, n)
        torch.cuda.empty_cache()
    return peaks


def flops_per_image(model: nn.Module, image: tuple = (3, 32, 32), batch: int = 2) -> dict:
    """Forward and training-step (forward + backward) FLOPs per image, counted once on the CPU."""
    from torch.utils.flop_counter import FlopCounterMode

    model = model.cpu().train()
    x = torch.randn(batch, *image)
    with FlopCounterMode(display=False) as fwd:
        with torch.no_grad():
            model(x)
    with FlopCounterMode(display=False) as step:
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    return dict(forward=fwd.get_total_flops() / batch, train_step=step.get_total_flops() / batch)


def flop_share(images_per_s: Optional[float], flops_image: float, peak: float, devices: int = 1) -> dict:
    """Achieved FLOP/s of a run and its share of `devices` x the measured peak."""
    if not images_per_s:
        return dict(achieved_flops=None, flop_share=None)
    achieved = images_per_s * flops_image
    return dict(achieved_flops=achieved, flop_share=achieved / (peak * devices))


def _f(value: Optional[float], spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def format_peaks(peaks: dict) -> str:
    parts = [f"{k} {peaks[k] / 1e9:,.1f} GFLOP/s" for k in ("fp32", "bf16") if k in peaks]
    return f"device peak (dense {peaks['matmul_n']}x{peaks['matmul_n']} matmul, {peaks['threads']} threads): " \
           + ", ".join(parts)
