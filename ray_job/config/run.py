"""The one typed configuration of a training run.

Every `train` flag is a field of `TrainConfig` (same name, `-` for `_`); the CLI is generated from the
fields, their defaults and their `help` metadata, so the two cannot drift apart. The config is frozen,
printed once at start, saved beside the results, and sent to the workers as a dict.

A field marked `affects_result=False` changes nothing a run computes (where it waits, how it is
watched, how it survives faults): the default run name and the scaling sweep's reuse of finished
points both leave exactly those fields out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Optional

from ..core.errors import UsageError
from ..core.flags import option
from ..core.paths import join_path, resolve_path
from .families import AUTO_LR, is_resnet_family, is_transformer, model_label

RESNETS = ("resnet18", "resnet34", "resnet50")  # the raw-DDP baseline's and the benchmarks' models
STEMS = ("cifar", "imagenet")
OPTIMIZERS = ("auto", "sgd", "adamw")
DATASETS = ("cifar10", "imagefolder", "prepared", "synthetic")
LOADERS = ("auto", "fast", "torchvision")
PRECISIONS = ("auto", "bf16", "fp32")
SCHEDULES = ("onecycle", "cosine", "constant")
BATCH_MODES = ("global", "per-worker")
GRAD_COMPRESSIONS = ("none", "bf16")
STRATEGIES = ("ddp", "fsdp", "hsdp")
TRISTATE = ("auto", "on", "off")
PROGRESS = ("auto", "bar", "lines")
# Fields added after runs were named by default_name(), with their defaults: they count only when set.
ADDED_FIELDS = {"image_size": 32, "model_arg": [], "init_weights": "", "optimizer": "sgd"}
# Fields that name files or folders: resolved once, on the driver (see `resolve_path`).
PATH_FIELDS = ("data_dir", "storage_path", "resume_from", "init_weights", "code_dir")
# What each --data reads of the data fields (the rest does not change the run).
UNREAD_BY_DATA = {"synthetic": ("data_dir", "download"),
                  "cifar10": ("synthetic_train_size", "synthetic_test_size"),
                  "imagefolder": ("synthetic_train_size", "synthetic_test_size", "download"),
                  "prepared": ("synthetic_train_size", "synthetic_test_size", "download")}


def _opt(default: Any, help: str, group: str, **kw: Any) -> Any:
    return option(default, help, group=group, **kw)


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides what a run computes and where it goes."""

    # --- cluster ---
    address: Optional[str] = _opt(
        None, "Ray cluster to join (HOST:PORT or 'auto'); default: $RAY_ADDRESS, else start a local Ray "
        "cluster in this process", "cluster", affects_result=False)
    num_workers: int = _opt(0, "training workers (one DDP rank each); 0 = one per GPU in the cluster, or 1 "
                            "without GPUs", "cluster")
    min_workers: int = _opt(
        0, "elastic: when nodes are lost, go on with as few as N workers, and grow back to --num-workers when "
        "capacity returns (each resize restarts the group from the latest checkpoint; the batch rule of "
        "--batch-mode applies to the new world size; below N workers for longer than --resource-wait-s the "
        "driver exits 5); 0 = a fixed size", "cluster", affects_result=False)
    grow_check_s: float = _opt(60.0, "elastic: how often Ray Train looks whether more workers fit again "
                               "(a node back), to grow the group to them", "cluster", affects_result=False)
    use_gpu: Optional[bool] = _opt(None, "train on GPUs (default: yes when the cluster has GPUs)", "cluster",
                                   bool_flag=True, negative_alias="--no-gpu")
    cpus_per_worker: float = _opt(1.0, "CPUs reserved per worker (also its torch thread count)", "cluster")
    gpus_per_worker: float = _opt(1.0, "GPUs per worker when --use-gpu (0.5 = two workers share a GPU; they "
                                  "then talk over gloo, since NCCL refuses two ranks on one GPU)", "cluster")
    # --- schedule and optimisation ---
    recipe: str = _opt("default", "preset of defaults: 'fast' = CIFAR stem, label smoothing 0.1, one-cycle "
                       "LR, no weight decay on norms/biases, global batch 1024 (flags you give still win)",
                       "optimisation", choices=("default", "fast"))
    epochs: int = _opt(30, "epochs to train (more epochs on an existing run extend it)", "optimisation")
    batch_size: int = _opt(128, "batch size; its meaning is set by --batch-mode", "optimisation")
    batch_mode: str = _opt("global", "'global': --batch-size is split across workers (the raw-DDP baseline's "
                           "fixed 128); 'per-worker': each worker takes --batch-size", "optimisation",
                           choices=BATCH_MODES)
    optimizer: str = _opt("auto", "sgd (Nesterov momentum) or adamw; auto = adamw for transformers (ViT, Swin, "
                          "MaxViT), sgd for the rest", "optimisation", choices=OPTIMIZERS)
    lr: float = _opt(0.0, "peak learning rate for a global batch of --lr-ref-batch; scaled linearly with the "
                     "real global batch; 0 = auto: 0.1 for sgd, 0.001 for adamw", "optimisation")
    lr_ref_batch: int = _opt(128, "global batch at which --lr applies unscaled", "optimisation")
    warmup_epochs: float = _opt(1.0, "linear LR warmup length in epochs", "optimisation")
    schedule: str = _opt("cosine", "LR after warmup: cosine decay to 0, onecycle (linear up, linear down), "
                         "or constant", "optimisation", choices=SCHEDULES)
    momentum: float = _opt(0.9, "SGD momentum (Nesterov; adamw: unused)", "optimisation")
    weight_decay: float = _opt(5e-4, "weight decay", "optimisation")
    decay_norm_bias: bool = _opt(True, "apply weight decay to norm weights and biases too "
                                 "(--no-decay-norm-bias exempts them)", "optimisation", bool_flag=True)
    label_smoothing: float = _opt(0.0, "label smoothing of the cross-entropy loss", "optimisation")
    steps_per_epoch: int = _opt(0, "cap on optimizer steps per epoch (0 = the whole epoch); for benchmarks "
                                "and scaling sweeps", "optimisation")
    seed: int = _opt(0, "random seed (model init, synthetic data, shuffling)", "optimisation")
    # --- model ---
    model: str = _opt("resnet50", "any torchvision image classifier, by builder (resnet50, wide_resnet50_2, "
                      "resnext50_32x4d, regnet_y_400mf, convnext_tiny, efficientnet_b0, efficientnet_v2_s, "
                      "mobilenet_v3_large, densenet121, vit_b_16, swin_t, maxvit_t, ...: torchvision."
                      "models.list_models()) or class (VisionTransformer, with --model-arg), one output per "
                      "class; or your own: pkg.module:function or ./file.py:function (docs/models.md)",
                      "model")
    model_arg: tuple = _opt((), "KEY=VALUE: a constructor option of the model (repeat for more), e.g. "
                            "patch_size=4; VALUE is a Python literal or a string (default: no options)", "model",
                            repeat=True)
    code_dir: str = _opt(".", "the folder your own --model is imported from, on every worker (on a shared "
                         "file system for multi-node clusters; `ray job submit --working-dir` ships it)",
                         "model", affects_result=False)
    init_weights: str = _opt("", "start from these weights: a state dict file (a torchvision weights file, a "
                             "checkpoint.pt of a run), local or s3://; tensors whose name and shape fit "
                             "are loaded, the rest (a head of another size) start new", "model")
    stem: str = _opt("auto", "ResNet family only (auto = cifar). 'cifar': 3x3 stride-1 first conv, no max-pool: "
                     "full 32x32 resolution, ~16x the FLOPs of 'imagenet' (ResNet-50: 2.6 vs 0.17 GFLOPs per "
                     "image forward), reaches ~95%% on CIFAR-10; 'imagenet': 7x7 stride-2 conv + max-pool: 8x "
                     "downsampled at once, very fast, tops out near 85%%", "model", choices=("auto", *STEMS))
    # --- sharding (ray_job/model/sharding.py; docs/sharded.md) ---
    strategy: str = _opt("ddp", "ddp: every worker holds the whole model, its gradients and optimizer state; "
                         "fsdp: all three sharded over the workers (PyTorch FSDP2, fully_shard); hsdp: sharded "
                         "within a node, replicated across nodes. The same run continues under another "
                         "strategy or worker count", "sharding", choices=STRATEGIES, affects_result=False)
    activation_checkpointing: bool = _opt(False, "recompute each block's activations in the backward pass "
                                          "instead of keeping them (less memory, ~1/3 more compute)",
                                          "sharding", bool_flag=True, affects_result=False)
    cpu_offload: bool = _opt(False, "fsdp/hsdp on GPUs: keep the sharded parameters, gradients and optimizer "
                             "state in host memory (FSDP2's CPU offload)", "sharding", bool_flag=True,
                             affects_result=False)
    memory_per_worker_gb: float = _opt(0.0, "memory one worker may use in GiB, for the memory plan checked and "
                                       "printed at start (0 = the GPU's memory, or without GPUs the node's Ray "
                                       "memory divided by its workers)", "sharding", affects_result=False)
    # --- data ---
    data: str = _opt("cifar10", "cifar10 (torchvision's cifar-10-batches-py under --data-dir, downloaded if "
                     "missing), imagefolder (DIR/train/<class>/*, DIR/test/<class>/*; prepared once into "
                     "DIR/.ray_job_prepared), prepared (the output of `prepare-data --from ...`), or "
                     "synthetic (generated in memory, learnable, no files)", "data", choices=DATASETS)
    data_dir: str = _opt("./data", "dataset folder (must be readable on every node); for --data prepared "
                         "also s3://BUCKET/PREFIX, staged once per node into $RJ_DATA_CACHE (default "
                         "~/.cache/ray_job/data)", "data")
    image_size: int = _opt(32, "side of the square images the model sees (--data prepared / imagefolder): "
                           "images of this size stored raw take the fast path (pad-4 crop + flip on the "
                           "device); others are resized in the DataLoader workers (train: random resized "
                           "crop + flip; test: resize + center crop)", "data")
    download: bool = _opt(True, "download CIFAR-10 when missing (once per node, under a file lock); "
                          "--no-download on nodes without internet fails at once instead", "data",
                          bool_flag=True)
    synthetic_train_size: int = _opt(1024, "images in the synthetic train split", "data")
    synthetic_test_size: int = _opt(256, "images in the synthetic test split", "data")
    loader: str = _opt("auto", "'fast': dataset held once as uint8, one indexing op per batch, crop/flip/"
                       "normalise on the device; 'torchvision': PIL transforms per sample (the raw-DDP "
                       "baseline's pipeline); auto = fast", "data", choices=LOADERS)
    loader_workers: int = _opt(-1, "DataLoader worker processes per training worker; -1 = 0 for the fast "
                               "loader, 2 where images are decoded or resized on the CPU (torchvision, "
                               "prepared data not at --image-size)", "data")
    # --- speed ---
    precision: str = _opt("auto", "bf16 autocast with fp32 master weights, or fp32; auto = bf16 on a GPU "
                          "that has it (compute capability 8.0+), else fp32", "speed", choices=PRECISIONS)
    channels_last: str = _opt("auto", "NHWC memory format; auto = on for GPU", "speed", choices=TRISTATE)
    compile: bool = _opt(False, "torch.compile the model (slow first epoch, faster steps)", "speed",
                         bool_flag=True)
    ddp_bucket_mb: int = _opt(25, "DDP gradient bucket size in MiB", "speed")
    grad_compression: str = _opt("none", "DDP communication hook: bf16 halves all-reduce bytes (multi-node)",
                                 "speed", choices=GRAD_COMPRESSIONS)
    sync_timing: bool = _opt(False, "synchronise the GPU around each step phase so the data / forward-"
                             "backward / optimizer split is exact (a little slower; `scale` turns it on)",
                             "speed", bool_flag=True)
    measure_comm_wait: bool = _opt(False, "after the first epoch, measure how long a step waits for DDP's "
                                   "gradient all-reduce (comm_wait_s_per_step in metrics.jsonl; `scale` turns "
                                   "it on)", "speed", bool_flag=True, affects_result=False)
    # --- results, checkpoints, fault tolerance ---
    storage_path: str = _opt("./results", "where runs are written: a folder (on a shared file system for "
                             "multi-node clusters), or object storage: s3://BUCKET/PREFIX (AWS or S3-"
                             "compatible; settings from AWS_ENDPOINT_URL_S3, AWS_REGION, AWS_ACCESS_KEY_ID/"
                             "AWS_SECRET_ACCESS_KEY or AWS_PROFILE) or another pyarrow.fs URI", "results")
    name: str = _opt("", "run name; a run with an existing name continues from its latest checkpoint "
                     "(default: ray_job_<data>_<model>_<hash of what the run computes>, so the same command "
                     "continues the same run)", "results")
    resume_from: str = _opt("", "start a new run from this checkpoint (directory or checkpoint.pt)", "results")
    max_failures: int = _opt(2, "worker-group restarts (from the last checkpoint) before giving up", "results",
                             affects_result=False)
    resource_wait_s: float = _opt(600.0, "how long to wait for the cluster to hold the workers (at start, "
                                  "after a lost node, or below --min-workers); then the driver exits 5, saving "
                                  "nothing new (slurm_ray_start.sh requeues the job)", "results",
                                  affects_result=False)
    checkpoint_every_min: float = _opt(0.0, "also checkpoint every M minutes, at a step every rank agrees on, "
                                       "so a long epoch loses at most M minutes (0 = at epoch ends only)",
                                       "results", affects_result=False)
    collective_timeout_s: float = _opt(600.0, "a collective (DDP's all-reduce) stuck this long fails the step "
                                       "instead of hanging; the group then restarts from the latest "
                                       "checkpoint", "results", affects_result=False)
    keep_checkpoints: int = _opt(2, "checkpoints to keep, best by test accuracy", "results",
                                 affects_result=False)
    async_checkpoints: bool = _opt(True, "write and upload checkpoints in the background (the step waits "
                                   "only for a copy of the state in host memory); --no-async-checkpoints "
                                   "writes them before training goes on", "results", bool_flag=True,
                                   affects_result=False)
    retry_storage_s: float = _opt(120.0, "seconds to keep retrying the last checkpoint (end of the run or a "
                                  "stop request) and the run files while the storage fails; a checkpoint in "
                                  "between that cannot be saved is skipped and training goes on", "results",
                                  affects_result=False)
    log_every: int = _opt(10, "rank 0 prints a progress line every N steps, and at least every 10 s (0 = "
                          "epoch lines only)", "results", affects_result=False)
    progress: str = _opt("auto", "progress display: a live bar (on a terminal), or plain lines (SLURM logs, "
                         "`ray job logs`); auto = bar when the driver's stdout is a terminal", "results",
                         choices=PROGRESS, affects_result=False)
    # --- experiment tracking (ray_job/tracking; docs/tracking.md) ---
    mlflow: bool = _opt(False, "track the run in MLflow: params, per-epoch metrics, tags, the run files and the "
                        "best checkpoint's model; a resumed run continues its MLflow run", "tracking",
                        bool_flag=True, affects_result=False)
    mlflow_uri: str = _opt("", "MLflow tracking URI (http(s)://HOST:PORT of a tracking server, or sqlite:///FILE); "
                           "default: $MLFLOW_TRACKING_URI, else sqlite:///<storage-path>/mlflow.db (no server). "
                           "Credentials only in MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN",
                           "tracking", affects_result=False)
    mlflow_experiment: str = _opt("ray_job", "MLflow experiment (created when missing)", "tracking",
                                  affects_result=False)
    mlflow_register: str = _opt("", "also register the best checkpoint's model under this name in MLflow's "
                                "model registry (a new version per finished run)", "tracking",
                                affects_result=False)

    def __post_init__(self) -> None:
        from .checks import check

        check(self)

    # Derived values: computed, never stored, so a dict round-trip cannot make them stale.
    def per_worker_batch(self, world_size: int) -> int:
        if self.batch_mode == "per-worker":
            return self.batch_size
        if self.batch_size < world_size:
            raise UsageError(f"--batch-size {self.batch_size} (global) is smaller than the "
                             f"{world_size} workers; raise it or use --batch-mode per-worker")
        return self.batch_size // world_size

    @property
    def gpus_in_use(self) -> float:
        """GPUs each worker holds: --gpus-per-worker when the run trains on GPUs, else none."""
        return self.gpus_per_worker if self.use_gpu else 0

    @property
    def stem_in_use(self) -> str:
        """The stem the model is built with: 'none' outside the ResNet family; auto = cifar."""
        return "none" if not is_resnet_family(self.model) else "cifar" if self.stem == "auto" else self.stem

    @property
    def optimizer_in_use(self) -> str:
        return self.optimizer if self.optimizer != "auto" else "adamw" if is_transformer(self.model) else "sgd"

    @property
    def lr_in_use(self) -> float:
        """--lr, or the optimizer's own (AUTO_LR) for --lr 0."""
        return self.lr or AUTO_LR[self.optimizer_in_use]

    def global_batch(self, world_size: int) -> int:
        return self.per_worker_batch(world_size) * world_size

    def scaled_lr(self, world_size: int) -> float:
        return self.lr_in_use * self.global_batch(world_size) / self.lr_ref_batch

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

    def result_fields(self) -> dict:
        """The fields that change what this run computes (`affects_result`), by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.metadata.get("affects_result", True)}

    def computed(self, weights_sha256: str = "") -> dict:
        """What this run computes, by field: the `affects_result` fields but where the run is written,
        under which name and what this --data does not read; auto values as what they resolve to;
        --init-weights by its content (`weights_sha256`) when the driver has read it; fields added
        later only when set, so runs named before them keep their names."""
        unread = {"name", "storage_path", *UNREAD_BY_DATA[self.data]}
        what = {k: v for k, v in sorted(self.result_fields().items()) if k not in unread}
        what.update(stem=self.stem_in_use, optimizer=self.optimizer_in_use, lr=self.lr_in_use,
                    model_arg=list(self.model_arg), init_weights=weights_sha256 or self.init_weights)
        return {k: v for k, v in what.items()
                if not (k in ADDED_FIELDS and v == ADDED_FIELDS[k]) and not (k == "stem" and v == "none")}

    def default_name(self, weights_sha256: str = "") -> str:
        """ray_job_<data>_<model>_<hash of what the run computes>: the same command names the same
        run in any folder, so running it again continues it (or says it is finished). The hash
        leaves out how long it goes on (--epochs: more of them extend the run)."""
        what = {k: v for k, v in self.computed(weights_sha256).items() if k != "epochs"}
        digest = hashlib.sha1(json.dumps(what, sort_keys=True).encode()).hexdigest()[:8]
        return f"ray_job_{self.data}_{model_label(self.model)}_{digest}"

    @classmethod
    def from_saved(cls, saved: dict) -> TrainConfig:
        """The config of a config.json or a checkpoint, of this version or an earlier one (fields it
        lacks take their defaults; fields it has that are gone are left out)."""
        return cls(**{f.name: saved[f.name] for f in dataclasses.fields(cls) if f.name in saved})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False)


# Presets change defaults only; flags given on the command line are applied on top.
RECIPES: dict[str, dict[str, Any]] = {
    "default": {},
    "fast": dict(label_smoothing=0.1, schedule="onecycle", warmup_epochs=2.0,
                 decay_norm_bias=False, batch_size=1024, lr=0.2, lr_ref_batch=256,
                 weight_decay=5e-4, epochs=24),
}
