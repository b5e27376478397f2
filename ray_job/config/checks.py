"""The rules a train config must keep (`TrainConfig.__post_init__` calls `check`): each broken one is
a UsageError of one line that says what to do."""

from __future__ import annotations

import dataclasses
from ..core.errors import UsageError
from ..core.flags import flag_name
from ..core.paths import split_userinfo
from .families import is_resnet_family


def check(cfg) -> None:
    """`cfg`: a TrainConfig being made (run.py imports this module). Normalises the fields that
    arrive as lists, and raises UsageError at the first rule broken."""
    object.__setattr__(cfg, "model_arg", tuple(cfg.model_arg or ()))  # a list from JSON or argparse
    for item in cfg.model_arg:
        if "=" not in item or not item.partition("=")[0].strip().isidentifier():
            raise UsageError(f"--model-arg {item!r}: write KEY=VALUE, e.g. --model-arg patch_size=4")
    if cfg.stem != "auto" and not is_resnet_family(cfg.model):
        raise UsageError(f"--stem {cfg.stem} applies to the ResNet family (resnet*, wide_resnet*, "
                         f"resnext*) only; leave it out for --model {cfg.model}")
    for f in dataclasses.fields(cfg):
        choices = f.metadata.get("choices")
        value = getattr(cfg, f.name)
        if choices and value not in choices:
            raise UsageError(f"--{flag_name(f.name)} {value!r} is not one of: {', '.join(choices)}")
    positive = ("epochs", "batch_size", "lr_ref_batch", "synthetic_train_size",
                "synthetic_test_size", "ddp_bucket_mb", "keep_checkpoints")
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise UsageError(f"--{flag_name(name)} must be a positive number, got {getattr(cfg, name)}")
    non_negative = ("num_workers", "steps_per_epoch", "max_failures", "log_every", "lr",
                    "momentum", "weight_decay", "label_smoothing", "warmup_epochs",
                    "retry_storage_s", "min_workers", "checkpoint_every_min")
    for name in non_negative:
        if getattr(cfg, name) < 0:
            raise UsageError(f"--{flag_name(name)} must not be negative, got {getattr(cfg, name)}")
    if cfg.cpus_per_worker <= 0 or cfg.gpus_per_worker <= 0:
        raise UsageError("--cpus-per-worker and --gpus-per-worker must be positive")
    if cfg.label_smoothing >= 1:
        raise UsageError("--label-smoothing must be below 1")
    if cfg.resource_wait_s <= 0 or cfg.collective_timeout_s <= 0 or cfg.grow_check_s <= 0:
        raise UsageError("--resource-wait-s, --collective-timeout-s and --grow-check-s must be positive")
    # against the given --num-workers, or the count train/trainer.py takes from the cluster (replace() checks again)
    if cfg.num_workers and cfg.min_workers > cfg.num_workers:
        raise UsageError(f"--min-workers {cfg.min_workers} is more than --num-workers {cfg.num_workers}; "
                         f"give --min-workers <= --num-workers")
    if cfg.image_size < 8:
        raise UsageError(f"--image-size must be at least 8, got {cfg.image_size}")
    if cfg.image_size != 32 and cfg.data in ("cifar10", "synthetic"):
        raise UsageError(f"--image-size {cfg.image_size} needs --data prepared or imagefolder "
                         f"(--data {cfg.data} is 32x32 in memory); prepare it with `python -m "
                         f"ray_job prepare-data --from cifar10 ...` to resize it")
    if cfg.cpu_offload and cfg.strategy == "ddp":
        raise UsageError("--cpu-offload offloads sharded states: give --strategy fsdp (or hsdp) with it")
    if cfg.memory_per_worker_gb < 0:
        raise UsageError(f"--memory-per-worker-gb must not be negative, got {cfg.memory_per_worker_gb}")
    if cfg.loader_workers < -1:
        raise UsageError("--loader-workers must be -1 (auto) or a count >= 0")
    if split_userinfo(cfg.mlflow_uri)[1]:
        raise UsageError(f"--mlflow-uri {split_userinfo(cfg.mlflow_uri)[0]} holds a user name (and "
                         f"password), which would show in logs and process lists; give the bare URI and "
                         f"set MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN)")
    if cfg.mlflow_uri and not cfg.mlflow:  # naming a tracking store asks for tracking
        object.__setattr__(cfg, "mlflow", True)
    if cfg.mlflow_register and not cfg.mlflow:
        raise UsageError("--mlflow-register needs --mlflow (or --mlflow-uri): tracking is off without it")
