"""A run's two datasets, by --data: in-memory splits (synthetic, cifar10) or memory-mapped prepared
files (prepared, imagefolder), and the driver's check that they can be read before any worker starts."""

from __future__ import annotations

import os
from dataclasses import dataclass

from torch.utils.data import Dataset

from ..config import TrainConfig
from ..core.paths import is_uri
from .arrays import ArrayDataset, Split, TorchvisionDataset
from .cifar10 import ensure_cifar10, load_cifar10
from .errors import DataError
from .prepared.format import prepare_hint
from .prepared.read import PreparedImages, remote_manifest, stage
from .prepared.sources import imagefolder_source
from .prepared.write import ensure_prepared
from .synthetic import make_synthetic

IMAGEFOLDER_CACHE = ".ray_job_prepared"


def load_splits(cfg: TrainConfig) -> tuple[Split, Split]:
    """Both splits in memory (synthetic, cifar10; prepared raw data copied in, for the raw-DDP baseline)."""
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
    """The local prepared folder of --data prepared (staged first for a URI), or imagefolder's
    DIR/.ray_job_prepared: DIR/{train,test}/<class>/* prepared once (file lock, then the manifest's
    fingerprint says it matches the images), so imagefolder data takes the prepared path."""
    if cfg.data != "imagefolder":
        return stage(cfg.data_dir) if is_uri(cfg.data_dir) else cfg.data_dir
    out = os.path.join(cfg.data_dir, IMAGEFOLDER_CACHE)
    ensure_prepared(imagefolder_source(cfg.data_dir), out, progress=progress)
    return out


def check_data(cfg: TrainConfig) -> int:
    """Driver-side check that fails in seconds instead of inside every worker (and prepares an
    image folder once, with a progress bar, before any worker starts); the number of classes."""
    if cfg.data == "synthetic":
        return 10
    if cfg.data == "prepared" and is_uri(cfg.data_dir):
        return len(remote_manifest(cfg.data_dir)["classes"])  # staged by the workers, once per node
    if not os.path.exists(cfg.data_dir) and cfg.data != "cifar10":
        raise DataError(f"--data-dir {cfg.data_dir} does not exist"
                        + (f". {prepare_hint(cfg.data_dir)}" if cfg.data == "prepared" else ""))
    if os.path.exists(cfg.data_dir) and not os.path.isdir(cfg.data_dir):
        raise DataError(f"--data-dir {cfg.data_dir} is a file, not a folder")
    if os.path.exists(cfg.data_dir) and not os.access(cfg.data_dir, os.R_OK | os.X_OK):
        raise DataError(f"--data-dir {cfg.data_dir} is not readable by this user")
    if cfg.data == "cifar10":
        ensure_cifar10(cfg.data_dir, cfg.download)
        load_cifar10(cfg.data_dir, False)  # the small file: proves the format is readable
        return 10
    folder = prepared_folder(cfg, progress=True)
    test = PreparedImages(folder, "test", cfg.image_size, False)
    test[0]  # proves the files are readable
    return len(test.classes)


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
        if fast:
            return Datasets(ArrayDataset(train), ArrayDataset(test), train.classes, "crop", False, "in-memory uint8")
        return Datasets(TorchvisionDataset(train, True), TorchvisionDataset(test, False), train.classes, "none", True,
                        "torchvision per-sample")
    folder = prepared_folder(cfg)
    train_ds = PreparedImages(folder, "train", cfg.image_size, True)
    test_ds = PreparedImages(folder, "test", cfg.image_size, False, train_ds.manifest)
    if train_ds.device_crop and fast:
        return Datasets(train_ds, test_ds, train_ds.classes, "crop", False,
                        "prepared raw uint8, memory-mapped")
    train_ds.device_crop = test_ds.device_crop = False  # --loader torchvision: resize on the CPU
    return Datasets(train_ds, test_ds, train_ds.classes, "normalise", True,
                    f"prepared, decoded and resized to {cfg.image_size} px in the loader")
