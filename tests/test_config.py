import os

import pytest

from ray_job.config import parse_train_args
from ray_job.config import TrainConfig
from ray_job.core.errors import UsageError


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
    (["--optimizer", "lamb"], "invalid choice"),
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


def test_paths_are_resolved_once_against_the_users_folder(tmp_path, monkeypatch):
    from ray_job.core.paths import resolve_path

    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig(storage_path="results", data_dir="./data", resume_from="../x/checkpoint_1",
                      name="n").with_resolved_paths()
    assert cfg.storage_path == str(tmp_path / "results")
    assert cfg.data_dir == str(tmp_path / "data")
    assert cfg.resume_from == str(tmp_path.parent / "x" / "checkpoint_1")
    assert cfg.run_dir() == str(tmp_path / "results" / "n")
    assert resolve_path("~/r") == os.path.join(os.path.expanduser("~"), "r")
    assert resolve_path("s3://bucket/runs") == "s3://bucket/runs"  # URIs are not local paths
    assert resolve_path("") == ""  # no --resume-from stays none
    assert TrainConfig(storage_path="s3://b/p", name="n").run_dir() == "s3://b/p/n"


def test_strict_json_writes_null_for_nan_and_refuses_to_read_nan(tmp_path):
    import math

    from ray_job.storage import read_json, write_json

    path = str(tmp_path / "s.json")
    write_json(path, {"best": math.nan, "rows": [math.inf, 1.5], "nested": {"x": -math.inf}})
    assert read_json(path) == {"best": None, "rows": [None, 1.5], "nested": {"x": None}}
    (tmp_path / "bad.json").write_text('{"best": NaN}')
    with pytest.raises(ValueError, match="not strict JSON"):
        read_json(str(tmp_path / "bad.json"))


def test_speed_and_gpu_choices_have_one_home():
    from ray_job.config import Speed, choose_use_gpu

    assert Speed.choose("auto", "auto", use_gpu=True, cuda_available=True) == Speed(True, True, True)
    assert Speed.choose("auto", "auto", use_gpu=True, cuda_available=False) == Speed(False, False, False)
    assert Speed.choose("bf16", "on", use_gpu=False, cuda_available=True) == Speed(False, True, True)
    assert choose_use_gpu(None, 4) is True and choose_use_gpu(None, 0) is False
    assert choose_use_gpu(False, 4) is False
    with pytest.raises(UsageError, match="no GPUs"):
        choose_use_gpu(True, 0)


def test_default_name_is_the_same_for_the_same_command():
    base = parse_train_args(["--data", "synthetic", "--model", "resnet18"]).with_resolved_paths()
    same = parse_train_args(["--model", "resnet18", "--data", "synthetic", "--epochs", "7",
                             "--log-every", "3"]).with_resolved_paths()
    other = parse_train_args(["--data", "synthetic", "--model", "resnet18", "--lr", "0.2"])
    assert base.default_name() == same.default_name()  # --epochs extends the same run
    assert base.default_name().startswith("ray_job_synthetic_resnet18_")
    assert other.with_resolved_paths().default_name() != base.default_name()


def test_default_name_hashes_only_what_the_run_reads(tmp_path):
    """The README's command names the same run in every clone: synthetic data reads no
    --data-dir; the fields marked affects_result=False (how long to wait, how to show progress)
    change nothing; cifar10's name does depend on its folder."""
    synthetic = ["--data", "synthetic", "--model", "resnet18"]
    here = parse_train_args(synthetic).with_resolved_paths(str(tmp_path / "a"))
    there = parse_train_args(synthetic).with_resolved_paths(str(tmp_path / "b"))
    waits = parse_train_args([*synthetic, "--resource-wait-s", "5", "--progress", "lines"]).with_resolved_paths()
    assert here.default_name() == there.default_name() == waits.default_name()
    cifar = ["--data", "cifar10", "--model", "resnet18"]
    assert parse_train_args(cifar).with_resolved_paths(str(tmp_path / "a")).default_name() != \
        parse_train_args(cifar).with_resolved_paths(str(tmp_path / "b")).default_name()


@pytest.mark.parametrize("flags, same_run", [
    (["--log-every", "1"], True), (["--retry-storage-s", "5"], True), (["--max-failures", "7"], True),
    (["--checkpoint-every-min", "5"], True), (["--collective-timeout-s", "60"], True),
    (["--keep-checkpoints", "9"], True), (["--epochs", "99"], True),
    (["--lr", "0.01"], False), (["--batch-size", "32"], False), (["--seed", "1"], False),
    (["--model", "resnet34"], False), (["--num-workers", "3"], False)])
def test_the_same_command_with_another_flag_continues_the_run_only_if_the_flag_changes_no_result(flags, same_run):
    """Without --name, the same command continues its run: how it waits, retries, logs and keeps
    checkpoints, and how many epochs it goes on for, leave it the same run; what it computes makes
    it another one."""
    base = ["--data", "synthetic", "--model", "resnet18"]
    before = parse_train_args(base).with_resolved_paths().default_name()
    after = parse_train_args([*base, *flags]).with_resolved_paths().default_name()
    assert (after == before) is same_run, (flags, before, after)
