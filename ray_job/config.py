"""The one typed configuration of a training run.

Every `train` flag is a field of `TrainConfig` (same name, `-` for `_`); the CLI is generated from the
fields, their defaults and their `help` metadata, so the two cannot drift apart. The config is frozen,
printed once at start, saved beside the results, and sent to the workers as a dict.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional


class UsageError(Exception):
    """Bad input: the CLI prints the message as one line and exits with code 2."""


MODELS = ("resnet18", "resnet34", "resnet50")
STEMS = ("cifar", "imagenet")
DATASETS = ("cifar10", "imagefolder", "prepared", "synthetic")
LOADERS = ("auto", "fast", "torchvision")
PRECISIONS = ("auto", "bf16", "fp32")
SCHEDULES = ("onecycle", "cosine", "constant")
BACKENDS = ("auto", "nccl", "gloo")
BATCH_MODES = ("global", "per-worker")
GRAD_COMPRESSIONS = ("none", "bf16")
TRISTATE = ("auto", "on", "off")
PROGRESS = ("auto", "bar", "lines")
# Fields added after runs were named by default_name(), with their defaults.
ADDED_FIELDS = {"image_size": 32}
# Fields that name files or folders: resolved once, on the driver (see `resolve_path`).
PATH_FIELDS = ("data_dir", "storage_path", "resume_from")


def _f(default: Any, help: str, group: str, choices: Optional[tuple] = None, **kw: Any) -> Any:
    """A dataclass field carrying its CLI help text, group and allowed values."""
    return field(default=default, metadata={"help": help, "group": group, "choices": choices, **kw})


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides what a run computes and where it goes."""

    # --- cluster ---
    address: Optional[str] = _f(
        None, "Ray cluster to join (HOST:PORT or 'auto'); default: $RAY_ADDRESS, else start a local "
        "Ray cluster in this process", "cluster")
    num_workers: int = _f(0, "training workers (one DDP rank each); 0 = one per GPU in the cluster, "
                          "or 1 without GPUs", "cluster")
    min_workers: int = _f(0, "elastic: when nodes are lost, go on with as few as N workers, and grow "
                          "back to --num-workers when capacity returns (each resize restarts the "
                          "group from the latest checkpoint; the batch rule of --batch-mode applies "
                          "to the new world size; below N workers it waits without a time limit); 0 = a fixed size",
                          "cluster")
    use_gpu: Optional[bool] = _f(None, "train on GPUs (default: yes when the cluster has GPUs)",
                                 "cluster", bool_flag=True)
    cpus_per_worker: float = _f(1.0, "CPUs reserved per worker (also its torch thread count)", "cluster")
    gpus_per_worker: float = _f(1.0, "GPUs per worker when --use-gpu (0.5 = two workers share a GPU; "
                                "needs --backend gloo)", "cluster")
    backend: str = _f("auto", "torch.distributed backend; auto = nccl on GPU, gloo on CPU", "cluster",
                      BACKENDS)
    # --- schedule and optimisation ---
    recipe: str = _f("default", "preset of defaults: 'fast' = CIFAR stem, label smoothing 0.1, "
                     "one-cycle LR, no weight decay on norms/biases, global batch 1024 (flags you "
                     "give still win)", "optimisation", ("default", "fast"))
    epochs: int = _f(30, "epochs to train", "optimisation")
    batch_size: int = _f(128, "batch size; its meaning is set by --batch-mode", "optimisation")
    batch_mode: str = _f("global", "'global': --batch-size is split across workers (the seed's "
                         "fixed 128); 'per-worker': each worker takes --batch-size", "optimisation",
                         BATCH_MODES)
    lr: float = _f(0.1, "peak learning rate for a global batch of --lr-ref-batch; scaled linearly "
                   "with the real global batch", "optimisation")
    lr_ref_batch: int = _f(128, "global batch at which --lr applies unscaled", "optimisation")
    warmup_epochs: float = _f(1.0, "linear LR warmup length in epochs", "optimisation")
    schedule: str = _f("cosine", "LR after warmup: cosine decay to 0, onecycle (linear up, "
                       "linear down), or constant", "optimisation", SCHEDULES)
    momentum: float = _f(0.9, "SGD momentum (Nesterov)", "optimisation")
    weight_decay: float = _f(5e-4, "weight decay", "optimisation")
    decay_norm_bias: bool = _f(True, "apply weight decay to norm weights and biases too "
                               "(--no-decay-norm-bias exempts them)", "optimisation", bool_flag=True)
    label_smoothing: float = _f(0.0, "label smoothing of the cross-entropy loss", "optimisation")
    steps_per_epoch: int = _f(0, "cap on optimizer steps per epoch (0 = the whole epoch); for "
                              "benchmarks and scaling sweeps", "optimisation")
    seed: int = _f(0, "random seed (model init, synthetic data, shuffling)", "optimisation")
    # --- model ---
    model: str = _f("resnet50", "torchvision ResNet depth (10 outputs for CIFAR-10)", "model", MODELS)
    stem: str = _f("cifar", "'cifar': 3x3 stride-1 first conv, no max-pool: full 32x32 resolution, "
                   "~16x the FLOPs of 'imagenet' (ResNet-50: 2.6 vs 0.17 GFLOPs per image forward), reaches ~95%% "
                   "on CIFAR-10; 'imagenet': 7x7 stride-2 conv + max-pool: 8x downsampled at once, very "
                   "fast, tops out near 85%%", "model", STEMS)
    # --- data ---
    data: str = _f("cifar10", "cifar10 (torchvision's cifar-10-batches-py under --data-dir, "
                   "downloaded if missing), imagefolder (DIR/train/<class>/*, DIR/test/<class>/*; prepared "
                   "once into DIR/.ray_job_prepared), prepared (the output of `prepare-data --from ...`), "
                   "or synthetic (generated in memory, learnable, no files)", "data", DATASETS)
    data_dir: str = _f("./data", "dataset folder (must be readable on every node); for --data "
                       "prepared also s3://BUCKET/PREFIX, staged once per node into $RJ_DATA_CACHE "
                       "(default ~/.cache/ray_job/data)", "data")
    image_size: int = _f(32, "side of the square images the model sees (--data prepared / "
                         "imagefolder): images of this size stored raw take the fast path (pad-4 "
                         "crop + flip on the device); others are resized in the DataLoader workers "
                         "(train: random resized crop + flip; test: resize + center crop)", "data")
    download: bool = _f(True, "download CIFAR-10 when missing (once per node, under a file lock)",
                        "data", bool_flag=True)
    synthetic_train_size: int = _f(1024, "images in the synthetic train split", "data")
    synthetic_test_size: int = _f(256, "images in the synthetic test split", "data")
    loader: str = _f("auto", "'fast': dataset held once as uint8, one indexing op per batch, "
                     "crop/flip/normalise on the device; 'torchvision': PIL transforms per sample; "
                     "auto = fast", "data", LOADERS)
    loader_workers: int = _f(-1, "DataLoader worker processes per training worker; -1 = 0 for the "
                             "fast loader, 2 where images are decoded or resized on the CPU "
                             "(torchvision, prepared data not at --image-size)", "data")
    # --- speed ---
    precision: str = _f("auto", "bf16 autocast with fp32 master weights, or fp32; auto = bf16 on "
                        "GPU, fp32 on CPU", "speed", PRECISIONS)
    channels_last: str = _f("auto", "NHWC memory format; auto = on for GPU", "speed", TRISTATE)
    compile: bool = _f(False, "torch.compile the model (slow first epoch, faster steps)", "speed",
                       bool_flag=True)
    ddp_bucket_mb: int = _f(25, "DDP gradient bucket size in MiB", "speed")
    grad_compression: str = _f("none", "DDP communication hook: bf16 halves all-reduce bytes "
                               "(multi-node)", "speed", GRAD_COMPRESSIONS)
    sync_timing: bool = _f(False, "synchronise the GPU around each step phase so the data / "
                           "forward-backward / optimizer split is exact (a little slower; `scale` "
                           "turns it on)", "speed", bool_flag=True)
    # --- results, checkpoints, fault tolerance ---
    storage_path: str = _f("./results", "where runs are written: a folder (on a shared file system "
                           "for multi-node clusters), or object storage: s3://BUCKET/PREFIX (AWS or "
                           "S3-compatible; settings from AWS_ENDPOINT_URL_S3, AWS_REGION, "
                           "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE) or another "
                           "pyarrow.fs URI", "results")
    name: str = _f("", "run name; a run with an existing name continues from its latest checkpoint "
                   "(default: ray_job_<data>_<model>_<hash of the flags>, so the same command continues the "
                   "same run)", "results")
    resume_from: str = _f("", "start a new run from this checkpoint (directory or checkpoint.pt)",
                          "results")
    max_failures: int = _f(2, "worker-group restarts (from the last checkpoint) before giving up",
                           "results")
    resource_wait_s: float = _f(600.0, "fixed size: how long to wait for the cluster to hold the "
                                "workers (at start or after a lost node); then the driver exits 5, saving "
                                "nothing new (slurm_ray_start.sh requeues the job)", "results")
    checkpoint_every_min: float = _f(0.0, "also checkpoint every M minutes, at a step every rank "
                                     "agrees on, so a long epoch loses at most M minutes (0 = at "
                                     "epoch ends only)", "results")
    collective_timeout_s: float = _f(600.0, "a collective (DDP's all-reduce) stuck this long fails "
                                     "the step instead of hanging; the group then restarts from "
                                     "the latest checkpoint", "results")
    keep_checkpoints: int = _f(2, "checkpoints to keep, best by test accuracy", "results")
    retry_storage_s: float = _f(120.0, "seconds to keep retrying the last checkpoint (end of the run or "
                             "a stop request) and the run files while the storage fails; a "
                             "checkpoint in between that cannot be saved is skipped and training "
                             "goes on", "results")
    log_every: int = _f(10, "rank 0 prints a progress line every N steps, and at least every "
                        "10 s (0 = epoch lines only)", "results")
    progress: str = _f("auto", "progress display: a live bar (on a terminal), or plain lines (SLURM "
                       "logs, `ray job logs`); auto = bar when the driver's stdout is a terminal",
                       "results", PROGRESS)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise UsageError(f"--{_flag(f.name)} {value!r} is not one of: {', '.join(choices)}")
        positive = ("epochs", "batch_size", "lr_ref_batch", "synthetic_train_size",
                    "synthetic_test_size", "ddp_bucket_mb", "keep_checkpoints")
        for name in positive:
            if getattr(self, name) <= 0:
                raise UsageError(f"--{_flag(name)} must be a positive number, got {getattr(self, name)}")
        non_negative = ("num_workers", "steps_per_epoch", "max_failures", "log_every", "lr",
                        "momentum", "weight_decay", "label_smoothing", "warmup_epochs",
                        "retry_storage_s", "min_workers", "checkpoint_every_min")
        for name in non_negative:
            if getattr(self, name) < 0:
                raise UsageError(f"--{_flag(name)} must not be negative, got {getattr(self, name)}")
        if self.cpus_per_worker <= 0 or self.gpus_per_worker <= 0:
            raise UsageError("--cpus-per-worker and --gpus-per-worker must be positive")
        if self.label_smoothing >= 1:
            raise UsageError("--label-smoothing must be below 1")
        if self.resource_wait_s <= 0 or self.collective_timeout_s <= 0:
            raise UsageError("--resource-wait-s and --collective-timeout-s must be positive")
        if self.min_workers and self.num_workers and self.min_workers > self.num_workers:
            raise UsageError(f"--min-workers {self.min_workers} is more than --num-workers "
                             f"{self.num_workers}; give --min-workers <= --num-workers")
        if self.image_size < 8:
            raise UsageError(f"--image-size must be at least 8, got {self.image_size}")
        if self.image_size != 32 and self.data in ("cifar10", "synthetic"):
            raise UsageError(f"--image-size {self.image_size} needs --data prepared or imagefolder "
                             f"(--data {self.data} is 32x32 in memory); prepare it with `python -m "
                             f"ray_job prepare-data --from cifar10 ...` to resize it")
        if self.loader_workers < -1:
            raise UsageError("--loader-workers must be -1 (auto) or a count >= 0")

    # Derived values: computed, never stored, so a dict round-trip cannot make them stale.
    def per_worker_batch(self, world_size: int) -> int:
        if self.batch_mode == "per-worker":
            return self.batch_size
        if self.batch_size < world_size:
            raise UsageError(f"--batch-size {self.batch_size} (global) is smaller than the "
                             f"{world_size} workers; raise it or use --batch-mode per-worker")
        return self.batch_size // world_size

    def global_batch(self, world_size: int) -> int:
        return self.per_worker_batch(world_size) * world_size

    def scaled_lr(self, world_size: int) -> float:
        return self.lr * self.global_batch(world_size) / self.lr_ref_batch

    def run_dir(self) -> str:
        """<storage-path>/<name>; absolute once `with_resolved_paths` has run on the driver."""
        return join_path(self.storage_path, self.name)

    def with_resolved_paths(self, cwd: Optional[str] = None) -> TrainConfig:
        """The same config with every path field made absolute against the user's directory.

        Ray workers run in their own working directory, so a relative path means something else
        there: the driver calls this once, before the config leaves it (and before config.json).
        """
        return dataclasses.replace(self, **{
            name: resolve_path(getattr(self, name), cwd) for name in PATH_FIELDS})

    def default_name(self) -> str:
        """ray_job_<data>_<model>_<hash of what the run computes>: the same command names the same
        run, so running it again continues it (or says it is finished). Where the run is written,
        how it is watched and how long it goes on (--epochs: more of them extend the run) are left
        out of the hash."""
        import hashlib

        ignore = {"name", "storage_path", "address", "progress", "log_every", "epochs",
                  "max_failures", "keep_checkpoints", "retry_storage_s", "min_workers",
                  "resource_wait_s", "checkpoint_every_min", "collective_timeout_s"}
        what = {k: v for k, v in sorted(self.to_dict().items()) if k not in ignore}
        # fields added later count only when set, so the names of existing runs stay the same
        what = {k: v for k, v in what.items() if not (k in ADDED_FIELDS and v == ADDED_FIELDS[k])}
        digest = hashlib.sha1(json.dumps(what, sort_keys=True).encode()).hexdigest()[:8]
        return f"ray_job_{self.data}_{self.model}_{digest}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False)


