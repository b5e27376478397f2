"""The trained model afterwards: `export` writes a model that torch alone loads (a process that never
imports ray_job) and that gives the checkpoint's outputs; `predict` classifies an image folder with
Ray Data, one row per image, and its accuracy on the run's test split is the run's test accuracy."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from ray_job.config import TrainConfig
from ray_job.core.errors import UsageError
from ray_job.data.augment import DeviceAugment
from ray_job.data.cifar10 import CIFAR10_CLASSES
from ray_job.data.synthetic import make_synthetic
from ray_job.data import views
from ray_job.infer import export_main
from ray_job.model.zoo import named as build_model
from ray_job.train.checkpoint import save_checkpoint
from ray_job.train.trained import classes_of, trained_model

from conftest import run_cli, strict_file

# What a user with torch alone runs: model.pt2 on uint8 NCHW images (a .npy), logits to a .npy.
TORCH_ONLY = """
import sys, numpy as np, torch
model = torch.export.load(sys.argv[1]).module()
images = torch.from_numpy(np.load(sys.argv[2]))
with torch.no_grad():
    logits = torch.cat([model(images[i:i + 100]) for i in range(0, len(images), 100)])
np.save(sys.argv[3], logits.numpy())
assert not any(m == 'ray_job' or m.startswith('ray_job.') for m in sys.modules), 'ray_job was imported'
"""


def torch_only(model_pt2, images: np.ndarray, tmp_path) -> np.ndarray:
    np.save(tmp_path / "images.npy", images)
    proc = subprocess.run([sys.executable, "-c", TORCH_ONLY, str(model_pt2), str(tmp_path / "images.npy"),
                           str(tmp_path / "logits.npy")], cwd=tmp_path, capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return np.load(tmp_path / "logits.npy")


def tiny_checkpoint(folder, classes=("cat", "dog", "eel"), **extra) -> torch.nn.Module:
    cfg = TrainConfig(model="resnet18", stem="cifar", data="synthetic")
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.stem, len(classes))
    with torch.no_grad():  # outputs that depend on the input's scale and the BatchNorm statistics
        for p in model.parameters():
            p.normal_(0, 0.05)
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.normal_(0, 0.1)
    save_checkpoint(str(folder), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), epoch=3,
                    step=0, config={**cfg.to_dict(), **extra}, metrics={"test_acc": 0.75}, classes=classes)
    return model.eval()


def test_export_is_loaded_by_torch_alone_and_gives_the_checkpoints_outputs(tmp_path):
    model = tiny_checkpoint(tmp_path / "ckpt")
    assert export_main([str(tmp_path / "ckpt"), "--out", str(tmp_path / "model")]) == 0
    assert json.loads((tmp_path / "model" / "labels.json").read_text()) == ["cat", "dog", "eel"]
    meta = strict_file(tmp_path / "model" / "model.json")
    assert (meta["model"], meta["arguments"], meta["image_size"], meta["test_acc"], meta["epoch"]) == (
        "resnet18", {"stem": "cifar"}, 32, 0.75, 3)
    assert meta["checkpoint"] == str(tmp_path / "ckpt")

    images = torch.randint(0, 256, (7, 32, 32, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(DeviceAugment(torch.device("cpu"), channels_last=False)(images, train=False))
    for n in (1, 7):  # any batch size
        logits = torch_only(tmp_path / "model" / "model.pt2", images[:n].permute(0, 3, 1, 2).numpy(), tmp_path)
        assert np.abs(logits - expected[:n].numpy()).max() < 1e-5

    with pytest.raises(UsageError, match="is not empty; give another folder, or --overwrite"):
        export_main([str(tmp_path / "ckpt"), "--out", str(tmp_path / "model")])
    assert export_main([str(tmp_path / "ckpt"), "--out", str(tmp_path / "model"), "--overwrite"]) == 0
    with pytest.raises(UsageError, match="no checkpoint_\\* folder in"):
        export_main([str(tmp_path / "nothing"), "--out", str(tmp_path / "m2")])
    assert not (tmp_path / "m2").exists()


def test_a_checkpoint_without_class_names_gets_cifar10s_or_numbered_ones(tmp_path):
    tiny_checkpoint(tmp_path / "c", classes=[f"x{i}" for i in range(10)], data="cifar10")
    state = torch.load(tmp_path / "c" / "checkpoint.pt", weights_only=False)
    assert classes_of(state) == tuple(f"x{i}" for i in range(10))
    del state["classes"]
    assert classes_of(state) == CIFAR10_CLASSES
    state["config"]["data"] = "imagefolder"
    assert classes_of(state) == tuple(f"class_{i}" for i in range(10))
    assert trained_model(str(tmp_path / "c")).classes == tuple(f"x{i}" for i in range(10))


def test_the_test_view_keeps_images_of_the_size_and_resizes_the_others():
    from PIL import Image

    square = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    assert np.array_equal(views.test_view(Image.fromarray(square), 32), square)
    assert views.test_view(Image.fromarray(np.zeros((50, 80, 3), np.uint8)), 32).shape == (32, 32, 3)


@pytest.mark.timeout(600)
def test_predict_and_export_give_the_runs_test_accuracy(trained_run, ray_cluster, tmp_path):
    from PIL import Image

    home = trained_run.copy_to(tmp_path)  # the user's folder, with the run in it
    summary = strict_file(trained_run.run_dir / "summary.json")
    test = make_synthetic(203, TrainConfig().seed, False)  # the run's test split (--synthetic-test-size 203)
    folder = tmp_path / "images"
    for i, (image, label) in enumerate(zip(test.images.numpy(), test.labels.tolist())):
        os.makedirs(folder / test.classes[label], exist_ok=True)
        Image.fromarray(image).save(folder / test.classes[label] / f"{i:04d}.png")
    images = os.path.relpath(folder, home)

    exported = run_cli("export", "results/trained", "--out", "model", cwd=home)
    assert exported.returncode == 0, exported.stderr[-3000:]
    logits = torch_only(home / "model" / "model.pt2", test.images.permute(0, 3, 1, 2).numpy(), tmp_path)
    labels = json.loads((home / "model" / "labels.json").read_text())
    assert labels == list(test.classes)
    assert (logits.argmax(1) == test.labels.numpy()).mean() == pytest.approx(summary["best_test_acc"], abs=1e-9)

    proc = run_cli("predict", "model", "--images", images, "--out", "predictions.csv", "--batch-size", "128",
                   cwd=home, env=ray_cluster.user_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    rows = list(csv.DictReader(open(home / "predictions.csv")))
    assert [r["path"] for r in rows] == sorted(os.path.join(test.classes[label], f"{i:04d}.png")
                                               for i, label in enumerate(test.labels.tolist()))
    assert all(r["predicted"] == r["class_1"] and 0 < float(r["probability"]) <= 1 for r in rows)
    assert len(rows[0]) == 3 + 2 * 5
    shown = float(re.search(r"^accuracy: ([0-9.]+) \(203 images", proc.stdout, re.M).group(1))
    assert shown == pytest.approx(summary["best_test_acc"], abs=1e-4)
    assert re.search(r"images/s", proc.stdout)

    again = run_cli("predict", "model", "--images", images, "--out", "predictions.csv", cwd=home)
    assert again.returncode == 2 and "error: --out predictions.csv exists" in again.stderr
