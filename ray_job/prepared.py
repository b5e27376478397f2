"""The prepared dataset: images in uncompressed Arrow IPC files, memory-mapped by every worker.

    python -m ray_job prepare-data --from imagefolder --src ./my_jpegs --out ./prepared
    python -m ray_job train --data prepared --data-dir ./prepared --image-size 64 --stem imagenet

A prepared folder holds, per split, `<split>-00000.arrow`, ... (shards of about --shard-mb MiB,
record batches of up to BATCH_ROWS rows) and one `manifest.json`, written last: file names, sizes,
SHA-256 and row counts, the classes, the image geometry and the fingerprint of the source. No
manifest means not ready, so a half-written dataset is never used; the same source prepared again
is found by its fingerprint and left alone.

Two image layouts (the file's schema metadata says which, as does the manifest):
  raw      every image has one size: `image` is fixed_size_binary(H*W*3), uint8 HWC like CIFAR-10;
           a batch is gathered from the mapped pages with one numpy indexing operation per record
           batch and goes to the device like the in-memory split (pad-4 crop, flip, normalise there)
           when H = W = --image-size.
  encoded  sizes differ: `image` holds each file's encoded bytes (JPEG, PNG, ...), with `height` and
           `width`; decoded in the DataLoader's workers and brought to --image-size (train: random
           resized crop + flip; test: resize + center crop), uint8 out, normalised on the device.

The files are opened with `pyarrow.memory_map`: the pages are the page cache's, shared by every
worker on a node, so a worker's anonymous memory does not grow with the dataset. `--data-dir
s3://...` is staged once per node into a local cache first (`stage`), through storage.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import Dataset

from . import storage
from .config import UsageError, is_uri

FORMAT = "ray_job.prepared/1"
MANIFEST = "manifest.json"
META_KEY = b"ray_job"
SPLITS = ("train", "test")
BATCH_ROWS = 2048
DEFAULT_SHARD_MB = 512
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
EVAL_RESIZE = 0.875  # test images: resize the short side to S / 0.875, then center-crop S


class DataError(UsageError):
    """Data that is missing or unreadable; the message says how to fix it."""


def prepare_hint(data_dir: str) -> str:
    return (f"HINT: run `python -m ray_job prepare-data --from imagefolder --src YOUR_IMAGES --out "
            f"{data_dir}` (or --from cifar10) first")


# --- sources ---------------------------------------------------------------------------------------

@dataclass
class Source:
    """What is to be prepared: per split, either raw arrays or a list of image files."""

    kind: str                   # cifar10 | imagefolder
    path: str
    classes: tuple
    fingerprint: str            # names and sizes of the source files
    files: dict                 # split -> [(path, label)] (imagefolder)
    geometry: Optional[dict] = None   # {"layout": "raw", "height", "width", "channels"} or encoded


def _fingerprint(entries: list) -> str:
    return hashlib.sha1(json.dumps(entries).encode()).hexdigest()


def cifar10_source(src: str) -> Source:
    from .data import CIFAR10_CLASSES, CIFAR10_FOLDER, CIFAR10_TEST_FILES, CIFAR10_TRAIN_FILES

    folder = os.path.join(src, CIFAR10_FOLDER)
    names = CIFAR10_TRAIN_FILES + CIFAR10_TEST_FILES
    entries = [(n, os.path.getsize(os.path.join(folder, n))) for n in names]
    return Source("cifar10", src, CIFAR10_CLASSES, _fingerprint(entries), {},
                  dict(layout="raw", height=32, width=32, channels=3))


def imagefolder_source(src: str, layout: str = "auto") -> Source:
    """DIR/{train,test}/<class>/<image>: classes from train/, test classes must be among them."""
    splits, classes = {}, None
    for split in SPLITS:
        root = os.path.join(src, split)
        if not os.path.isdir(root):
            raise DataError(f"{src} needs {split}/<class>/<images> (e.g. {root}/cat/0001.jpg); "
                            f"{root} is missing")
        found = sorted(d.name for d in os.scandir(root) if d.is_dir())
        if classes is None:
            classes = tuple(found)
            if not classes:
                raise DataError(f"no class folders under {root}: put images in {root}/<class>/")
        elif set(found) - set(classes):
            raise DataError(f"{root} has classes that train/ lacks: {sorted(set(found) - set(classes))}")
        items = []
        for label, name in enumerate(classes):
            d = os.path.join(root, name)
            if os.path.isdir(d):
                items += [(os.path.join(d, f), label) for f in sorted(os.listdir(d))
                          if f.lower().endswith(IMAGE_EXTENSIONS)]
        if not items:
            raise DataError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {root}/<class>/")
        splits[split] = items
    entries = [(os.path.relpath(p, src), os.path.getsize(p), label)
               for split in SPLITS for p, label in splits[split]]
    source = Source("imagefolder", src, classes, _fingerprint(entries + [layout]), splits)
    source.geometry = decide_geometry(source, layout) if layout != "auto" else None
    return source


def _image_size(path: str) -> tuple:
    from PIL import Image

    try:
        with Image.open(path) as im:  # reads the header only
            return im.size
    except OSError as e:
        raise DataError(f"cannot read image {path} ({e}); delete or replace it") from None


def decide_geometry(source: Source, layout: str = "auto") -> dict:
    """raw when every image has one size (CIFAR-like uint8), else encoded bytes; `layout` encoded
    keeps the files' bytes even when they share a size (smaller files, decoded in the loader)."""
    if layout == "encoded":
        return dict(layout="encoded")
    paths = [p for split in SPLITS for p, _ in source.files[split]]
    with ThreadPoolExecutor(max_workers=8) as pool:
        sizes = set(pool.map(_image_size, paths, chunksize=64))
    if len(sizes) == 1:
        (w, h), = sizes
        return dict(layout="raw", height=h, width=w, channels=3)
    if layout == "raw":
        raise DataError(f"--layout raw needs images of one size; {source.path} has {len(sizes)} "
                        f"sizes (e.g. {sorted(sizes)[:3]}): use --layout auto or encoded")
    return dict(layout="encoded")