# Presets change defaults only; flags given on the command line are applied on top.
RECIPES: dict[str, dict[str, Any]] = {
    "default": {},
    "fast": dict(stem="cifar", label_smoothing=0.1, schedule="onecycle", warmup_epochs=2.0,
                 decay_norm_bias=False, batch_size=1024, lr=0.2, lr_ref_batch=256,
                 weight_decay=5e-4, epochs=24),
}


def _flag(name: str) -> str:
    return name.replace("_", "-")


def is_uri(path: str) -> bool:
    """s3://bucket/key and other pyarrow.fs URIs: never resolved against a local directory."""
    return "://" in path


def resolve_path(path: str, cwd: Optional[str] = None) -> str:
    """The one place a path given by the user becomes absolute ('' and URIs stay as they are)."""
    if not path or is_uri(path):
        return path
    path = os.path.expanduser(path)
    return os.path.normpath(os.path.join(cwd or os.getcwd(), path))


def join_path(base: str, *parts: str) -> str:
    """os.path.join for local paths, '/'-join for URIs."""
    if is_uri(base):
        return "/".join([base.rstrip("/"), *parts])
    return os.path.join(base, *parts)


@dataclass(frozen=True)
class Speed:
    """Device and numerics of a worker, decided in one place from the config and the hardware."""

    cuda: bool
    bf16: bool
    channels_last: bool

    @classmethod
    def choose(cls, precision: str, channels_last: str, use_gpu: Optional[bool],
               cuda_available: bool) -> Speed:
        cuda = bool(use_gpu) and cuda_available
        bf16 = precision == "bf16" or (precision == "auto" and cuda)
        nhwc = channels_last == "on" or (channels_last == "auto" and cuda)
        return cls(cuda, bf16, nhwc)

    @classmethod
    def of(cls, cfg: TrainConfig, cuda_available: bool) -> Speed:
        return cls.choose(cfg.precision, cfg.channels_last, cfg.use_gpu, cuda_available)


def choose_use_gpu(requested: Optional[bool], cluster_gpus: float) -> bool:
    """--use-gpu / --no-use-gpu as given, else yes exactly when the cluster has GPUs."""
    if requested and cluster_gpus == 0:
        raise UsageError("--use-gpu was given but the Ray cluster has no GPUs; drop it or use --no-gpu")
    return requested if requested is not None else cluster_gpus > 0
