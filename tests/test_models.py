"""Any model (docs/models.md): torchvision's classifiers by builder or class, --model-arg, the image
size, the stem, the optimizer, the user's own function, and --init-weights."""

from __future__ import annotations

import json
import re
import secrets
import sys
from pathlib import Path

import pytest
import torch

from conftest import one_error_line, run_cli
from ray_job.config import TrainConfig, build_train_parser, parse_train_args
from ray_job.core.errors import UsageError
from ray_job.core.flags import flags_given
from ray_job.model import weights, zoo
from ray_job.model.optim import build_optimizer
from ray_job.tune.report import train_command

ROOT = Path(__file__).resolve().parent.parent
SMALL_VIT = ("--model", "VisionTransformer", "--model-arg", "patch_size=4", "--model-arg", "num_layers=2",
             "--model-arg", "num_heads=2", "--model-arg", "hidden_dim=32", "--model-arg", "mlp_dim=64")


def user_model_file(folder: Path) -> Path:
    """docs/models.md's my_model.py, written into the user's folder."""
    text = (ROOT / "docs" / "models.md").read_text()
    code = re.search(r"`my_model.py` in the folder.*?```python\n(.*?)```", text, re.S).group(1)
    path = folder / "my_model.py"
    path.write_text(code)
    return path


@pytest.mark.unit
@pytest.mark.parametrize("name", ["convnext_tiny", "efficientnet_b0", "mobilenet_v3_small", "regnet_x_400mf",
                                  "densenet121", "swin_t", "vit_b_32", "resnext50_32x4d"])
def test_torchvision_models_build_for_the_data(name):
    model = zoo.check(TrainConfig(model=name), 7)  # meta device: shapes only
    assert model.state_dict()  # and a forward pass at 32 px gave (2, 7) logits, or check raised


@pytest.mark.unit
def test_model_args_and_the_image_size_reach_the_constructor():
    cfg = parse_train_args(["--data", "imagefolder", "--image-size", "48", *SMALL_VIT])
    assert cfg.model_arg == ("patch_size=4", "num_layers=2", "num_heads=2", "hidden_dim=32", "mlp_dim=64")
    model = zoo.build(cfg, 5)
    assert (model.image_size, model.patch_size, len(model.encoder.layers), model.heads.head.out_features) == \
        (48, 4, 2, 5)
    assert zoo.model_args(TrainConfig(model_arg=("a=4", "b=0.5", "c=(7, 7)", "d=gelu"))) == \
        dict(a=4, b=0.5, c=(7, 7), d="gelu")
    assert TrainConfig.from_saved(cfg.to_dict()) == cfg  # config.json round trip (a list back to a tuple)
    # the SLURM script's plan and the tune report read which flags were given, a repeated one too
    assert flags_given(build_train_parser([]), ["--model-arg", "a=1", "--model-arg", "b=2"]) == {"model_arg"}
    command = train_command(json.loads(cfg.to_json()), "/r", "t")  # a trial's command, from its config.json
    assert "--model-arg patch_size=4 --model-arg num_layers=2" in command and "--code-dir" not in command
    assert "--model-arg" not in train_command(json.loads(TrainConfig().to_json()), "/r", "t")


@pytest.mark.unit
@pytest.mark.parametrize("kw, message", [
    (dict(model="resnet9000"), "--model 'resnet9000' is not a torchvision image classifier"),
    (dict(model="convnext_tiny", model_arg=("bogus=1",)), "--model-arg bogus: convnext_tiny has no such option; "
                                                          "its options: block_setting, stochastic_depth_prob"),
    (dict(model="vit_b_16", model_arg=("patch_size=4",)), "vit_b_16 fixes it: build the model from its class, "
                                                          "--model VisionTransformer"),
    (dict(model="VisionTransformer"), "missing 5 required positional arguments: 'patch_size'"),
    (dict(model="vit_b_16", data="imagefolder", image_size=40),
     "--model vit_b_16 cannot take --image-size 40 (AssertionError: Input shape indivisible by patch size!); "
     "--image-size 32, 64, 96"),
    (dict(model="alexnet"), "--model alexnet cannot take --image-size 32 (RuntimeError"),
])
def test_a_model_that_cannot_be_built_is_one_line(kw, message):
    with pytest.raises(UsageError) as e:
        zoo.check(TrainConfig(**kw), 10)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.unit
