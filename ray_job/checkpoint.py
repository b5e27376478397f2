"""Checkpoint files: one `checkpoint.pt` per Ray checkpoint directory.

The model is saved unwrapped (no `module.` / `_orig_mod.` prefixes) and everything is loaded onto the
CPU first, so a checkpoint loads on any world size and any device. Checkpoints are written to a
local folder, then copied to the run folder (a local folder or an object store) by `upload_checkpoint`.
"""

from __future__ import annotations

import io
import os
from typing import Optional

import torch

from . import storage
from .config import UsageError
from .runlog import EVENTS_JSONL, read_jsonl
from .storage import Location, StorageError, Where

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


def checkpoint_file(path: Where) -> Location:
    """The checkpoint.pt for a checkpoint directory or file (local path, URI or Location)."""
    loc = storage.at(path)
    return loc.join(CHECKPOINT_FILE) if loc.is_dir() else loc


def load_checkpoint(path: Where, near: Optional[Location] = None) -> dict:
    """Loads a checkpoint onto the CPU, or raises CheckpointError with what to do.

    `path` may be on object storage (s3://...): `near` is a Location whose filesystem serves it."""
    try:
        file = checkpoint_file(storage.at(path, near))
        if not file.exists():
            raise CheckpointError(f"no checkpoint at {_name(path)} (expected a checkpoint directory "
                                  f"holding {CHECKPOINT_FILE}, or the file itself); HINT: list them "
                                  f"with `ls <storage-path>/<name>/`")
        source = file.path if file.is_local else io.BytesIO(file.read_bytes())
    except StorageError as e:
        raise CheckpointError(f"cannot read the checkpoint {_name(path)}: {e}") from None
    try:
        state = torch.load(source, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated zip, pickle garbage, wrong file type
        raise CheckpointError(f"checkpoint {file.uri} is corrupt or not a ray_job checkpoint "
                              f"({type(e).__name__}); pick another with --resume-from") from None
    if not isinstance(state, dict) or "model" not in state or "epoch" not in state:
        raise CheckpointError(f"{file.uri} is not a ray_job checkpoint (no model/epoch); pick another "
                              f"with --resume-from")
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{file.uri} has checkpoint format {state.get('format_version')!r}; this "
                              f"ray_job reads format {FORMAT_VERSION}: pick a checkpoint it wrote, "
                              f"or start without --resume-from")
    return state


def _name(path: Where) -> str:
    return path.uri if isinstance(path, Location) else path


def upload_checkpoint(local_dir: str, dest: Location, wait_s: float = 0.0) -> None:
    """Copies a checkpoint folder written by save_checkpoint to storage, retrying for up to
    `wait_s` seconds. A failed copy is removed: a partial checkpoint is never left to be taken."""
    storage.retrying(lambda: dest.upload_dir(local_dir), wait_s, f"saving checkpoint {dest.uri}")


def restore_training_state(state: dict, *, model, optimizer) -> None:
    """Loads a checkpoint's states into freshly built (possibly wrapped) objects."""
    from .model import unwrap

    unwrap(model).load_state_dict(state["model"])
    if state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])  # moves state to the params' device


def newest_saved_checkpoint(store: Location) -> Optional[str]:
    """The newest checkpoint folder of this run that rank 0 finished writing (its checkpoint_saved
    event follows the upload) and that is still there."""
    try:
        saved = [e["checkpoint"] for e in read_jsonl(store.join(EVENTS_JSONL))
                 if e.get("event") == "checkpoint_saved"]
        return next((name for name in reversed(saved)
                     if store.join(name, CHECKPOINT_FILE).exists()), None)
    except (ValueError, StorageError):  # a torn last line, storage away: Ray's record only
        return None
