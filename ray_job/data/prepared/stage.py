"""A prepared dataset on object storage (`--data-dir s3://...`), staged once per node into a local
cache (a file lock, each file's SHA-256 checked, the local manifest written last) and reused."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os

from ... import storage
from ..errors import DataError
from .format import FORMAT, MANIFEST, SPLITS, files_complete, prepare_hint, read_manifest, write_json_atomic


def cache_root() -> str:
    return os.environ.get("RJ_DATA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                           "ray_job", "data")


def stage(uri: str) -> str:
    """A local copy of the prepared dataset at `uri`, made once per node (file lock) in
    cache_root()/<hash of the URI>; files whose size matches the manifest are kept, so later runs
    and requeued jobs copy nothing. The local manifest is written last, as when preparing."""
    from filelock import FileLock

    remote = storage.at(uri)
    manifest = remote_manifest(uri)
    local = os.path.join(cache_root(), hashlib.sha1(uri.rstrip("/").encode()).hexdigest()[:16])
    os.makedirs(local, exist_ok=True)
    with FileLock(local + ".lock"):
        if read_manifest(local) == manifest and files_complete(local, manifest) is None:
            return local
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(local, MANIFEST))
        for split in SPLITS:
            for entry in manifest["splits"][split]["files"]:
                _fetch(remote.join(entry["name"]), os.path.join(local, entry["name"]), entry)
        with open(os.path.join(local, "SOURCE"), "w") as f:
            f.write(uri + "\n")
        write_json_atomic(os.path.join(local, MANIFEST), manifest)
    return local


def remote_manifest(uri: str) -> dict:
    """The manifest of a prepared dataset on object storage, or a DataError saying what to do."""
    try:
        manifest = json.loads(storage.at(uri).join(MANIFEST).read_bytes())
    except FileNotFoundError:
        raise DataError(f"no {MANIFEST} under --data-dir {uri}: not a prepared dataset (or not "
                        f"completely uploaded). {prepare_hint('./prepared')}, then copy the folder "
                        f"there, manifest.json last") from None
    except (storage.StorageError, ValueError) as e:
        raise DataError(f"cannot read {MANIFEST} under --data-dir {uri}: {e}") from None
    if manifest.get("format") != FORMAT:
        raise DataError(f"{uri} holds format {manifest.get('format')!r}, not {FORMAT}; prepare it again")
    return manifest


def _fetch(src: storage.Location, dest: str, entry: dict) -> None:
    if os.path.isfile(dest) and os.path.getsize(dest) == entry["bytes"]:
        return
    tmp = f"{dest}.tmp{os.getpid()}"
    h = hashlib.sha256()
    try:
        with storage.faults("read", src), src.fs.open_input_stream(src.path) as f, open(tmp, "wb") as out:
            while chunk := f.read(storage.CHUNK):
                h.update(chunk)
                out.write(chunk)
    except FileNotFoundError:
        raise DataError(f"{src.uri} is listed in the manifest but missing; upload the prepared "
                        f"folder again") from None
    except storage.StorageError as e:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise DataError(f"cannot stage {src.uri}: {e}") from None
    if h.hexdigest() != entry["sha256"]:
        os.remove(tmp)
        raise DataError(f"{src.uri} does not match its manifest (SHA-256); upload the prepared "
                        f"folder again")
    os.replace(tmp, dest)
