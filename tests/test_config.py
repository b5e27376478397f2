import pytest

from ray_job.cli import parse_train_args
from ray_job.config import TrainConfig, UsageError


def test_flags_map_onto_fields_and_defaults():
    cfg = parse_train_args([])
    assert cfg == TrainConfig()
    cfg = parse_train_args(["--num-workers", "4", "--no-gpu", "--batch-mode", "per-worker",
                            "--model", "resnet18", "--no-decay-norm-bias", "--compile"])
    assert (cfg.num_workers, cfg.use_gpu, cfg.batch_mode, cfg.model) == (4, False, "per-worker", "resnet18")
    assert cfg.decay_norm_bias is False and cfg.compile is True


def test_recipe_sets_defaults_but_flags_win():
    fast = parse_train_args(["--recipe", "fast"])
    assert fast.schedule == "onecycle" and fast.label_smoothing == 0.1 and not fast.decay_norm_bias
    assert parse_train_args(["--recipe", "fast", "--label-smoothing", "0"]).label_smoothing == 0


@pytest.mark.parametrize("argv, words", [
    (["--epochs", "0"], "--epochs must be a positive"),
    (["--batch-size", "-8"], "--batch-size must be a positive"),
    (["--model", "vgg"], "invalid choice"),
    (["--lr", "-1"], "--lr must not be negative"),
    (["--cpus-per-worker", "0"], "must be positive"),
    (["--label-smoothing", "1.5"], "below 1"),
    (["--epochs", "two"], "invalid int value"),
])
def test_nonsense_is_a_one_line_usage_error(argv, words):
    with pytest.raises(UsageError) as e:
        parse_train_args(argv)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_batch_modes_and_lr_scaling():
    cfg = TrainConfig(batch_size=128, lr=0.1, lr_ref_batch=128)
    assert cfg.per_worker_batch(4) == 32 and cfg.global_batch(4) == 128
    per = TrainConfig(batch_size=128, batch_mode="per-worker", lr=0.1, lr_ref_batch=128)
    assert per.global_batch(4) == 512 and per.scaled_lr(4) == pytest.approx(0.4)
    with pytest.raises(UsageError):
        TrainConfig(batch_size=2).per_worker_batch(4)


def test_config_round_trips_through_a_dict():
    cfg = TrainConfig(model="resnet34", use_gpu=True, name="x")
    assert TrainConfig(**cfg.to_dict()) == cfg
