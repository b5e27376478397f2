"""The prepared format: its constants, the manifest (read, checked against the files), the Arrow
schema, and a summary line."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import pyarrow as pa

from ..errors import DataError

FORMAT = "ray_job.prepared/1"


MANIFEST = "manifest.json"


META_KEY = b"ray_job"


SPLITS = ("train", "test")


BATCH_ROWS = 2048


DEFAULT_SHARD_MB = 512


IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def prepare_hint(data_dir: str) -> str:
    return (f"HINT: run `python -m ray_job prepare-data --from imagefolder --src YOUR_IMAGES --out "
            f"{data_dir}` (or --from cifar10) first")


def schema_for(geometry: dict, classes: tuple, split: str) -> pa.Schema:
    meta = {META_KEY: json.dumps(dict(format=FORMAT, split=split, classes=list(classes),
                                      geometry=geometry)).encode()}
    if geometry["layout"] == "raw":
        row = geometry["height"] * geometry["width"] * geometry["channels"]
        return pa.schema([("image", pa.binary(row)), ("label", pa.int32())], metadata=meta)
    return pa.schema([("image", pa.binary()), ("label", pa.int32()), ("height", pa.int32()),
                      ("width", pa.int32())], metadata=meta)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(folder: str) -> Optional[dict]:
    """The manifest of a prepared folder, or None when it has none (not ready)."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {os.path.join(folder, MANIFEST)} ({e}); delete the folder "
                        f"and prepare it again. {prepare_hint(folder)}") from None
    if manifest.get("format") != FORMAT:
        raise DataError(f"{folder} holds format {manifest.get('format')!r}, not {FORMAT}; prepare it "
                        f"again. {prepare_hint(folder)}")
    return manifest


def files_complete(folder: str, manifest: dict) -> Optional[str]:
    """None when every file of the manifest is there with its size, else what is wrong."""
    for split in SPLITS:
        for entry in manifest["splits"][split]["files"]:
            path = os.path.join(folder, entry["name"])
            if not os.path.isfile(path):
                return f"{path} is missing"
            if os.path.getsize(path) != entry["bytes"]:
                return f"{path} has {os.path.getsize(path)} bytes, the manifest says {entry['bytes']}"
    return None


def write_json_atomic(path: str, value: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def describe(manifest: dict) -> str:
    g = manifest["geometry"]
    layout = (f"raw {g['height']}x{g['width']} uint8" if g["layout"] == "raw"
              else "encoded (sizes differ)")
    counts = ", ".join(f"{s} {manifest['splits'][s]['rows']} images in "
                       f"{len(manifest['splits'][s]['files'])} file(s)" for s in SPLITS)
    size = sum(e["bytes"] for s in SPLITS for e in manifest["splits"][s]["files"]) / 2**20
    return f"{counts}, {len(manifest['classes'])} classes, {layout}, {size:.1f} MiB"
