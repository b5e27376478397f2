"""Writing a prepared folder: shards of about --shard-mb, each one record batch, then the manifest
last, all under `<out>.partial-<pid>`, swapped into place when complete."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import DataError
from .format import (BATCH_ROWS, DEFAULT_SHARD_MB, FORMAT, MANIFEST, SPLITS, files_complete, read_manifest,
                     schema_for, sha256, write_json_atomic)
from .sources import Source, decide_geometry


class ShardWriter:
    """One split as <split>-NNNNN.arrow files of about `shard_bytes` (`entries`: the finished ones).
    A shard is one record batch: its images are one contiguous region of the file, so a reader
    gathers a batch of indices from it with a single indexing operation (the writer holds one shard
    in memory, --shard-mb)."""

    def __init__(self, out: str, split: str, schema: pa.Schema, shard_bytes: int):
        self.out, self.split, self.schema, self.shard_bytes = out, split, schema, shard_bytes
        self.entries: list = []
        self.pending: list = []
        self.bytes = 0

    def write(self, batch: pa.RecordBatch) -> None:
        self.pending.append(batch)
        self.bytes += batch.nbytes
        if self.bytes >= self.shard_bytes:
            self.close_shard()

    def close_shard(self) -> None:
        if not self.pending:
            return
        name = f"{self.split}-{len(self.entries):05d}.arrow"
        path = os.path.join(self.out, name)
        table = pa.Table.from_batches(self.pending, self.schema).combine_chunks()
        with pa.OSFile(path + ".tmp", "wb") as sink, pa.ipc.new_file(sink, self.schema) as writer:
            writer.write_table(table, max_chunksize=max(table.num_rows, 1))
        os.replace(path + ".tmp", path)
        self.entries.append(dict(name=name, bytes=os.path.getsize(path), sha256=sha256(path),
                                 rows=table.num_rows))
        self.pending, self.bytes = [], 0


def _read_image(path: str, raw: bool) -> Any:
    """raw: the image as uint8 RGB; else (the file's bytes, height, width), once it decodes."""
    from PIL import Image

    try:
        data = open(path, "rb").read()
        with Image.open(io.BytesIO(data)) as im:
            if raw:
                return np.asarray(im.convert("RGB"))
            im.load()
            return data, im.height, im.width
    except OSError as e:
        raise DataError(f"cannot decode image {path} ({e}); delete or replace it") from None


def _raw_batch(flat: np.ndarray, labels: Any) -> pa.RecordBatch:
    """uint8 rows (N, H*W*C) as one fixed_size_binary column, beside the labels."""
    image = pa.FixedSizeBinaryArray.from_buffers(pa.binary(flat.shape[1]), len(flat),
                                                 [None, pa.py_buffer(np.ascontiguousarray(flat))])
    return pa.record_batch([image, pa.array(labels, pa.int32())], names=["image", "label"])


def split_batches(source: Source, split: str, bar) -> Any:
    """Record batches of one split, in source order."""
    if source.kind == "cifar10":
        from ..cifar10 import load_cifar10

        data = load_cifar10(source.path, split == "train")
        images, labels = data.images.numpy().reshape(len(data), -1), data.labels.numpy()
        for i in range(0, len(data), BATCH_ROWS):
            bar.update(len(images[i:i + BATCH_ROWS]))
            yield _raw_batch(images[i:i + BATCH_ROWS], labels[i:i + BATCH_ROWS])
        return
    items = source.files[split]
    raw = source.geometry["layout"] == "raw"
    rows = BATCH_ROWS if raw else BATCH_ROWS // 8
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for i in range(0, len(items), rows):
            chunk = items[i:i + rows]
            labels = [label for _, label in chunk]
            done = list(pool.map(lambda path: _read_image(path, raw), [p for p, _ in chunk]))
            if raw:
                batch = _raw_batch(np.stack(done).reshape(len(done), -1), labels)
            else:
                data, heights, widths = zip(*done)
                batch = pa.record_batch([pa.array(data, pa.binary()), pa.array(labels, pa.int32()),
                                         pa.array(heights, pa.int32()), pa.array(widths, pa.int32())],
                                        names=["image", "label", "height", "width"])
            bar.update(len(chunk))
            yield batch


def _check_target(out: str) -> None:
    """`out` may be new or a prepared folder (replaced as a whole at the end); anything else is
    refused, so that nothing of the user's is overwritten."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise DataError(f"--out {out} is a file; give a folder")
    if os.path.isdir(out):
        foreign = sorted(f for f in os.listdir(out) if f != MANIFEST and f != "SOURCE"
                         and not f.endswith((".arrow", ".arrow.tmp")))
        if foreign:
            raise DataError(f"--out {out} holds other files ({', '.join(foreign[:3])}); give an "
                            f"empty or new folder")


def write_prepared(source: Source, out: str, shard_mb: float = DEFAULT_SHARD_MB,
                   progress: bool = True) -> dict:
    """Converts `source` into a prepared folder `out`; returns the manifest.

    Written into `<out>.partial-<pid>` (manifest last) and renamed to `out` once complete, so `out`
    is at every moment either the old dataset, the new one, or absent; a failure leaves it as it was."""
    from tqdm import tqdm

    out = os.path.abspath(out)
    _check_target(out)
    if source.geometry is None:
        source.geometry = decide_geometry(source)
    tmp = f"{out}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
    except OSError as e:
        raise DataError(f"cannot create {tmp}: {e.strerror}") from None
    total = sum(len(v) for v in source.files.values()) or None
    try:
        splits = {}
        with tqdm(total=total, unit="img", desc=f"preparing {os.path.basename(out)}",
                  disable=not progress, mininterval=1.0) as bar:
            for split in SPLITS:
                writer = ShardWriter(tmp, split, schema_for(source.geometry, source.classes, split),
                                     int(shard_mb * 2**20))
                for batch in split_batches(source, split, bar):
                    writer.write(batch)
                writer.close_shard()
                splits[split] = dict(rows=sum(e["rows"] for e in writer.entries), files=writer.entries)
        manifest = dict(format=FORMAT, source=dict(kind=source.kind, path=os.path.abspath(source.path),
                                                   fingerprint=source.fingerprint),
                        classes=list(source.classes), geometry=source.geometry, splits=splits,
                        created=time.time())
        write_json_atomic(os.path.join(tmp, MANIFEST), manifest)
        _swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _swap_in(tmp: str, out: str) -> None:
    if not os.path.isdir(out):
        os.rename(tmp, out)
        return
    old = f"{out}.old-{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out, MANIFEST))  # the old copy reads as not ready from here on
    os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def ensure_prepared(source: Source, out: str, shard_mb: float = DEFAULT_SHARD_MB,
                    progress: bool = True) -> tuple[dict, bool]:
    """(manifest, whether it was written now): prepares `out` unless it already holds this source;
    one process at a time per folder (a file lock beside it)."""
    from filelock import FileLock

    parent, name = os.path.split(os.path.abspath(out))
    try:
        os.makedirs(parent, exist_ok=True)
        with FileLock(os.path.join(parent, f".{name}.lock")):
            manifest = read_manifest(out) if os.path.isdir(out) else None
            if (manifest is not None and manifest["source"]["kind"] == source.kind
                    and manifest["source"]["fingerprint"] == source.fingerprint
                    and files_complete(out, manifest) is None):
                return manifest, False
            return write_prepared(source, out, shard_mb, progress), True
    except PermissionError as e:
        raise DataError(f"cannot write the prepared data at {out} ({e.strerror}); run `python -m "
                        f"ray_job prepare-data --from {source.kind} --src {source.path} --out "
                        f"WRITABLE_DIR` and train with --data prepared --data-dir WRITABLE_DIR") from None
