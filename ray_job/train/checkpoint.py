"""Checkpoint files: one `checkpoint.pt` per Ray checkpoint directory, and a `manifest.json` (size and
SHA-256, written last) that makes a checkpoint provably whole.

A sharded run (fully_shard) keeps its tensors apart: every rank writes its own shards with DCP into
the folder's `shards/` (shards.py), checkpoint.pt holds the rest (format 2), and rank 0 writes the
manifest last, covering checkpoint.pt and every file of every rank (their figures gathered from the
ranks that wrote them). Loading verifies every file of the manifest, streaming, before the checkpoint
counts; `restore_training_state` loads any checkpoint into any model: full or sharded, any world size.

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
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import pyarrow.fs as pafs
import torch

from .. import storage
from ..core.errors import UsageError
from ..core.jsonio import dumps, loads
from ..storage import Location, StorageError, Where, faults

if TYPE_CHECKING:  # shards.py imports DCP (seconds): only where a sharded state is saved or loaded
    from .shards import ShardSaver

CHECKPOINT_FILE = "checkpoint.pt"
MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1  # checkpoint.pt holds every tensor
SHARDED_FORMAT = 2  # checkpoint.pt holds the rest; the tensors are DCP's shards in SHARDS_DIR
SHARDS_DIR = "shards"  # the folder of a sharded checkpoint that holds DCP's files
READ_CHUNK = 8 * 2**20  # bytes hashed at a time when a file is verified
log = logging.getLogger("ray_job")


class CheckpointError(UsageError):
    """A checkpoint that is missing or cannot be read."""


def training_state(*, model: torch.nn.Module, optimizer, epoch: int, step: int, config: dict,
                   metrics: dict, world_size: int = 1, classes: Sequence[str] = ()) -> dict:
    """What a checkpoint file holds; `epoch` counts finished epochs, `step` the steps into the next;
    `classes` the class names in the model's output order; not the LR schedule, a pure function of
    (epoch, step). Its tensors are the live ones: `checkpointer.Snapshot` copies them to keep them."""
    return {"format_version": FORMAT_VERSION, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            **position(epoch=epoch, step=step, config=config, metrics=metrics, world_size=world_size,
                       classes=classes)}


def sharded_state(*, model: torch.nn.Module, optimizer, **rest) -> tuple[dict, dict]:
    """A sharded model's checkpoint: what checkpoint.pt holds (`training_state` but the tensors,
    format 2), and this rank's shards of the model and the optimizer (live: stage them to keep them)."""
    from .shards import state_of

    return ({"format_version": SHARDED_FORMAT, "shards": SHARDS_DIR, **position(**rest)},
            state_of(model, optimizer))


def position(*, epoch: int, step: int, config: dict, metrics: dict, world_size: int = 1,
             classes: Sequence[str] = ()) -> dict:
    """What a checkpoint holds besides tensors."""
    return {"epoch": epoch, "step": step, "world_size": world_size, "config": config, "metrics": metrics,
            "classes": [str(c) for c in classes]}


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
    def write() -> int:
        try:
            files = {CHECKPOINT_FILE: write_file(dest, CHECKPOINT_FILE, state)}
            return files[CHECKPOINT_FILE]["bytes"] + write_manifest(dest, files)
        except StorageError:
            with contextlib.suppress(StorageError):
                dest.delete()
            raise
    return storage.retrying(write, wait_s, f"saving checkpoint {dest.uri}")


def write_file(dest: Location, name: str, state: dict) -> dict:
    """Serialises `state` into `dest`/`name` in one pass; its manifest entry (bytes, sha256), once
    the stored copy has that size."""
    file = dest.join(name)
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
    problem = mismatch(name, dict(bytes=out.bytes), file.info().size)
    if problem:
        raise StorageError(f"the copy of checkpoint {dest.uri} does not verify: {problem}")
    return dict(bytes=out.bytes, sha256=out.sha256.hexdigest())


def write_manifest(dest: Location, files: dict[str, dict]) -> int:
    """The manifest of `files` (name -> bytes, sha256), written last: the checkpoint is whole. Its bytes."""
    version = SHARDED_FORMAT if any(n.startswith(SHARDS_DIR + "/") for n in files) else FORMAT_VERSION
    manifest = dumps(dict(format_version=version, files=files), indent=2, sort_keys=True)
    dest.join(MANIFEST_FILE).write_text(manifest)
    return len(manifest.encode())


def write_sharded_checkpoint(dest: Location, state: dict, tensors: dict, saver: ShardSaver,
                             wait_s: float = 0.0) -> int:
    """Every rank at once: its shards of `tensors` into `dest`/shards; then rank 0, once every rank
    has sent the figures of the files it wrote, checkpoint.pt (`state`: sharded_state's first part)
    and the manifest last. Retried for up to `wait_s` seconds (rank 0's clock decides for all).
    The folder's bytes on every rank; StorageError on every rank, the folder removed, if any failed."""
    deadline, master = time.monotonic() + wait_s, saver.rank == 0
    while True:
        try:
            figures, error = saver.save(dest.join(SHARDS_DIR), tensors), None
        except StorageError as e:
            figures, error = {}, str(e)
        everyone = saver.gather((figures, error))
        outcome = _finish_sharded(dest, state, everyone) if master else None
        if master and outcome[1] is not None and time.monotonic() < deadline:
            outcome = (*outcome[:2], True)
        nbytes, error, again = saver.broadcast(outcome)
        if error is None:
            return nbytes
        if not again:
            raise StorageError(error)
        log.warning("storage: saving checkpoint %s failed (%s); trying again", dest.uri, error)
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))


