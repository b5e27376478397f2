import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import transforms as T

from ray_job.config import TrainConfig
from ray_job.data.arrays import ArrayDataset, Split
from ray_job.data.augment import CIFAR10_MEAN, CIFAR10_STD, DeviceAugment
from ray_job.data.cifar10 import ensure_cifar10, load_cifar10, write_cifar10
from ray_job.data.datasets import load_splits
from ray_job.data.errors import DataError
from ray_job.data.synthetic import make_synthetic


def test_cifar10_format_round_trips(tmp_path):
    train, test = make_synthetic(50, 1, True), make_synthetic(20, 1, False)
    write_cifar10(str(tmp_path), train, test)
    loaded = load_cifar10(str(tmp_path), True)
    assert torch.equal(loaded.images, train.images) and torch.equal(loaded.labels, train.labels)
    assert torch.equal(load_cifar10(str(tmp_path), False).images, test.images)
    assert loaded.images.dtype == torch.uint8 and loaded.images.shape == (50, 32, 32, 3)


def test_missing_cifar_without_download_says_how_to_stage(tmp_path):
    with pytest.raises(DataError, match="prepare-data --data-dir"):
        ensure_cifar10(str(tmp_path / "nothing"), download=False)


def test_corrupt_cifar_file_is_a_clear_error(tmp_path):
    write_cifar10(str(tmp_path), make_synthetic(20, 1, True), make_synthetic(10, 1, False))
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(DataError, match="data_batch_3"):
        load_cifar10(str(tmp_path), True)


def test_synthetic_is_deterministic_and_classes_differ():
    a, b = make_synthetic(200, 3, True), make_synthetic(200, 3, True)
    assert torch.equal(a.images, b.images)
    assert not torch.equal(a.images, make_synthetic(200, 3, False).images)
    means = torch.stack([a.images[a.labels == c].float().mean((0, 1, 2)) for c in range(10)])
    assert torch.cdist(means, means).fill_diagonal_(1e9).min() > 10  # classes are distinguishable


def test_imagefolder_is_decoded_once_to_uint8(tmp_path):
    split = make_synthetic(12, 0, True)
    for part in ("train", "test"):
        for i, (img, label) in enumerate(zip(split.images, split.labels)):
            d = tmp_path / part / f"c{int(label)}"
            d.mkdir(parents=True, exist_ok=True)
            Image.fromarray(img.numpy()).save(d / f"{i}.png")
    loaded, _ = load_splits(TrainConfig(data="imagefolder", data_dir=str(tmp_path)))
    assert loaded.images.dtype == torch.uint8 and len(loaded) == 12
    assert sorted(map(tuple, loaded.images.reshape(12, -1).tolist())) == \
        sorted(map(tuple, split.images.reshape(12, -1).tolist()))  # PNG is lossless
    assert (tmp_path / ".ray_job_prepared" / "manifest.json").exists()  # prepared once, raw uint8


def _coded_image() -> np.ndarray:
    """Each pixel says where it came from: R = 8*row+4, G = 8*col+4, B = 200 (padding is 0)."""
    rows, cols = np.meshgrid(np.arange(32), np.arange(32), indexing="ij")
    return np.stack([8 * rows + 4, 8 * cols + 4, np.full((32, 32), 200)], -1).astype(np.uint8)


def _decode(out: np.ndarray) -> tuple[int, int, int]:
    """(dy, dx, flipped) of a crop of the coded image with padding 4, from an HWC uint8 output."""
    i, j = map(int, np.argwhere(out[:, :, 2] == 200)[0])
    src_row, src_col = (int(out[i, j, 0]) - 4) // 8, (int(out[i, j, 1]) - 4) // 8
    flipped = int(out[i, j + 1, 1] < out[i, j, 1]) if j + 1 < 32 and out[i, j + 1, 2] == 200 else \
        int(out[i, j - 1, 1] > out[i, j, 1])
    dx = src_col + 4 - (31 - j if flipped else j)
    return src_row + 4 - i, dx, flipped


def test_device_augmentation_matches_torchvision_distribution():
    n = 3000
    image = _coded_image()
    torch.manual_seed(0)
    fast = DeviceAugment.crop_flip(torch.from_numpy(image)[None].expand(n, -1, -1, -1).permute(0, 3, 1, 2))
    fast = [_decode(x.permute(1, 2, 0).numpy()) for x in fast]
    tv = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()])
    slow = [_decode(np.asarray(tv(Image.fromarray(image)))) for _ in range(n)]
    for k, bins in ((0, 9), (1, 9), (2, 2)):
        expected = n / bins
        for sample in (fast, slow):
            counts = np.bincount([s[k] for s in sample], minlength=bins)
            assert len(counts) == bins  # offsets stay in [0, 8]
            chi2 = ((counts - expected) ** 2 / expected).sum()
            assert chi2 < 30, (k, counts)  # uniform: p < 0.001 would need chi2 > 26.1 (8 dof)


def test_device_normalisation_equals_torchvision():
    split = make_synthetic(8, 0, False)
    out = DeviceAugment(torch.device("cpu"), channels_last=False)(split.images, train=False)
    ref = torch.stack([T.Normalize(CIFAR10_MEAN, CIFAR10_STD)(T.ToTensor()(Image.fromarray(x.numpy())))
                       for x in split.images])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_batch_fetch_shards_exactly_like_distributed_sampler():
    split = Split(torch.zeros(103, 32, 32, 3, dtype=torch.uint8), torch.arange(103), ())
    ds = ArrayDataset(split)
    orders = {}
    for epoch in (0, 1):
        for rank in (0, 1):
            sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            loader = DataLoader(ds, batch_size=8, sampler=sampler, collate_fn=ds.collate_fn)
            seen = torch.cat([labels for _, labels in loader]).tolist()
            assert seen == list(sampler)  # one indexing op per batch, same indices, same order
            orders[epoch, rank] = seen
    assert orders[0, 0] != orders[1, 0]  # set_epoch reshuffles
    assert set(orders[0, 0]) | set(orders[0, 1]) == set(range(103))