# --- writing ---------------------------------------------------------------------------------------

def schema_for(geometry: dict, classes: tuple, split: str) -> pa.Schema:
    meta = {META_KEY: json.dumps(dict(format=FORMAT, split=split, classes=list(classes),
                                      geometry=geometry)).encode()}
    if geometry["layout"] == "raw":
        row = geometry["height"] * geometry["width"] * geometry["channels"]
        return pa.schema([("image", pa.binary(row)), ("label", pa.int32())], metadata=meta)
    return pa.schema([("image", pa.binary()), ("label", pa.int32()), ("height", pa.int32()),
                      ("width", pa.int32())], metadata=meta)


class ShardWriter:
    """Writes one split as <split>-NNNNN.arrow files of about `shard_bytes`, each under a temporary
    name until it is complete; `entries` lists the finished ones for the manifest.

    A shard is one record batch: its images are one contiguous region of the file, so a reader
    gathers a batch of indices from it with a single indexing operation (the writer holds one
    shard in memory, --shard-mb)."""

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


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            h.update(chunk)
    return h.hexdigest()


def _decode_rgb(path: str) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(path) as im:
            return np.asarray(im.convert("RGB"))
    except OSError as e:
        raise DataError(f"cannot decode image {path} ({e}); delete or replace it") from None


def _check_encoded(path: str) -> tuple:
    """(bytes, height, width) of an image file, after checking that it decodes."""
    from PIL import Image

    data = open(path, "rb").read()
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            return data, im.height, im.width
    except OSError as e:
        raise DataError(f"cannot decode image {path} ({e}); delete or replace it") from None


