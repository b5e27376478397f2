"""The prepared format (ray_job/data/prepared/): writer, memory-mapped reader, idempotence, atomicity,
bad input, the image-folder cache and staging from S3. Small generated data only."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from ray_job.config import TrainConfig
from ray_job.data import prepared
from ray_job.data.cifar10 import load_cifar10, write_cifar10
from ray_job.data.datasets import check_data, load_datasets
from ray_job.data.errors import DataError
from ray_job.data.prepared import PreparedImages
from ray_job.data.synthetic import make_synthetic

from conftest import jpeg_folder


@pytest.fixture
def cifar_src(tmp_path):
    src = tmp_path / "cifar"
    write_cifar10(str(src), make_synthetic(300, 0, True), make_synthetic(50, 0, False))
    return src


def prepare(kind: str, src, out, shard_mb: float = prepared.DEFAULT_SHARD_MB):
    source = prepared.cifar10_source(str(src)) if kind == "cifar10" else prepared.imagefolder_source(str(src))
    return prepared.ensure_prepared(source, str(out), shard_mb, progress=False)


def test_cifar10_round_trips_raw_across_shards_and_batches(cifar_src, tmp_path, monkeypatch):
    monkeypatch.setattr(prepared.write, "BATCH_ROWS", 64)  # several record batches and files
    manifest, written = prepare("cifar10", cifar_src, tmp_path / "p", shard_mb=0.3)
    assert written and manifest["geometry"] == dict(layout="raw", height=32, width=32, channels=3)
    assert len(manifest["splits"]["train"]["files"]) > 1 and manifest["splits"]["train"]["rows"] == 300
    for entry in manifest["splits"]["train"]["files"]:
        path = tmp_path / "p" / entry["name"]
        assert path.stat().st_size == entry["bytes"] and prepared.sha256(str(path)) == entry["sha256"]
    meta = json.loads(__import__("pyarrow").ipc.open_file(str(tmp_path / "p" / "train-00000.arrow"))
                      .schema.metadata[prepared.META_KEY])
    assert meta["classes"][0] == "airplane" and meta["geometry"]["layout"] == "raw"
    ds = PreparedImages(str(tmp_path / "p"), "train", 32, True)
    ref = load_cifar10(str(cifar_src), True)
    idx = [299, 0, 63, 64, 65, 200, 5, 5]
    images, labels = ds.__getitems__(idx)
    assert ds.device_crop and images.dtype == torch.uint8 and labels.dtype == torch.int64
    assert torch.equal(images, ref.images[idx]) and torch.equal(labels, ref.labels[idx])
    assert torch.equal(ds[7][0], ref.images[7])


def test_batches_shard_exactly_like_distributed_sampler(cifar_src, tmp_path):
    prepare("cifar10", cifar_src, tmp_path / "p")
    ds = PreparedImages(str(tmp_path / "p"), "train", 32, True)
    ref = load_cifar10(str(cifar_src), True).labels
    seen = []
    for rank in (0, 1):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=0)
        sampler.set_epoch(3)
        loader = DataLoader(ds, batch_size=16, sampler=sampler, collate_fn=ds.collate_fn, num_workers=1)
        labels = torch.cat([y for _, y in loader])
        assert torch.equal(labels, ref[list(sampler)])  # same indices, same order, via a worker process
        seen += list(sampler)
    assert set(seen) == set(range(300))


def test_variable_sizes_are_encoded_and_resized(tmp_path):
    jpeg_folder(tmp_path / "imgs", 12, 6)
    manifest, _ = prepare("imagefolder", tmp_path / "imgs", tmp_path / "p")
    assert manifest["geometry"] == {"layout": "encoded"} and manifest["classes"] == ["c0", "c1", "c2"]
    for train in (True, False):
        ds = PreparedImages(str(tmp_path / "p"), "train" if train else "test", 24, train)
        images, labels = ds.__getitems__(list(range(len(ds))))
        assert not ds.device_crop and images.shape == (len(ds), 24, 24, 3) and images.dtype == torch.uint8
        means = torch.stack([images[labels == c].float().mean((0, 1, 2)) for c in range(3)])
        assert torch.cdist(means, means).fill_diagonal_(1e9).min() > 10  # the colours survive


def test_same_size_folder_is_raw_and_a_second_prepare_does_nothing(tmp_path):
    jpeg_folder(tmp_path / "imgs", 9, 3, lo=40, hi=40)
    manifest, written = prepare("imagefolder", tmp_path / "imgs", tmp_path / "p")
    assert written and manifest["geometry"]["layout"] == "raw" and manifest["geometry"]["height"] == 40
    before = {f: os.stat(tmp_path / "p" / f).st_mtime_ns for f in os.listdir(tmp_path / "p")}
    again, written = prepare("imagefolder", tmp_path / "imgs", tmp_path / "p")
    assert not written and again == manifest
    assert before == {f: os.stat(tmp_path / "p" / f).st_mtime_ns for f in os.listdir(tmp_path / "p")}
    # a changed source is prepared again
    jpeg_folder(tmp_path / "imgs", 12, 3, lo=40, hi=40, seed=1)
    assert prepare("imagefolder", tmp_path / "imgs", tmp_path / "p")[1]


def test_no_manifest_or_a_short_file_is_not_ready(cifar_src, tmp_path):
    out = tmp_path / "p"
    prepare("cifar10", cifar_src, out)
    with open(out / "train-00000.arrow", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(DataError, match="incomplete.*train-00000.arrow.*prepare-data"):
        prepared.open_manifest(str(out))
    assert prepare("cifar10", cifar_src, out)[1]  # prepared again, not taken as ready
    (out / prepared.MANIFEST).unlink()             # as if the writer died before the manifest
    with pytest.raises(DataError, match="no manifest.json"):
        PreparedImages(str(out), "train", 32, True)
    assert prepare("cifar10", cifar_src, out)[1]


def test_bad_input_is_one_clear_error_and_nothing_is_overwritten(tmp_path):
    jpeg_folder(tmp_path / "imgs", 3, 0)
    with pytest.raises(DataError, match="test/<class>/<images>"):
        prepared.imagefolder_source(str(tmp_path / "imgs"))
    jpeg_folder(tmp_path / "imgs2", 4, 2)
    manifest, _ = prepare("imagefolder", tmp_path / "imgs2", tmp_path / "p")
    good = (tmp_path / "imgs2" / "train" / "c1" / "0001.jpg").read_bytes()
    (tmp_path / "imgs2" / "train" / "c0" / "broken.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(DataError, match="broken.jpg"):
        prepare("imagefolder", tmp_path / "imgs2", tmp_path / "p")
    (tmp_path / "imgs2" / "train" / "c0" / "broken.jpg").write_bytes(good[:len(good) // 2])  # truncated
    with pytest.raises(DataError, match="broken.jpg"):
        prepare("imagefolder", tmp_path / "imgs2", tmp_path / "p")
    assert prepared.open_manifest(str(tmp_path / "p")) == manifest  # the old dataset is untouched
    assert sorted(f for f in os.listdir(tmp_path) if not f.endswith(".lock")) == ["imgs", "imgs2", "p"]
    (tmp_path / "imgs2" / "train" / "c0" / "broken.jpg").unlink()
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match="holds other files"):
        prepare("imagefolder", tmp_path / "imgs2", other)
    assert (other / "notes.txt").read_text() == "keep me"


def test_imagefolder_is_prepared_once_into_its_cache(tmp_path):
    jpeg_folder(tmp_path / "imgs", 9, 6)
    cfg = TrainConfig(data="imagefolder", data_dir=str(tmp_path / "imgs"), image_size=32)
    check_data(cfg)  # the driver prepares it
    cache = tmp_path / "imgs" / ".ray_job_prepared"
    stamp = (cache / prepared.MANIFEST).stat().st_mtime_ns
    data = load_datasets(cfg)  # a worker finds it
    assert (cache / prepared.MANIFEST).stat().st_mtime_ns == stamp
    assert len(data.train) == 9 and data.num_classes == 3 and data.device_augment == "normalise"
    with pytest.raises(DataError, match="no manifest.json.*prepare-data"):
        check_data(TrainConfig(data="prepared", data_dir=str(tmp_path / "imgs")))


def test_staged_from_s3_once_per_node_and_checked_by_size(s3, cifar_src, tmp_path, monkeypatch):
    import pyarrow.fs as pafs

    from ray_job import storage

    prepare("cifar10", cifar_src, tmp_path / "p")
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RJ_DATA_CACHE", str(tmp_path / "cache"))
    uri = s3.uri("datasets/cifar-small")
    remote = storage.at(uri)
    remote.makedirs()
    pafs.copy_files(str(tmp_path / "p"), remote.path, source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=remote.fs, use_threads=False)
    local = prepared.stage(uri)
    assert local.startswith(str(tmp_path / "cache")) and prepared.open_manifest(local)
    ds = PreparedImages(local, "train", 32, True)
    assert torch.equal(ds.__getitems__([3])[0], load_cifar10(str(cifar_src), True).images[[3]])
    stamps = {f: os.stat(os.path.join(local, f)).st_mtime_ns for f in os.listdir(local)}
    assert prepared.stage(uri) == local  # a later run copies nothing
    assert stamps == {f: os.stat(os.path.join(local, f)).st_mtime_ns for f in os.listdir(local)}
    with open(os.path.join(local, "test-00000.arrow"), "r+b") as f:  # a damaged local copy
        f.truncate(10)
    prepared.stage(uri)
    assert prepared.files_complete(local, prepared.open_manifest(local)) is None
    assert stamps["train-00000.arrow"] == os.stat(os.path.join(local, "train-00000.arrow")).st_mtime_ns
    with pytest.raises(DataError, match="no manifest.json under --data-dir"):
        prepared.stage(s3.uri("datasets/nothing-here"))


def test_mid_epoch_resume_sees_exactly_the_rest_of_the_epoch(cifar_src, tmp_path):
    """EpochSteps.train_epoch's skip over a prepared dataset's loader: the same batches an uninterrupted epoch
    would have had after the saved step, for this rank."""
    from ray_job.train.engine import EpochSteps

    prepare("cifar10", cifar_src, tmp_path / "p")
    ds = PreparedImages(str(tmp_path / "p"), "train", 32, True)

    def loader():
        sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=0)
        sampler.set_epoch(1)
        return DataLoader(ds, batch_size=16, sampler=sampler, drop_last=True, collate_fn=ds.collate_fn)

    def run(skip):
        seen = []
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(32 * 32 * 3, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        steps = EpochSteps(model, opt, sched, torch.nn.CrossEntropyLoss(),
                           lambda x, train: seen.append(x.clone()) or x.float(), torch.device("cpu"))
        steps.train_epoch(loader(), skip_steps=skip)
        return seen

    full, resumed = run(0), run(3)
    assert len(full) == 150 // 16 and len(resumed) == len(full) - 3
    assert all(torch.equal(a, b) for a, b in zip(full[3:], resumed))
