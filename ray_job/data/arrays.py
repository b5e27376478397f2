"""Datasets for the DataLoader over splits held in memory.

Fast path (default): a split is held once as a uint8 array (N, H, W, C). `ArrayDataset.__getitems__`
fetches a whole batch with one indexing operation, the DataLoader pins it, Ray copies it to the device
without blocking, and `DeviceAugment` does random-crop / flip / normalise there. CIFAR-10 is 150 MB
this way, never a float copy.

Classic path (`--loader torchvision`): PIL transforms per sample in DataLoader workers, the raw-DDP
baseline's pipeline. Both keep `prepare_data_loader`'s `DistributedSampler` sharding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from .augment import CIFAR10_MEAN, CIFAR10_STD, PAD


@dataclass
class Split:
    """One split held in memory: uint8 images (N, H, W, C) and int64 labels (N,)."""

    images: torch.Tensor
    labels: torch.Tensor
    classes: tuple

    def __len__(self) -> int:
        return len(self.labels)


def identity(batch):  # collate_fn of the datasets whose __getitems__ returns the whole batch
    return batch


class ArrayDataset(Dataset):
    """uint8 images fetched a batch at a time; augmentation happens later, on the device."""

    collate_fn = staticmethod(identity)

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
