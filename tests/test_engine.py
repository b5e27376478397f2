import pytest
import torch
from torch import nn

from ray_job.train.checkpoint import CheckpointError, load_checkpoint, restore_training_state, save_checkpoint
from ray_job.config import TrainConfig
from ray_job.data.arrays import ArrayDataset
from ray_job.data.augment import DeviceAugment
from ray_job.data.synthetic import make_synthetic
from ray_job.train.engine import EpochSteps, evaluate, measure_comm_wait
from ray_job.model.parts import param_groups, unwrap
from ray_job.model.zoo import named as build_model
from ray_job.model.optim import LRFactor, build_optimizer, build_scheduler


def _setup(train_size=256, steps_cfg=None):
    torch.manual_seed(0)
    cfg = TrainConfig(model="resnet18", stem="imagenet", batch_size=32, epochs=3, warmup_epochs=0.5)
    model = build_model(cfg.model, cfg.stem, 10)
    ds = ArrayDataset(make_synthetic(train_size, 0, True))
    loader = torch.utils.data.DataLoader(ds, batch_size=32, shuffle=True, drop_last=True,
                                         collate_fn=ds.collate_fn)
    opt = build_optimizer(model, cfg, 1, torch.device("cpu"))
    sched = build_scheduler(opt, cfg, len(loader))
    return cfg, model, loader, opt, sched, DeviceAugment(torch.device("cpu"), False)


def test_train_epoch_learns_and_evaluate_counts():
    cfg, model, loader, opt, sched, aug = _setup()
    test_ds = ArrayDataset(make_synthetic(128, 0, False))
    test = torch.utils.data.DataLoader(test_ds, batch_size=50, collate_fn=test_ds.collate_fn)
    steps = EpochSteps(model, opt, sched, nn.CrossEntropyLoss(), aug, torch.device("cpu"))  # built once
    losses = [steps.train_epoch(loader) for _ in range(3)]
    assert losses[-1].loss_sum / losses[-1].count < losses[0].loss_sum / losses[0].count
    assert losses[0].steps == 8 and losses[0].count == 256 and losses[0].first_step_time
    stats = evaluate(model, test, nn.CrossEntropyLoss(), aug, torch.device("cpu"))
    assert stats.count == 128 and stats.correct / stats.count > 0.3  # chance is 0.1


def test_stop_at_a_step_and_the_mid_epoch_skip():
    """The loop stops iterating at step 3 (a stop request): the epoch's stats hold those 3 steps;
    the rest of the epoch, skipping them, is the other 5; a cap ends it after 2."""
    cfg, model, loader, opt, sched, aug = _setup()
    epoch = EpochSteps(model, opt, sched, nn.CrossEntropyLoss(), aug, torch.device("cpu"))
    numbers = []
    for step in epoch.run(loader):
        numbers.append(step.number)
        assert step.loss.requires_grad is False or step.loss.ndim == 0
        if step.number == 3:
            break
    stats = epoch.finish()
    assert numbers == [1, 2, 3] and stats.steps == 3 and stats.count == 96 and stats.wall_s > 0
    rest = epoch.train_epoch(loader, skip_steps=3)
    assert rest.steps == 5 and rest.count == 160  # the same object, a new epoch's sums
    assert [s.number for s in epoch.run(loader, max_steps=2)] == [1, 2] and epoch.finish().steps == 2


def test_lr_schedule_warms_up_then_decays():
    f = LRFactor("cosine", total_steps=100, warmup_steps=10)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.5, abs=0.02) and f(100) == pytest.approx(0.0, abs=1e-9)
    assert LRFactor("onecycle", 100, 10)(55) == pytest.approx(0.5)
    assert LRFactor("constant", 100, 0)(70) == 1.0


def test_no_decay_on_norms_and_biases():
    model = build_model("resnet18", "imagenet", 10)
    decay, no_decay = param_groups(model, 5e-4, decay_norm_bias=False)
    assert all(p.ndim > 1 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert no_decay["weight_decay"] == 0


def test_model_shapes_and_stems():
    for stem in ("cifar", "imagenet"):
        model = build_model("resnet50", stem, 10).eval()
        assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert build_model("resnet18", "cifar", 10).conv1.stride == (1, 1)


def test_checkpoint_round_trip_unwrapped_and_on_cpu(tmp_path):
    cfg, model, loader, opt, sched, aug = _setup()
    EpochSteps(model, opt, sched, nn.CrossEntropyLoss(), aug, torch.device("cpu")).train_epoch(loader, max_steps=2)
    wrapped = nn.Sequential()  # stands in for DDP's `.module` nesting
    wrapped.module = model
    save_checkpoint(str(tmp_path), model=unwrap(wrapped), optimizer=opt,
                    epoch=1, step=0, config=cfg.to_dict(), metrics={"test_acc": 0.5}, world_size=2)
    state = load_checkpoint(str(tmp_path))
    assert not any(k.startswith("module.") for k in state["model"])
    fresh = build_model("resnet18", "imagenet", 10)
    opt2 = build_optimizer(fresh, cfg, 1, torch.device("cpu"))
    restore_training_state(state, model=fresh, optimizer=opt2)
    x = torch.randn(4, 3, 32, 32)
    torch.testing.assert_close(fresh.eval()(x), model.eval()(x))
    assert state["epoch"] == 1 and state["world_size"] == 2


def test_corrupt_or_missing_checkpoint_is_a_clear_error(tmp_path):
    (tmp_path / "checkpoint.pt").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(str(tmp_path / "nope"))


def test_checkpoint_of_another_format_is_a_clear_error(tmp_path):
    torch.save({"format_version": 99, "model": {}, "epoch": 1}, tmp_path / "checkpoint.pt")
    with pytest.raises(CheckpointError, match="format 99"):
        load_checkpoint(str(tmp_path))


def test_comm_wait_is_zero_without_ddp():
    cfg, model, loader, opt, sched, aug = _setup()
    steps = EpochSteps(model, opt, sched, nn.CrossEntropyLoss(), aug, torch.device("cpu"))
    assert measure_comm_wait(steps, next(iter(loader))) == 0.0


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x):
        return self.net(x)


@pytest.mark.timeout(300)
def test_compile_matches_eager_on_a_tiny_model():
    torch.manual_seed(0)
    eager = Tiny()
    compiled_base = Tiny()
    compiled_base.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_base)
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    losses = {}
    for name, model, base in (("eager", eager, eager), ("compiled", compiled, compiled_base)):
        opt = torch.optim.SGD(base.parameters(), lr=0.1)
        for _ in range(3):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses[name] = loss.item()
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-4, abs=1e-5)
    for a, b in zip(eager.parameters(), compiled_base.parameters()):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_scheduler_starts_where_a_resumed_run_stopped():
    cfg = TrainConfig(epochs=4, warmup_epochs=1, schedule="cosine")
    model = nn.Linear(2, 2)
    opt = build_optimizer(model, cfg, 1, torch.device("cpu"))
    straight = build_scheduler(opt, cfg, 10)
    for _ in range(17):
        opt.step()
        straight.step()
    lr_straight = opt.param_groups[0]["lr"]
    opt2 = build_optimizer(model, cfg, 1, torch.device("cpu"))
    jumped = build_scheduler(opt2, cfg, 10, start_step=17)
    assert opt2.param_groups[0]["lr"] == pytest.approx(lr_straight)
    opt.step(), straight.step(), opt2.step(), jumped.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
