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
               cuda_available: bool) -> Speed:
        cuda = bool(use_gpu) and cuda_available
        bf16 = precision == "bf16" or (precision == "auto" and cuda)
        nhwc = channels_last == "on" or (channels_last == "auto" and cuda)
        return cls(cuda, bf16, nhwc)

    @classmethod
    def of(cls, cfg: TrainConfig, cuda_available: bool) -> Speed:
        return cls.choose(cfg.precision, cfg.channels_last, cfg.use_gpu, cuda_available)


def choose_use_gpu(requested: Optional[bool], cluster_gpus: float) -> bool:
    """--use-gpu / --no-use-gpu as given, else yes exactly when the cluster has GPUs."""
    if requested and cluster_gpus == 0:
        raise UsageError("--use-gpu was given but the Ray cluster has no GPUs; drop it or use --no-gpu")
    return requested if requested is not None else cluster_gpus > 0
