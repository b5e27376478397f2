"""The model of a checkpoint: the untrained model the run's config builds, the checkpoint's weights
loaded into it, and its class names in output order. One home for `export`, `predict` and the MLflow
model of a finished run (tracked.log_best_model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn

from ..config import TrainConfig
from ..storage import Location, StorageError, Where
from .checkpoint import CheckpointError, load_checkpoint

CIFAR10_DATA = "cifar10"


@dataclass(frozen=True)
class TrainedModel:
    """A checkpoint's model on the CPU in eval mode, its classes, the run's config, and the
    checkpoint's last finished epoch's metrics (`test_acc` among them)."""

    model: nn.Module
    classes: tuple[str, ...]
    cfg: TrainConfig
    metrics: dict
    epoch: int


def classes_of(state: dict) -> tuple[str, ...]:
    """The class names in output order: the checkpoint's `classes`; for a checkpoint written before
    it had them, CIFAR-10's names (--data cifar10) or class_<i>, as many as the head's outputs (the
    state dict's last 2-D weight)."""
    if state.get("classes"):
        return tuple(str(c) for c in state["classes"])
    if state.get("shards"):  # the full shapes are in DCP's .metadata
        from .shards import model_shapes

        shapes = model_shapes(state["folder"].join(state["shards"]))
    else:
        shapes = {k: tuple(t.shape) for k, t in state["model"].items()}
    heads = [shape for k, shape in shapes.items() if k.endswith("weight") and len(shape) == 2]
    if not heads:
        raise ValueError("the checkpoint's model has no 2-D weight to count its classes by")
    n = int(heads[-1][0])
    if state.get("config", {}).get("data") == CIFAR10_DATA:
        from ..data.cifar10 import CIFAR10_CLASSES

        if n == len(CIFAR10_CLASSES):
            return CIFAR10_CLASSES
    return tuple(f"class_{i}" for i in range(n))


def model_of(state: dict) -> TrainedModel:
    """The trained model of a loaded checkpoint `state` (train/checkpoint.load_checkpoint): a full
    checkpoint's, or a sharded run's (saved by any number of ranks) put together in this process."""
    from ..model import build_for

    cfg = TrainConfig.from_saved(state["config"])
    classes = classes_of(state)
    model = build_for(cfg, len(classes))
    if state.get("shards"):  # a sharded run's: its shards, read here, without any process group
        from . import shards

        try:
            shards.load(state["folder"].join(state["shards"]), model, alone=True)
        except StorageError as e:
            raise CheckpointError(f"cannot read the checkpoint {state['folder'].uri}: {e}") from None
    else:
        model.load_state_dict(state["model"])
    return TrainedModel(model.eval(), classes, cfg, dict(state.get("metrics") or {}), int(state["epoch"]))


def trained_model(path: Where, near: Optional[Location] = None) -> TrainedModel:
    """The trained model of the checkpoint at `path` (its folder or file; local or s3://),
    verified against its manifest."""
    return model_of(load_checkpoint(path, near))

