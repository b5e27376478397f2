"""Checkpoint files: one `checkpoint.pt` per Ray checkpoint directory, and a `manifest.json` (size and
SHA-256, written last) that makes a checkpoint provably whole.

The model is saved unwrapped (no `module.` / `_orig_mod.` prefixes) and everything is loaded onto the
CPU first, so a checkpoint loads on any world size and any device. `write_checkpoint` serialises
straight into the folder (local or object store: one pass, no local copy), counting and hashing the
bytes on their way out; every load reads the bytes itself (`read_verified`) and checks them against
the manifest before unpickling, naming the file that is short, and by how much, or whose checksum differs.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
from collections.abc import Sequence
from typing import Any, Optional

import torch

from .. import storage
from ..core.errors import UsageError
from ..core.jsonio import dumps, loads
from ..storage import Location, StorageError, Where, faults

CHECKPOINT_FILE = "checkpoint.pt"
MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1


class CheckpointError(UsageError):
    """A checkpoint that is missing or cannot be read."""


def training_state(*, model: torch.nn.Module, optimizer, epoch: int, step: int, config: dict,
                   metrics: dict, world_size: int = 1, classes: Sequence[str] = ()) -> dict:
    """What a checkpoint file holds; `epoch` counts finished epochs, `step` the steps into the next;
    `classes` the class names in the model's output order; not the LR schedule, a pure function of
    (epoch, step). Its tensors are the live ones: `checkpointer.Snapshot` copies them to keep them."""
    return {
        "format_version": FORMAT_VERSION,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "step": step,
        "world_size": world_size,
        "config": config,
        "metrics": metrics,
        "classes": [str(c) for c in classes],
    }


def save_checkpoint(dest: Where, **state) -> str:
    """Writes the training state of `training_state(**state)` into the folder `dest`; the path of its
    checkpoint file."""
    folder = storage.at(dest)
    write_checkpoint(folder, training_state(**state))
    return folder.join(CHECKPOINT_FILE).uri


class _Counted:
    """A write-only file that counts and hashes what passes through to `sink`, and keeps the
    sink's own error (torch.save reports a failed write as a bare RuntimeError)."""

    def __init__(self, sink: Any):
        self.sink, self.bytes, self.sha256, self.error = sink, 0, hashlib.sha256(), None

    def write(self, data: Any) -> int:
        try:
            self.sink.write(data)
        except BaseException as e:
            self.error = e
            raise
        self.sha256.update(data)
        self.bytes += len(data)
        return len(data)

    def flush(self) -> None:
        pass


WRITE_BUFFER = 8 * 2**20  # bytes handed to the store at a time (torch.save writes ~80 KB pieces)


def write_checkpoint(dest: Location, state: dict, wait_s: float = 0.0) -> int:
    """Serialises `state` into the folder `dest` as checkpoint.pt, checks the stored size and writes
    the manifest last; retried for up to `wait_s` seconds. Returns the folder's bytes. A failed or
    short copy is removed, so a partial checkpoint is never left to be taken. (pyarrow does not
    expose S3's checksums: the SHA-256 is checked again on every load instead.)"""
    file = dest.join(CHECKPOINT_FILE)

    def write() -> int:
        try:
            with faults("write", file):
                dest.makedirs()
                with dest.fs.open_output_stream(file.path, compression=None, buffer_size=WRITE_BUFFER) as f:
                    out = _Counted(f)
                    try:
                        torch.save(state, out)
                    except Exception:
                        if out.error is not None:
                            raise out.error from None
                        raise
            problem = mismatch(CHECKPOINT_FILE, dict(bytes=out.bytes), file.info().size)
            if problem:
                raise StorageError(f"the copy of checkpoint {dest.uri} does not verify: {problem}")
            manifest = dumps(dict(format_version=FORMAT_VERSION, files={
                CHECKPOINT_FILE: dict(bytes=out.bytes, sha256=out.sha256.hexdigest())}), indent=2, sort_keys=True)
            dest.join(MANIFEST_FILE).write_text(manifest)
            return out.bytes + len(manifest.encode())
        except StorageError:
            with contextlib.suppress(StorageError):
                dest.delete()
            raise
    return storage.retrying(write, wait_s, f"saving checkpoint {dest.uri}")


def read_manifest(folder: Location) -> Optional[dict]:
    """A checkpoint folder's manifest; None for a checkpoint written before there were manifests."""
    try:
        manifest = loads(folder.join(MANIFEST_FILE).read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        manifest = None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"checkpoint {folder.uri} is damaged: its {MANIFEST_FILE} is not a "
                              f"manifest; pick another with --resume-from")
    return manifest


def mismatch(name: str, recorded: dict, size: int, data: Optional[bytes] = None) -> Optional[str]:
    """How a file differs from its manifest entry (size, then checksum when `data` is given)."""
    want = int(recorded["bytes"])
    if size != want:
        off = f"{want - size} bytes short" if size < want else f"{size - want} bytes too long"
        return f"{name} holds {size} bytes, {off} of the {want} recorded when it was saved"
    if data is not None and hashlib.sha256(data).hexdigest() != recorded["sha256"]:
        return f"{name} has its recorded size but not its recorded SHA-256"
    return None


def load_checkpoint(path: Where, near: Optional[Location] = None) -> dict:
    """Loads a checkpoint (its folder or its file) onto the CPU, or raises CheckpointError with what
    to do. `path` may be on object storage (s3://...): `near` is a Location whose filesystem serves it."""
    name = path.uri if isinstance(path, Location) else path
    try:
        file = storage.at(path, near)
        file = file.join(CHECKPOINT_FILE) if file.is_dir() else file
        if not file.exists():
            raise CheckpointError(f"no checkpoint at {name} (expected a checkpoint directory "
                                  f"holding {CHECKPOINT_FILE}, or the file itself); HINT: list them "
                                  f"with `ls <storage-path>/<name>/`")
        data = read_verified(file)
    except StorageError as e:
        raise CheckpointError(f"cannot read the checkpoint {name}: {e}") from None
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
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


def read_verified(file: Location) -> bytes:
    """The bytes of a checkpoint file, checked against its folder's manifest when it has one.

    Read by this process into its own memory on purpose: Ray's `Checkpoint.as_directory()` shares
    one download folder per checkpoint among a node's processes, and a worker that comes after
    another's download has finished downloads it again into that folder, truncating the file the
    first one is still reading (Ray 2.60; tests/test_checkpoint.py shows it). On a slow machine the
    first worker then unpickled a short checkpoint.pt."""
    folder = file.parent()
    manifest = read_manifest(folder)
    data = file.read_bytes()
    if manifest is not None:
        recorded = manifest["files"].get(file.name)
        problem = (f"{file.name} is not in its {MANIFEST_FILE}" if recorded is None
                   else mismatch(file.name, recorded, len(data), data))
        if problem:
            raise CheckpointError(f"checkpoint {folder.uri} is damaged: {problem}; pick another "
                                  f"with --resume-from")
    return data


def restore_training_state(state: dict, *, model, optimizer) -> None:
    """Loads a checkpoint's states into freshly built (possibly wrapped) objects."""
    from ..model.parts import unwrap

    unwrap(model).load_state_dict(state["model"])
    if state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])  # moves state to the params' device