def _finish_sharded(dest: Location, state: dict, everyone: list) -> tuple[Optional[int], Optional[str], bool]:
    """Rank 0: checkpoint.pt and the manifest of every rank's files, or the first rank's error
    (the folder removed). (bytes, None, False) or (None, error, False)."""
    error = next((e for _, e in everyone if e), None)
    if error is None:
        try:
            files = {name: figures for rank_files, _ in everyone for name, figures in rank_files.items()}
            files[CHECKPOINT_FILE] = write_file(dest, CHECKPOINT_FILE, state)
            return sum(f["bytes"] for f in files.values()) + write_manifest(dest, files), None, False
        except Exception as e:  # whatever it is, the other ranks wait for this answer
            error = str(e) if isinstance(e, StorageError) else f"{type(e).__name__}: {e}"
    with contextlib.suppress(StorageError):
        dest.delete()
    return None, f"checkpoint {dest.uri}: {error}", False


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


def load_checkpoint(path: Where, near: Optional[Location] = None, verify_shards: bool = True) -> dict:
    """Loads a checkpoint (its folder or its file) onto the CPU, or raises CheckpointError with what
    to do. `path` may be on object storage (s3://...): `near` is a Location whose filesystem serves it.
    The state's `folder` is where it came from: a sharded checkpoint's tensors are loaded from there
    (`restore_training_state`), once every file of its manifest verified (`verify_shards`)."""
    name = path.uri if isinstance(path, Location) else path
    try:
        file = storage.at(path, near)
        file = file.join(CHECKPOINT_FILE) if file.is_dir() else file
        if not file.exists():
            raise CheckpointError(f"no checkpoint at {name} (expected a checkpoint directory "
                                  f"holding {CHECKPOINT_FILE}, or the file itself); HINT: list them "
                                  f"with `ls <storage-path>/<name>/`")
        data = read_verified(file)
        state = _unpickled(file, data)
        if state.get("shards") and verify_shards:
            verify_files(file.parent(), read_manifest(file.parent()))
    except StorageError as e:
        raise CheckpointError(f"cannot read the checkpoint {name}: {e}") from None
    state["folder"] = file.parent()
    return state


def _unpickled(file: Location, data: bytes) -> dict:
    """checkpoint.pt's state, checked to be one of ours, of a format this code reads."""
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except Exception as e:  # truncated zip, pickle garbage, wrong file type
        raise CheckpointError(f"checkpoint {file.uri} is corrupt or not a ray_job checkpoint "
                              f"({type(e).__name__}); pick another with --resume-from") from None
    if not isinstance(state, dict) or not ("model" in state or "shards" in state) or "epoch" not in state:
        raise CheckpointError(f"{file.uri} is not a ray_job checkpoint (no model/epoch); pick another "
                              f"with --resume-from")
    if state.get("format_version") not in (FORMAT_VERSION, SHARDED_FORMAT):
        raise CheckpointError(f"{file.uri} has checkpoint format {state.get('format_version')!r}; this "
                              f"ray_job reads formats {FORMAT_VERSION} and {SHARDED_FORMAT}: pick a checkpoint "
                              f"it wrote, or start without --resume-from")
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


def verify_files(folder: Location, manifest: Optional[dict]) -> None:
    """A sharded checkpoint's files (all but checkpoint.pt, read already) against its manifest,
    read in pieces (never a whole model in memory); and no shard file that it does not list."""
    def damaged(problem: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {folder.uri} is damaged: {problem}; pick another with --resume-from")

    if manifest is None:
        raise damaged(f"it has shards but no {MANIFEST_FILE} (its save never finished)")
    files = manifest["files"]
    for name in sorted(set(files) - {CHECKPOINT_FILE}):
        problem = _stream_mismatch(folder.join(*name.split("/")), name, files[name])
        if problem:
            raise damaged(problem)
    unlisted = sorted({f"{SHARDS_DIR}/{n}" for n in folder.join(SHARDS_DIR).files()} - set(files))
    if unlisted:
        raise damaged(f"{unlisted[0]} is not in its {MANIFEST_FILE}")


def _stream_mismatch(file: Location, name: str, recorded: dict) -> Optional[str]:
    """How a file differs from its manifest entry, hashed READ_CHUNK bytes at a time."""
    info = file.info()
    if info.type != pafs.FileType.File:
        return f"{name} is missing (the manifest records {recorded['bytes']} bytes)"
    problem = mismatch(name, recorded, info.size)
    if problem:
        return problem
    sha256 = hashlib.sha256()
    with faults("read", file), file.fs.open_input_stream(file.path) as f:
        while chunk := f.read(READ_CHUNK):
            sha256.update(chunk)
    return None if sha256.hexdigest() == recorded["sha256"] else \
        f"{name} has its recorded size but not its recorded SHA-256"


def restore_training_state(state: dict, *, model, optimizer) -> None:
    """Loads a checkpoint's states into freshly built (possibly wrapped) objects, on every rank: a
    sharded checkpoint into a sharded or a plain model at any world size (its shards are read from
    the state's `folder`), a full one into a plain or a sharded model."""
    from ..model.parts import unwrap
    from ..model.sharding import is_sharded
    from . import shards

    plain = unwrap(model)
    try:
        if state.get("shards"):
            shards.load(state["folder"].join(state["shards"]), plain, optimizer)
        elif is_sharded(plain):
            shards.load_full(plain, optimizer, state["model"], state.get("optimizer"))
        else:
            plain.load_state_dict(state["model"])
            if state.get("optimizer") is not None:
                optimizer.load_state_dict(state["optimizer"])  # moves state to the params' device
    except (StorageError, ValueError) as e:
        where = state["folder"].uri if state.get("folder") else "checkpoint"
        raise CheckpointError(f"cannot load the checkpoint {where} into this model: {e}") from None
