"""Decisions made from the config and the hardware, in one place: GPUs or not, bf16, channels_last."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from ..core.errors import UsageError

if TYPE_CHECKING:
    from .run import TrainConfig


@dataclass(frozen=True)
class Speed:
    """Device and numerics of a worker, decided in one place from the config and the hardware."""

    cuda: bool
    bf16: bool
    channels_last: bool

    @classmethod
    def choose(cls, precision: str, channels_last: str, use_gpu: Optional[bool],
               cuda_available: bool, bf16_card: Optional[bool] = None) -> Speed:
        """`precision auto`: bf16 on a GPU that computes in bf16 (compute capability 8.0 and up),
        else fp32 -- the step has no loss scaling, which fp16 would need. `bf16_card`: whether the
        GPU computes in bf16; None asks the GPU of this process, when it has one."""
        cuda = bool(use_gpu) and cuda_available
        auto_bf16 = cuda and (gpu_has_bf16() if bf16_card is None else bf16_card)
        bf16 = precision == "bf16" or (precision == "auto" and auto_bf16)
        nhwc = channels_last == "on" or (channels_last == "auto" and cuda)
        return cls(cuda, bf16, nhwc)

    @classmethod
    def of(cls, cfg: TrainConfig, cuda_available: bool) -> Speed:
        return cls.choose(cfg.precision, cfg.channels_last, cfg.use_gpu, cuda_available)


def gpu_has_bf16() -> bool:
    """Whether this process's GPU computes in bf16 itself (Ampere and newer), not by emulation;
    True where there is no GPU to ask (nothing then runs on one)."""
    import torch

    if not torch.cuda.is_available():
        return True
    return torch.version.hip is not None or torch.cuda.get_device_capability()[0] >= 8


def choose_use_gpu(requested: Optional[bool], cluster_gpus: float) -> bool:
    """--use-gpu / --no-use-gpu as given, else yes exactly when the cluster has GPUs."""
    if requested and cluster_gpus == 0:
        raise UsageError("--use-gpu was given but the Ray cluster has no GPUs; drop it or use --no-gpu")
    return requested if requested is not None else cluster_gpus > 0