def split_batches(source: Source, split: str, bar) -> Any:
    """Record batches of one split, in source order."""
    if source.kind == "cifar10":
        from .data import load_cifar10

        data = load_cifar10(source.path, split == "train")
        images, labels = data.images.numpy().reshape(len(data), -1), data.labels.numpy()
        for i in range(0, len(data), BATCH_ROWS):
            chunk = images[i:i + BATCH_ROWS]
            arr = pa.FixedSizeBinaryArray.from_buffers(pa.binary(chunk.shape[1]), len(chunk),
                                                       [None, pa.py_buffer(np.ascontiguousarray(chunk))])
            bar.update(len(chunk))
            yield pa.record_batch([arr, pa.array(labels[i:i + BATCH_ROWS], pa.int32())],
                                  names=["image", "label"])
        return
    items = source.files[split]
    raw = source.geometry["layout"] == "raw"
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for i in range(0, len(items), BATCH_ROWS // (1 if raw else 8)):
            chunk = items[i:i + BATCH_ROWS // (1 if raw else 8)]
            labels = pa.array([label for _, label in chunk], pa.int32())
            if raw:
                arrays = list(pool.map(_decode_rgb, [p for p, _ in chunk]))
                flat = np.stack(arrays).reshape(len(arrays), -1)
                image = pa.FixedSizeBinaryArray.from_buffers(pa.binary(flat.shape[1]), len(flat),
                                                             [None, pa.py_buffer(flat)])
                batch = pa.record_batch([image, labels], names=["image", "label"])
            else:
                done = list(pool.map(_check_encoded, [p for p, _ in chunk]))
                batch = pa.record_batch(
                    [pa.array([d for d, _, _ in done], pa.binary()), labels,
                     pa.array([h for _, h, _ in done], pa.int32()),
                     pa.array([w for _, _, w in done], pa.int32())],
                    names=["image", "label", "height", "width"])
            bar.update(len(chunk))
            yield batch


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


def write_json_atomic(path: str, value: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def prepared_matches(out: str, source: Source) -> bool:
    manifest = read_manifest(out) if os.path.isdir(out) else None
    return (manifest is not None and manifest["source"]["kind"] == source.kind
            and manifest["source"]["fingerprint"] == source.fingerprint
            and files_complete(out, manifest) is None)


def ensure_prepared(source: Source, out: str, shard_mb: float = DEFAULT_SHARD_MB,
                    progress: bool = True) -> tuple[dict, bool]:
    """(manifest, whether it was written now): prepares `out` unless it already holds this source;
    one process at a time per folder (a file lock beside it)."""
    from filelock import FileLock

    parent = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(parent, exist_ok=True)
        lock = FileLock(os.path.join(parent, f".{os.path.basename(os.path.abspath(out))}.lock"))
        with lock:
            if prepared_matches(out, source):
                return read_manifest(out), False
            return write_prepared(source, out, shard_mb, progress), True
    except PermissionError as e:
        raise DataError(f"cannot write the prepared data at {out} ({e.strerror}); run `python -m "
                        f"ray_job prepare-data --from {source.kind} --src {source.path} --out "
                        f"WRITABLE_DIR` and train with --data prepared --data-dir WRITABLE_DIR") from None


# --- staging from object storage -------------------------------------------------------------------

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


def local_folder(data_dir: str) -> str:
    """The local prepared folder for --data-dir: itself, or its node-local copy for a URI."""
    return stage(data_dir) if is_uri(data_dir) else data_dir


def open_manifest(folder: str) -> dict:
    """The manifest of a ready prepared folder, or a DataError saying what to do."""
    if not os.path.isdir(folder):
        raise DataError(f"--data-dir {folder} does not exist. {prepare_hint(folder)}")
    manifest = read_manifest(folder)
    if manifest is None and os.path.isdir(os.path.join(folder, "train")):
        raise DataError(f"--data-dir {folder} has no {MANIFEST}: it looks like a folder of images. "
                        f"HINT: train with --data imagefolder, or run `python -m ray_job prepare-data "
                        f"--from imagefolder --src {folder} --out OTHER_DIR` and --data-dir OTHER_DIR")
    if manifest is None:
        raise DataError(f"--data-dir {folder} has no {MANIFEST}: not a prepared dataset, or one "
                        f"that was not completely written. {prepare_hint(folder)}")
    problem = files_complete(folder, manifest)
    if problem:
        raise DataError(f"prepared data at {folder} is incomplete: {problem}. {prepare_hint(folder)}")
    return manifest


# --- reading ---------------------------------------------------------------------------------------

def _identity(batch):
    return batch


class PreparedImages(Dataset):
    """One split of a prepared folder, read through memory maps, a batch at a time.

    The files are opened lazily in each process (DataLoader workers included), so what is pickled
    is only the folder and the settings. `__getitems__` returns uint8 (B, S, S, 3) and int64 labels.
    """

    collate_fn = staticmethod(_identity)

    def __init__(self, folder: str, split: str, image_size: int, train: bool,
                 manifest: Optional[dict] = None):
        self.folder, self.split, self.image_size, self.train = folder, split, image_size, train
        self.manifest = manifest or open_manifest(folder)
        self.classes = tuple(self.manifest["classes"])
        g = self.manifest["geometry"]
        self.raw = g["layout"] == "raw"
        # raw images of the model's size go as they are; the device crops and flips them
        self.device_crop = self.raw and g["height"] == g["width"] == image_size
        self._length = self.manifest["splits"][split]["rows"]
        self._opened: Optional[tuple] = None

    def __len__(self) -> int:
        return self._length

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_opened": None}

    def _open(self) -> tuple:
        """(starts, [(images or (offsets, data), labels) per record batch]) over the mapped files."""
        if self._opened is not None and self._opened[0] == os.getpid():
            return self._opened[1], self._opened[2]
        chunks, starts, n = [], [], 0
        for entry in self.manifest["splits"][self.split]["files"]:
            path = os.path.join(self.folder, entry["name"])
            try:
                reader = pa.ipc.open_file(pa.memory_map(path, "r"))
                for i in range(reader.num_record_batches):
                    batch = reader.get_batch(i)
                    starts.append(n)
                    n += batch.num_rows
                    chunks.append(self._views(batch))
            except (OSError, pa.ArrowException) as e:
                raise DataError(f"cannot read prepared file {path} ({e}); prepare the data again. "
                                f"{prepare_hint(self.folder)}") from None
        if n != self._length:
            raise DataError(f"{self.folder}: the {self.split} files hold {n} images, the manifest "
                            f"{self._length}; prepare the data again")
        self._opened = (os.getpid(), np.asarray(starts), chunks)
        return self._opened[1], chunks

    def _views(self, batch: pa.RecordBatch) -> tuple:
        """numpy views of one record batch's buffers (no copy: the pages stay the file's)."""
        image, label = batch.column(0), batch.column(1)
        labels = np.frombuffer(label.buffers()[1], np.int32, len(label), label.offset * 4)
        if self.raw:
            g = self.manifest["geometry"]
            shape = (g["height"], g["width"], g["channels"])
            row = int(np.prod(shape))
            data = np.frombuffer(image.buffers()[1], np.uint8, len(image) * row, image.offset * row)
            return data.reshape(len(image), *shape), labels
        offsets = np.frombuffer(image.buffers()[1], np.int32, len(image) + 1, image.offset * 4)
        return (offsets, np.frombuffer(image.buffers()[2], np.uint8)), labels

    @staticmethod
    def _tensor_view(chunk: tuple) -> tuple:
        """torch tensors over the mapped pages (read-only memory: only ever read from)."""
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "The given NumPy array is not writable"
            return torch.from_numpy(chunk[0]), torch.from_numpy(chunk[1])

    def __getitem__(self, i: int):
        images, labels = self.__getitems__([i])
        return images[0], labels[0]

    def __getitems__(self, indices: list[int]):
        starts, chunks = self._open()
        idx = np.asarray(indices, dtype=np.int64)
        which = np.searchsorted(starts, idx, side="right") - 1
        labels = np.empty(len(idx), np.int64)
        if self.device_crop:
            g = self.manifest["geometry"]
            out = np.empty((len(idx), g["height"], g["width"], g["channels"]), np.uint8)
        else:
            out = np.empty((len(idx), self.image_size, self.image_size, 3), np.uint8)
        if len(chunks) == 1 and self.device_crop:  # one shard: the in-memory path's own gather
            images, chunk_labels = self._tensor_view(chunks[0])
            picked = torch.from_numpy(idx)
            return images.index_select(0, picked), chunk_labels.index_select(0, picked).long()
        for c in np.unique(which):
            mask = which == c
            local = idx[mask] - starts[c]
            images, chunk_labels = chunks[c]
            labels[mask] = chunk_labels[local]
            if self.device_crop:
                out[mask] = images[local]
            else:
                out[np.flatnonzero(mask)] = [self._resized(images, j) for j in local]
        return torch.from_numpy(out), torch.from_numpy(labels)

    def _resized(self, images: Any, j: int) -> np.ndarray:
        """One image decoded (or taken raw) and brought to image_size x image_size, uint8 HWC."""
        from PIL import Image

        size = self.image_size
        if self.raw:
            im = Image.fromarray(images[j])
        else:
            offsets, data = images
            im = Image.open(io.BytesIO(data[offsets[j]:offsets[j + 1]].tobytes()))
            # JPEG: decode at the smallest 1/2^k scale that still leaves a crop of >= size pixels
            im.draft("RGB", (size * 4, size * 4) if self.train else (size, size))
            im = im.convert("RGB")
        return np.asarray(self.transform(im))

    @property
    def transform(self):
        if getattr(self, "_transform", None) is None:
            from torchvision import transforms as T

            s = self.image_size
            self._transform = (T.Compose([T.RandomResizedCrop(s), T.RandomHorizontalFlip()])
                               if self.train else
                               T.Compose([T.Resize(round(s / EVAL_RESIZE)), T.CenterCrop(s)]))
        return self._transform


def describe(manifest: dict) -> str:
    g = manifest["geometry"]
    layout = (f"raw {g['height']}x{g['width']} uint8" if g["layout"] == "raw"
              else "encoded (sizes differ)")
    counts = ", ".join(f"{s} {manifest['splits'][s]['rows']} images in "
                       f"{len(manifest['splits'][s]['files'])} file(s)" for s in SPLITS)
    size = sum(e["bytes"] for s in SPLITS for e in manifest["splits"][s]["files"]) / 2**20
    return f"{counts}, {len(manifest['classes'])} classes, {layout}, {size:.1f} MiB"


# --- python -m ray_job prepare-data ----------------------------------------------------------------

PREPARE_DESCRIPTION = """\
Turn CIFAR-10 or a folder of images into a prepared dataset (Arrow IPC shards + manifest.json)
that `train --data prepared --data-dir OUT` memory-maps. Without --from: download CIFAR-10's
cifar-10-batches-py into --data-dir (for `train --data cifar10`).

examples:
  python -m ray_job prepare-data --data-dir ./data                      # download CIFAR-10
  python -m ray_job prepare-data --from cifar10 --src ./data --out ./cifar10-prepared
  python -m ray_job prepare-data --from imagefolder --src ./my_images --out ./prepared
"""


def main(argv: list[str]) -> int:
    import argparse

    from .cli import ArgumentParser, Formatter
    from .config import resolve_path
    from .data import ensure_cifar10

    parser = ArgumentParser(prog="python -m ray_job prepare-data", formatter_class=Formatter,
                            description=PREPARE_DESCRIPTION)
    parser.add_argument("--from", dest="source", choices=("cifar10", "imagefolder"), default=None,
                        help="what to convert: cifar10 (cifar-10-batches-py under --src, downloaded "
                        "if missing) or imagefolder (SRC/train/<class>/*, SRC/test/<class>/*)")
    parser.add_argument("--src", default=None, help="the source folder (with --from)")
    parser.add_argument("--out", default=None, help="the prepared folder to write (with --from)")
    parser.add_argument("--layout", choices=("auto", "raw", "encoded"), default="auto",
                        help="imagefolder: raw uint8 when all images share a size (auto), or keep "
                        "each file's encoded bytes (encoded: smaller, decoded in the loader)")
    parser.add_argument("--shard-mb", type=float, default=DEFAULT_SHARD_MB,
                        help="size of each Arrow file in MiB")
    parser.add_argument("--data-dir", default="./data",
                        help="without --from: where CIFAR-10 is downloaded")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="progress bar while converting")
    ns = parser.parse_args(argv)
    if ns.source is None:
        if ns.src or ns.out:
            raise UsageError("--src and --out go with --from cifar10|imagefolder")
        ensure_cifar10(resolve_path(ns.data_dir), download=True)
        print(f"CIFAR-10 is ready under {ns.data_dir}")
        return 0
    if not ns.src or not ns.out:
        raise UsageError(f"--from {ns.source} needs --src DIR and --out DIR")
    if ns.shard_mb <= 0:
        raise UsageError("--shard-mb must be positive")
    src, out = resolve_path(ns.src), resolve_path(ns.out)
    if not os.path.isdir(src):
        raise DataError(f"--src {ns.src} is not a folder")
    if os.path.abspath(out) == os.path.abspath(src) or os.path.abspath(src).startswith(out + os.sep):
        raise DataError("--out must not be --src or a folder above it")
    if ns.source == "cifar10":
        ensure_cifar10(src, download=True)
        source = cifar10_source(src)
    else:
        source = imagefolder_source(src, ns.layout)
    started = time.perf_counter()
    manifest, written = ensure_prepared(source, out, ns.shard_mb, ns.progress)
    if written:
        print(f"wrote {ns.out} from {ns.src} in {time.perf_counter() - started:.1f} s: "
              f"{describe(manifest)}")
    else:
        print(f"{ns.out} is already prepared from {ns.src} (the manifest matches the source); "
              f"nothing to do: {describe(manifest)}")
    print(f"train with: python -m ray_job train --data prepared --data-dir {ns.out}")
    return 0
