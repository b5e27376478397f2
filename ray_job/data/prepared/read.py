"""PreparedImages: one split of a prepared folder, read through memory maps, a batch at a time; a
prepared dataset on object storage (`--data-dir s3://...`) is staged first, once per node, into a local
cache (a file lock, each file's SHA-256 checked, the local manifest written last) and reused."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import Dataset

from ... import storage
from ..arrays import identity
from ..errors import DataError
from ..views import decode, test_view
from .format import (FORMAT, MANIFEST, SPLITS, files_complete, prepare_hint, read_manifest,
                     write_json_atomic)


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


class PreparedImages(Dataset):
    """The files are opened lazily in each process (DataLoader workers included), so what is pickled
    is only the folder and the settings. `__getitems__` returns uint8 (B, S, S, 3) and int64 labels."""

    collate_fn = staticmethod(identity)

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

    def __getitem__(self, i: int):
        images, labels = self.__getitems__([i])
        return images[0], labels[0]

    def __getitems__(self, indices: list[int]):
        starts, chunks = self._open()
        idx = np.asarray(indices, dtype=np.int64)
        if len(chunks) == 1 and self.device_crop:  # one shard: the in-memory path's own gather
            with warnings.catch_warnings():  # tensors over the mapped pages, only ever read from
                warnings.simplefilter("ignore", UserWarning)  # "The given NumPy array is not writable"
                images, chunk_labels = (torch.from_numpy(a) for a in chunks[0])
            picked = torch.from_numpy(idx)
            return images.index_select(0, picked), chunk_labels.index_select(0, picked).long()
        which = np.searchsorted(starts, idx, side="right") - 1
        labels = np.empty(len(idx), np.int64)
        g = self.manifest["geometry"]
        size = (g["height"], g["width"], g["channels"]) if self.device_crop else (self.image_size, self.image_size, 3)
        out = np.empty((len(idx), *size), np.uint8)
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
        """One image decoded (or taken raw) and brought to image_size x image_size, uint8 HWC: a
        random resized crop and flip for training, the test view (views.test_view) otherwise."""
        from PIL import Image

        if self.raw:
            im = Image.fromarray(images[j])
        else:
            offsets, data = images
            im = decode(data[offsets[j]:offsets[j + 1]].tobytes(), self.image_size, self.train)
        return np.asarray(self.train_transform(im)) if self.train else test_view(im, self.image_size)

    @property
    def train_transform(self):
        if getattr(self, "_transform", None) is None:
            from torchvision import transforms as T

            self._transform = T.Compose([T.RandomResizedCrop(self.image_size), T.RandomHorizontalFlip()])
        return self._transform


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