def test_the_stem_is_the_resnet_familys_and_the_optimizer_follows_the_model():
    with pytest.raises(UsageError, match="--stem cifar applies to the ResNet family"):
        TrainConfig(model="convnext_tiny", stem="cifar")
    assert TrainConfig(model="resnet50").stem_in_use == "cifar"
    assert TrainConfig(model="wide_resnet50_2", stem="imagenet").stem_in_use == "imagenet"
    assert TrainConfig(model="convnext_tiny").stem_in_use == "none"
    assert zoo.build(TrainConfig(model="resnet18"), 10).conv1.kernel_size == (3, 3)
    assert zoo.build(TrainConfig(model="resnet18", stem="imagenet"), 10).conv1.kernel_size == (7, 7)
    vit, cnn = TrainConfig(model="vit_b_16"), TrainConfig(model="convnext_tiny")
    assert (vit.optimizer_in_use, vit.lr_in_use, cnn.optimizer_in_use, cnn.lr_in_use) == ("adamw", 1e-3, "sgd", 0.1)
    assert TrainConfig(model="vit_b_16", optimizer="sgd", lr=0.05).lr_in_use == 0.05
    optimizer = build_optimizer(torch.nn.Linear(2, 2), TrainConfig(model="swin_t"), 1, torch.device("cpu"))
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)


@pytest.mark.unit
def test_existing_run_names_stay_and_what_changes_the_run_changes_the_name():
    """Runs named before these flags keep their names (the README's run is one); model options and
    weights name another run."""
    readme = TrainConfig(data="synthetic", num_workers=2, epochs=2)
    explicit = TrainConfig(data="synthetic", num_workers=2, epochs=2, stem="cifar", optimizer="sgd", lr=0.1)
    assert readme.default_name() == explicit.default_name()
    wider = TrainConfig(data="synthetic", num_workers=2, model_arg=("width_per_group=32",))
    adamw = TrainConfig(data="synthetic", num_workers=2, optimizer="adamw")
    names = {readme.default_name(), wider.default_name(), readme.default_name("ab" * 32), adamw.default_name()}
    assert len(names) == 4
    assert TrainConfig(data="synthetic", model="./nets/mine.py:build").default_name().startswith(
        "ray_job_synthetic_mine_build_")


@pytest.mark.unit
def test_the_users_own_model_from_a_file_or_a_module(tmp_path):
    user_model_file(tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "nets.py").write_text(
        "from torch import nn\n"
        "def sized(num_classes, image_size):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(3 * image_size ** 2, num_classes))\n"
        "def nothing(num_classes):\n    return 'a model'\n")
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    at = dict(code_dir=str(tmp_path))
    model = zoo.check(TrainConfig(model="./my_model.py:small_cnn", model_arg=("width=8",), **at), 4)
    assert model[0].out_channels == 8 and model[-1].out_features == 4
    assert zoo.build(TrainConfig(model="pkg.nets:sized", **at), 3)[1].in_features == 3 * 32 * 32
    for spec, message in [("./my_model.py:big_cnn", "my_model.py has no function 'big_cnn'"),
                          ("./missing.py:f", "no file"),
                          ("./broken.py:f", "importing ./broken.py failed: ModuleNotFoundError"),
                          ("pkg.nets:nothing", "returned a str, not a torch.nn.Module"),
                          ("pkg.gone:f", "importing pkg.gone failed")]:
        with pytest.raises(UsageError, match=re.escape(message)):
            zoo.check(TrainConfig(model=spec, **at), 4)


