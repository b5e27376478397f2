"""Checkpoint files: one `checkpoint.pt` per Ray checkpoint directory.

The model is saved unwrapped (no `module.` / `_orig_mod.` prefixes) and everything is loaded onto the
CPU first, so a checkpoint loads on any world size and any device.
"""

from __future__ import annotations

import os

import torch

from .config import UsageError

CHECKPOINT_FILE = "checkpoint.pt"
FORMAT_VERSION = 1


class CheckpointError(UsageError):
    """A checkpoint that is missing or cannot be read."""


def save_checkpoint(directory: str, *, model: torch.nn.Module, optimizer, epoch: int, step: int,
                    config: dict, metrics: dict, world_size: int = 1) -> str:
    """Writes the training state; `epoch` counts finished epochs, `step` the steps into the next.

    The LR schedule is not saved: it is a pure function of the position (epoch, step).
    """
    os.makedirs(directory, exist_ok=True)
    state = {
        "format_version": FORMAT_VERSION,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "step": step,
        "world_size": world_size,
        "config": config,
        "metrics": metrics,
    }
    path = os.path.join(directory, CHECKPOINT_FILE)
    torch.save(state, path)
    return path


def checkpoint_file(path: str) -> str:
    """The checkpoint.pt for a checkpoint directory or file path."""
    return os.path.join(path, CHECKPOINT_FILE) if os.path.isdir(path) else path


def load_checkpoint(path: str) -> dict:
    """Loads a checkpoint onto the CPU, or raises CheckpointError with what to do."""
    file = checkpoint_file(path)
    if not os.path.exists(file):
        raise CheckpointError(f"no checkpoint at {path} (expected a checkpoint directory holding "
                              f"{CHECKPOINT_FILE}, or the file itself); HINT: list them with "
                              f"`ls <storage-path>/<name>/`")
    try:
        state = torch.load(file, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated zip, pickle garbage, wrong file type
        raise CheckpointError(f"checkpoint {file} is corrupt or not a ray_job checkpoint "
                              f"({type(e).__name__}); pick another with --resume-from") from None
    if not isinstance(state, dict) or "model" not in state or "epoch" not in state:
        raise CheckpointError(f"{file} is not a ray_job checkpoint (no model/epoch); pick another "
                              f"with --resume-from")
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{file} has checkpoint format {state.get('format_version')!r}; this "
                              f"ray_job reads format {FORMAT_VERSION}: pick a checkpoint it wrote, "
                              f"or start without --resume-from")
    return state


def restore_training_state(state: dict, *, model, optimizer) -> None:
    """Loads a checkpoint's states into freshly built (possibly wrapped) objects."""
    from .model import unwrap

    unwrap(model).load_state_dict(state["model"])
    if state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])  # moves state to the params' device
