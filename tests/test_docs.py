"""What the documents show, held to the code: the README's first command and the output it shows, and
the snippet of docs/training.md#using-a-checkpoint run as written on a real checkpoint file."""

import os
import re

import torch

from ray_job.config import TrainConfig, parse_train_args
from ray_job.data.augment import DeviceAugment
from ray_job.model.zoo import named as build_model
from ray_job.train.checkpoint import CHECKPOINT_FILE, save_checkpoint
from ray_job.train.metrics import TABLE_HEAD

ROOT = os.path.join(os.path.dirname(__file__), "..")
DOC = os.path.join(ROOT, "docs", "training.md")


def test_the_readme_shows_the_run_name_and_table_its_first_command_prints(tmp_path):
    """The default name is a hash of what the run computes: a field that changes it changes the
    README's output too (run the command in a fresh clone and paste its end)."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    command = re.search(r"^\.venv/bin/python -m ray_job train (.*)$", readme, re.M).group(1)
    name = parse_train_args(command.split()).with_resolved_paths(str(tmp_path)).default_name()
    shown = re.search(r"^results: \S+/results/(\S+)$", readme, re.M).group(1)
    assert shown == name
    assert f"\n{TABLE_HEAD}\n" in readme


def snippet() -> str:
    text = open(DOC).read()
    return re.search(r"## Using a checkpoint\n.*?```python\n(.*?)```", text, re.S).group(1)


def test_the_docs_snippet_loads_a_checkpoint_and_normalises_as_training_does(tmp_path):
    cfg = TrainConfig(model="resnet18", stem="cifar")
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.stem, num_classes=7)
    with torch.no_grad():  # a model whose outputs depend on the input's scale and its BatchNorm stats
        for p in model.parameters():
            p.normal_(0, 0.05)
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.normal_(0, 0.1)
    model.eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(str(tmp_path / "ckpt"), model=model, optimizer=optimizer, epoch=1, step=0,
                    config=cfg.to_dict(), metrics={}, classes=[f"c{i}" for i in range(7)])
    images = torch.randint(0, 256, (8, 32, 32, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))

    code = snippet()
    assert "results/NAME/checkpoint_.../checkpoint.pt" in code and "images = torch.zeros(" in code
    code = code.replace("results/NAME/checkpoint_.../checkpoint.pt", str(tmp_path / "ckpt" / CHECKPOINT_FILE))
    code = re.sub(r"images = torch\.zeros\(.*", "images = IMAGES", code)
    ns = {"IMAGES": images}
    exec(code, ns)

    with torch.no_grad():
        expected = model(DeviceAugment(torch.device("cpu"), channels_last=False)(images, train=False))
    assert torch.equal(ns["classes"], expected.argmax(dim=1))
    with torch.no_grad():
        assert torch.allclose(ns["model"](ns["x"]), expected, atol=1e-5)