@pytest.mark.unit
def test_init_weights_load_the_body_and_leave_a_head_of_another_size_new(tmp_path):
    source = zoo.build(TrainConfig(model="resnet18", stem="imagenet"), 10)
    torch.save({"model": source.state_dict(), "epoch": 3}, tmp_path / "checkpoint.pt")  # a run's checkpoint
    torch.save({f"module.{k}": v for k, v in source.state_dict().items()}, tmp_path / "ddp.pth")
    target = zoo.build(TrainConfig(model="resnet18", stem="imagenet"), 3)
    for name in ("checkpoint.pt", "ddp.pth"):
        found = weights.load(target, str(tmp_path / name))
        assert found.new == ["fc.weight", "fc.bias"] and len(found.loaded) == len(source.state_dict()) - 2
        assert torch.equal(target.conv1.weight, source.conv1.weight)
    with torch.device("meta"):
        cifar = zoo.build(TrainConfig(model="resnet18"), 3)
    assert "conv1.weight" in weights.check(cifar, str(tmp_path / "ddp.pth"))[0].new  # 3x3, not 7x7
    torch.save(zoo.build(TrainConfig(model="mobilenet_v3_small"), 10).state_dict(), tmp_path / "other.pth")
    (tmp_path / "notes.txt").write_text("not weights")
    for name, message in [("other.pth", "fits nothing of this model"), ("notes.txt", "is not a PyTorch weights file"),
                          ("absent.pt", "cannot read it")]:
        with pytest.raises(UsageError, match=message):
            weights.check(cifar, str(tmp_path / name))


