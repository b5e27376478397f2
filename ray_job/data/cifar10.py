"""CIFAR-10 in torchvision's on-disk format (cifar-10-batches-py): present, downloaded once per
node under a file lock, read into uint8 arrays, and written (tests, prepare-data)."""

from __future__ import annotations

import os
import pickle

import numpy as np
import torch

from .arrays import Split
from .errors import DataError

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer",
                   "dog", "frog", "horse", "ship", "truck")


CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"


CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"


CIFAR10_FOLDER = "cifar-10-batches-py"


CIFAR10_TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]


CIFAR10_TEST_FILES = ["test_batch"]


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


def write_cifar10(data_dir: str, train: Split, test: Split) -> None:
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
