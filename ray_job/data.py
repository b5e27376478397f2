"""Datasets and the two input pipelines.

Fast path (default): a split is held once as a uint8 array (N, H, W, C). `ArrayDataset.__getitems__`
fetches a whole batch with one indexing operation, the DataLoader pins it, Ray copies it to the device
without blocking, and `DeviceAugment` does random-crop / flip / normalise there. CIFAR-10 is 150 MB
this way, never a float copy.

Classic path (`--loader torchvision`): PIL transforms per sample in DataLoader workers, as the seed did.
Both keep `prepare_data_loader`'s `DistributedSampler` sharding.
"""

from __future__ import annotations

import logging
import os
import pickle
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from .config import TrainConfig, is_uri
from .prepared import DataError, PreparedImages  # noqa: F401  (DataError: this module's errors)

log = logging.getLogger(__name__)

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer",
                   "dog", "frog", "horse", "ship", "truck")
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]
CIFAR10_TEST_FILES = ["test_batch"]
PAD = 4  # random-crop padding, as in the standard CIFAR recipe


@dataclass
class Split:
    """One split held in memory: uint8 images (N, H, W, C) and int64 labels (N,)."""

    images: torch.Tensor
    labels: torch.Tensor
    classes: tuple

    def __len__(self) -> int:
        return len(self.labels)


# --- CIFAR-10 in torchvision's on-disk format -------------------------------------------------

def cifar10_present(data_dir: str) -> bool:
    folder = os.path.join(data_dir, CIFAR10_FOLDER)
    return all(os.path.isfile(os.path.join(folder, f))
               for f in CIFAR10_TRAIN_FILES + CIFAR10_TEST_FILES)


def stage_hint(data_dir: str) -> str:
    return (f"HINT: on a machine with internet run `python -m ray_job prepare-data --data-dir "
            f"{data_dir}` and copy the folder to where every node can read it, or use --data synthetic")