@pytest.mark.unit
def test_fine_tuning_from_a_runs_weights_learns_faster_than_from_scratch(tmp_path):
    """Weights trained on 10 synthetic classes, given to a 4-class task of other colours: the body is
    loaded, the head is new, and the same first steps have a lower loss than from scratch."""
    from ray_job.data.synthetic import make_synthetic

    def train(model, split, steps):
        torch.manual_seed(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        x = split.images.permute(0, 3, 1, 2).float() / 255
        losses = []
        for _ in range(steps):
            idx = torch.randint(0, len(x), (32,))
            loss = torch.nn.functional.cross_entropy(model(x[idx]), split.labels[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return sum(losses) / steps

    cfg = TrainConfig(model="resnet18", stem="imagenet")
    torch.manual_seed(0)
    body = zoo.build(cfg, 10)
    train(body, make_synthetic(1024, 0, True), 30)
    torch.save({"model": body.state_dict()}, tmp_path / "checkpoint.pt")
    task = make_synthetic(512, 7, True, num_classes=4)  # other colours and stripes than the 10 classes'
    torch.manual_seed(1)
    scratch, tuned = zoo.build(cfg, 4), zoo.build(cfg, 4)
    tuned.load_state_dict(scratch.state_dict())  # the same new head
    assert weights.load(tuned, str(tmp_path / "checkpoint.pt")).new == ["fc.weight", "fc.bias"]
    assert train(tuned, task, 8) < 0.8 * train(scratch, task, 8)  # 0.25 vs 0.45 here (0.6 over tasks 7-11)


@pytest.mark.unit
def test_a_search_may_choose_the_model_and_the_optimizer():
    from ray_job.tune.options import parse_args, trial_config

    search = parse_args(["--space", "model=choice:resnet18,convnext_tiny", "--space", "optimizer=choice:sgd,adamw",
                         "--data", "synthetic"])
    assert [(d.name, d.args) for d in search.space] == [("model", ("resnet18", "convnext_tiny")),
                                                        ("optimizer", ("sgd", "adamw"))]
    trial = trial_config(search.base, {"model": "convnext_tiny", "optimizer": "adamw"})
    assert (trial.model, trial.optimizer_in_use) == ("convnext_tiny", "adamw")
    assert "--model convnext_tiny" in train_command(trial.to_dict(), "/runs/s", "trial_000")
    for space, message in (("model=uniform:1:2", "--model takes words: use choice:A,B,..."),
                           ("model=choice:resnet18,nonesuch", "with model=nonesuch: --model 'nonesuch' is not"),
                           ("data=choice:a,b", "cannot search 'data'")):
        with pytest.raises(UsageError, match=re.escape(message)):
            parse_args(["--space", space, "--data", "synthetic"])


@pytest.mark.unit
@pytest.mark.parametrize("extra, message", [
    (("--model", "resnet9000"), "is not a torchvision image classifier"),
    (("--model", "./my_model.py:small_cnn", "--init-weights", "other.pth"), "fits nothing of this model"),
])
def test_bad_model_flags_fail_from_the_users_seat_with_one_line_and_nothing_written(user_dir, extra, message):
    """The commands as typed (the other refusals: test_a_model_that_cannot_be_built_is_one_line and the
    driver's checks below)."""
    user_model_file(user_dir)
    torch.save(torch.nn.Linear(3, 3).state_dict(), user_dir / "other.pth")
    before = sorted(p.name for p in user_dir.iterdir())
    proc = run_cli("train", "--data", "synthetic", "--storage-path", "results", *extra, cwd=user_dir)
    assert proc.returncode == 2 and message in one_error_line(proc.stderr), proc.stderr[-2000:]
    assert sorted(p.name for p in user_dir.iterdir()) == before  # no results folder


@pytest.mark.unit
@pytest.mark.parametrize("extra, message", [
    (("--model", "convnext_tiny", "--model-arg", "depth=3"), "--model-arg depth: convnext_tiny has no such option"),
    (("--model", "./my_model.py:tiny_cnn"), "my_model.py has no function 'tiny_cnn'"),
    (("--model", "vit_b_16", "--init-weights", "absent.pt"), "--init-weights"),
])
def test_the_driver_checks_the_model_before_anything_is_written(user_dir, monkeypatch, extra, message):
    from ray_job.train.driver import preflight

    user_model_file(user_dir)
    monkeypatch.chdir(user_dir)
    with pytest.raises(UsageError, match=re.escape(message)):
        preflight(parse_train_args(["--data", "synthetic", "--storage-path", "results", *extra]))
    assert not (user_dir / "results").exists()


# --- from the user's seat, on the session's Ray cluster -------------------------------------------
FEW_STEPS = ("--data", "synthetic", "--epochs", "1", "--steps-per-epoch", "2", "--batch-size", "16",
             "--synthetic-train-size", "64", "--synthetic-test-size", "32", "--log-every", "1",
             "--storage-path", "results")


def finished_run(user_dir: Path, proc) -> dict:
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    [run] = [p for p in (user_dir / "results").iterdir() if p.is_dir()]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] and summary["epochs_completed"] == 1
    assert any(p.name.startswith("checkpoint_") for p in run.iterdir())
    return summary


@pytest.mark.ray
def test_the_users_own_model_from_weights_through_ray_job_submit(ray_cluster, user_dir, tmp_path):
    """`ray job submit --working-dir .` ships my_model.py to the workers; --init-weights of another
    number of classes loads the body and starts the head new, as the driver's log says."""
    user_model_file(user_dir)
    sys.path.insert(0, str(user_dir))
    try:
        from my_model import small_cnn
    finally:
        sys.path.remove(str(user_dir))
    weights_file = tmp_path / "weights.pt"
    torch.save(small_cnn(num_classes=5, width=8).state_dict(), weights_file)
    job_id = f"own-{secrets.token_hex(4)}"
    proc = ray_cluster.job(
        "submit", "--submission-id", job_id, "--working-dir", ".", "--", "python", "-m", "ray_job", "train",
        *FEW_STEPS[:-1], str(tmp_path / "results"), "--model", "./my_model.py:small_cnn", "--model-arg", "width=8",
        "--init-weights", str(weights_file), "--num-workers", "2", cwd=str(user_dir), timeout=300)
    logs = proc.stdout
    assert proc.returncode == 0 and ray_cluster.job_status(job_id) == "SUCCEEDED", logs[-4000:]
    assert f"--init-weights {weights_file}: 14 tensors loaded, 2 new (8.weight, 8.bias)" in logs, logs[-4000:]
    finished_run(tmp_path, proc)