def ensure_cifar10(data_dir: str, download: bool) -> None:
    """Makes sure cifar-10-batches-py is under data_dir, downloading it at most once per node."""
    if os.path.exists(data_dir) and not os.path.isdir(data_dir):
        raise DataError(f"--data-dir {data_dir} is a file, not a folder. {stage_hint(data_dir)}")
    if cifar10_present(data_dir):
        return
    if not download:
        raise DataError(f"no CIFAR-10 ({CIFAR10_FOLDER}/) under --data-dir {data_dir} and "
                        f"--no-download is set. {stage_hint(data_dir)}")
    from filelock import FileLock
    from torchvision.datasets.utils import download_and_extract_archive

    try:
        os.makedirs(data_dir, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create --data-dir {data_dir}: {e.strerror}") from None
    # One download per node: the first worker holds the lock, the others find the files after it.
    with FileLock(os.path.join(data_dir, ".cifar10.lock")):
        if cifar10_present(data_dir):
            return
        try:
            download_and_extract_archive(CIFAR10_URL, download_root=data_dir, md5=CIFAR10_MD5)
        except Exception as e:  # URLError, timeouts, checksum: all mean "stage it by hand"
            raise DataError(f"could not download CIFAR-10 into {data_dir} ({type(e).__name__}: "
                            f"{str(e)[:120]}). {stage_hint(data_dir)}") from None


def load_cifar10(data_dir: str, train: bool) -> Split:
    folder = os.path.join(data_dir, CIFAR10_FOLDER)
    images, labels = [], []
    for name in CIFAR10_TRAIN_FILES if train else CIFAR10_TEST_FILES:
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as f:
                batch = pickle.load(f, encoding="latin1")
            images.append(np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            labels.extend(batch["labels"])
        except (OSError, pickle.UnpicklingError, KeyError, ValueError, EOFError) as e:
            raise DataError(f"cannot read CIFAR-10 file {path} ({type(e).__name__}); delete "
                            f"{folder} to download it again. {stage_hint(data_dir)}") from None
    array = np.ascontiguousarray(np.concatenate(images).transpose(0, 2, 3, 1))
    return Split(torch.from_numpy(array), torch.tensor(labels, dtype=torch.int64), CIFAR10_CLASSES)


def write_cifar10(data_dir: str, train: Split, test: Split, per_file: int = 10000) -> None:
    """Writes splits in the exact cifar-10-batches-py format (used by tests and prepare-data)."""
    folder = os.path.join(data_dir, CIFAR10_FOLDER)
    os.makedirs(folder, exist_ok=True)
    chunks = np.array_split(np.arange(len(train)), len(CIFAR10_TRAIN_FILES))
    for name, split, idx in ([(n, train, c) for n, c in zip(CIFAR10_TRAIN_FILES, chunks)]
                             + [("test_batch", test, np.arange(len(test)))]):
        data = split.images[idx].numpy().transpose(0, 3, 1, 2).reshape(len(idx), -1)
        batch = {"batch_label": name, "labels": split.labels[idx].tolist(), "data": data,
                 "filenames": [f"{i}.png" for i in idx]}
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(batch, f)
    with open(os.path.join(folder, "batches.meta"), "wb") as f:
        pickle.dump({"label_names": list(CIFAR10_CLASSES), "num_vis": 3072}, f)


# --- ImageFolder: prepared once into the same format as --data prepared -------------------------

IMAGEFOLDER_CACHE = ".ray_job_prepared"


def imagefolder_cache(data_dir: str, progress: bool = False) -> str:
    """DIR/.ray_job_prepared: DIR/{train,test}/<class>/* prepared once (file lock, then the manifest's
    fingerprint says it matches the images), so imagefolder data takes the prepared path."""
    from . import prepared

    out = os.path.join(data_dir, IMAGEFOLDER_CACHE)
    prepared.ensure_prepared(prepared.imagefolder_source(data_dir), out, progress=progress)
    return out


# --- synthetic -------------------------------------------------------------------------------

def make_synthetic(n: int, seed: int, train: bool, num_classes: int = 10) -> Split:
    """A learnable CIFAR-shaped set: each class has its own colour and stripe pattern, plus noise.

    Colour survives crops and flips, so a model that learns anything beats 10%; the noise keeps it
    from being trivial. Train and test are different draws of the same classes.
    """
    g = torch.Generator().manual_seed(seed)
    palette = torch.rand(num_classes, 3, generator=g) * 160 + 48          # class colours
    freq = torch.arange(num_classes, dtype=torch.float32) % 5 + 1          # class stripes
    g.manual_seed(seed * 2 + (0 if train else 1) + 1)
    labels = torch.randint(0, num_classes, (n,), generator=g)
    xs = torch.arange(32, dtype=torch.float32)
    stripes = torch.sin(xs[None, :] * freq[:, None] * np.pi / 16)          # (C, 32)
    base = palette[labels][:, None, None, :] + 24 * stripes[labels][:, None, :, None]
    images = base + torch.randn(n, 32, 32, 3, generator=g) * 40
    return Split(images.clamp(0, 255).to(torch.uint8), labels, tuple(f"class{i}" for i in range(num_classes)))


def load_splits(cfg: TrainConfig) -> tuple[Split, Split]:
    """Both splits in memory (synthetic, cifar10; prepared raw data copied in, for the seed's peer)."""
    if cfg.data == "synthetic":
        return (make_synthetic(cfg.synthetic_train_size, cfg.seed, True),
                make_synthetic(cfg.synthetic_test_size, cfg.seed, False))
    if cfg.data == "cifar10":
        ensure_cifar10(cfg.data_dir, cfg.download)
        return load_cifar10(cfg.data_dir, True), load_cifar10(cfg.data_dir, False)
    folder = prepared_folder(cfg)
    splits = []
    for split in ("train", "test"):
        ds = PreparedImages(folder, split, cfg.image_size, split == "train")
        if not ds.raw:
            raise DataError(f"images under {cfg.data_dir} differ in size: this path holds them in "
                            f"memory at one size; train with --data prepared --image-size S instead")
        ds.device_crop = True  # as stored
        images, labels = ds.__getitems__(list(range(len(ds))))
        splits.append(Split(images, labels, ds.classes))
    return splits[0], splits[1]


def prepared_folder(cfg: TrainConfig, progress: bool = False) -> str:
    """The local prepared folder of --data prepared / imagefolder (staged first for a URI)."""
    from . import prepared

    if cfg.data == "imagefolder":
        return imagefolder_cache(cfg.data_dir, progress)
    return prepared.local_folder(cfg.data_dir)


def check_data(cfg: TrainConfig) -> None:
    """Driver-side check that fails in seconds instead of inside every worker (and prepares an
    image folder once, with a progress bar, before any worker starts)."""
    from . import prepared

    if cfg.data == "synthetic":
        return
    if cfg.data == "prepared" and is_uri(cfg.data_dir):
        prepared.remote_manifest(cfg.data_dir)  # staged by the workers, once per node
        return
    if not os.path.exists(cfg.data_dir) and cfg.data != "cifar10":
        raise DataError(f"--data-dir {cfg.data_dir} does not exist"
                        + (f". {prepared.prepare_hint(cfg.data_dir)}" if cfg.data == "prepared" else ""))
    if os.path.exists(cfg.data_dir) and not os.path.isdir(cfg.data_dir):
        raise DataError(f"--data-dir {cfg.data_dir} is a file, not a folder")
    if os.path.exists(cfg.data_dir) and not os.access(cfg.data_dir, os.R_OK | os.X_OK):
        raise DataError(f"--data-dir {cfg.data_dir} is not readable by this user")
    if cfg.data == "cifar10":
        ensure_cifar10(cfg.data_dir, cfg.download)
        load_cifar10(cfg.data_dir, False)  # the small file: proves the format is readable
        return
    folder = prepared_folder(cfg, progress=True)
    PreparedImages(folder, "test", cfg.image_size, False)[0]  # proves the files are readable


@dataclass
class Datasets:
    """The two datasets of a run and what the device still has to do with their batches."""

    train: Dataset
    test: Dataset
    classes: tuple
    device_augment: str   # "crop" (pad-4 crop, flip, normalise), "normalise", or "none"
    cpu_work: bool        # per-sample work on the CPU: DataLoader workers by default
    what: str             # for the run log

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def load_datasets(cfg: TrainConfig) -> Datasets:
    """In-memory splits for synthetic / cifar10; memory-mapped prepared files for the others."""
    fast = cfg.loader != "torchvision"
    if cfg.data in ("synthetic", "cifar10"):
        train, test = load_splits(cfg)
        return Datasets(build_dataset(train, True, fast), build_dataset(test, False, fast),
                        train.classes, "crop" if fast else "none", not fast,
                        "in-memory uint8" if fast else "torchvision per-sample")
    folder = prepared_folder(cfg)
    train_ds = PreparedImages(folder, "train", cfg.image_size, True)
    test_ds = PreparedImages(folder, "test", cfg.image_size, False, train_ds.manifest)
    if train_ds.device_crop and fast:
        return Datasets(train_ds, test_ds, train_ds.classes, "crop", False,
                        "prepared raw uint8, memory-mapped")
    train_ds.device_crop = test_ds.device_crop = False  # --loader torchvision: resize on the CPU
    return Datasets(train_ds, test_ds, train_ds.classes, "normalise", True,
                    f"prepared, decoded and resized to {cfg.image_size} px in the loader")


# --- datasets for the DataLoader -------------------------------------------------------------

def return_large_allocations() -> None:
    """Makes glibc hand every allocation of 1 MiB or more straight back to the system when freed.

    With DataLoader worker processes, the batches that arrive in shared memory and the float
    copies made of them per step otherwise leave the training process's heap growing (glibc's
    adaptive mmap threshold moves up to 32 MiB, and freed blocks stay in its arenas): measured here
    (bench --data-path, JPEG -> 64 px, 2 loader workers) RssAnon grew by ~45 KiB per image read,
    288 -> 793 MiB after 12,000 images; with this, 290 MiB. No effect where glibc is not the libc."""
    import ctypes
    import ctypes.util

    M_MMAP_THRESHOLD = -3
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        pass


def _identity(batch):
    return batch


class ArrayDataset(Dataset):
    """uint8 images fetched a batch at a time; augmentation happens later, on the device."""

    collate_fn = staticmethod(_identity)

    def __init__(self, split: Split):
        self.images, self.labels = split.images, split.labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i], self.labels[i]

    def __getitems__(self, indices: list[int]):
        idx = torch.as_tensor(indices, dtype=torch.int64)
        return self.images.index_select(0, idx), self.labels.index_select(0, idx)


class TorchvisionDataset(Dataset):
    """The classic pipeline: one PIL image and one transform chain per sample."""

    collate_fn = None  # the DataLoader's default collation

    def __init__(self, split: Split, train: bool):
        from torchvision import transforms as T

        steps = [T.RandomCrop(32, padding=PAD), T.RandomHorizontalFlip()] if train else []
        self.transform = T.Compose(steps + [T.ToTensor(), T.Normalize(CIFAR10_MEAN, CIFAR10_STD)])
        self.images, self.labels = split.images.numpy(), split.labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        from PIL import Image

        return self.transform(Image.fromarray(self.images[i])), self.labels[i]


class DeviceAugment:
    """Random crop (zero padding 4) + horizontal flip + normalisation of a uint8 NHWC batch.

    The same distribution as torchvision's RandomCrop(32, padding=4) and RandomHorizontalFlip():
    offsets uniform in [0, 2*PAD], flip with probability 1/2, padding is black before normalising.
    """

    def __init__(self, device: torch.device, channels_last: bool, crop: bool = True):
        self.crop = crop  # False: the loader already cropped and flipped (resized images)
        self.mean = torch.tensor(CIFAR10_MEAN, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(CIFAR10_STD, device=device).view(1, 3, 1, 1) * 255
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __call__(self, images: torch.Tensor, train: bool) -> torch.Tensor:
        x = images.permute(0, 3, 1, 2)  # NHWC uint8 -> NCHW view, no copy
        if train and self.crop:
            x = self.crop_flip(x)
        x = (x.float() - self.mean) / self.std
        return x.contiguous(memory_format=self.memory_format)

    @staticmethod
    def crop_flip(x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        padded = torch.nn.functional.pad(x, (PAD, PAD, PAD, PAD))
        dy = torch.randint(0, 2 * PAD + 1, (n, 1), device=x.device)
        dx = torch.randint(0, 2 * PAD + 1, (n, 1), device=x.device)
        flip = torch.rand(n, 1, device=x.device) < 0.5
        cols = torch.arange(w, device=x.device).expand(n, w)
        cols = torch.where(flip, w - 1 - cols, cols) + dx          # flip = read columns backwards
        rows = torch.arange(h, device=x.device).expand(n, h) + dy
        batch = torch.arange(n, device=x.device)[:, None, None]
        out = padded.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]]  # (N, H, W, C)
        return out.permute(0, 3, 1, 2)


def build_dataset(split: Split, train: bool, fast: bool) -> Dataset:
    return ArrayDataset(split) if fast else TorchvisionDataset(split, train)
