"""What one worker trains with, built once from the config: loaders, model, the step machinery, the
`Run` record, and the run log lines (topology, the announcement, each epoch's global metrics). Ray
appears only as get_context and as the default `Placement` (prepare_model, prepare_data_loader)."""

from __future__ import annotations

import logging
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from .. import storage
from ..cluster import raypriv
from ..config import Speed, TrainConfig
from ..data.augment import return_large_allocations
from ..data.datasets import Datasets
from ..model.parts import gradient_bytes, unwrap
from ..model.setup import model_and_optimizer
from .checkpointer import Resume
from .engine import EpochStats, EpochSteps, global_sums, peak_rss_gib
from .metrics import EpochMetrics
from .runfiles import TOPOLOGY_JSON, Event
from .runlog import RunLog

log = logging.getLogger("ray_job")
EVAL_BATCH = 1024


@dataclass(frozen=True)
class Worker:
    """This process in the group. The master process (rank 0) alone writes the run folder and logs
    at INFO; every rank trains and reports."""

    rank: int
    world: int
    per_node: int = 1  # workers on this worker's node (hsdp shards within a node)

    @property
    def master_process(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class Placement:
    """How the model and the loaders reach the device: Ray Train's prepare_* (`ray_placement`), or
    by hand where there is no Ray (a test's process group)."""

    model: Callable[..., Any]          # (model, **DDP kwargs) -> on the device, in DDP when world > 1
    loader: Callable[[Any, bool], Any]  # (loader, add a DistributedSampler) -> batches on the device
    to_device: Callable[[Any], Any] = lambda model: model  # (model) -> on the device, unwrapped (to shard)


def ray_placement() -> Placement:
    return Placement(lambda model, **ddp: ray.train.torch.prepare_model(model, parallel_strategy_kwargs=ddp),
                     lambda loader, shard: ray.train.torch.prepare_data_loader(loader, add_dist_sampler=shard),
                     lambda model: ray.train.torch.prepare_model(model, parallel_strategy=None))


def setup_logging(worker: Worker) -> None:
    """One timestamped format with the rank; the master process logs at INFO, the others only
    per-worker lines."""
    root = logging.getLogger("ray_job")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {worker.rank}] %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
        root.propagate = False
    log.setLevel(logging.INFO if worker.master_process else logging.WARNING)
    # Ray logs every report's full metrics dict from every rank; our epoch line says it once.
    try:
        logging.getLogger(raypriv.train_context_logger_name()).setLevel(logging.WARNING)
    except raypriv.PrivateAPIMoved as e:  # only noise is at stake
        log.warning("%s", e)


def run_store(cfg: TrainConfig) -> storage.Location:
    """The run folder on the filesystem Ray was given (RunConfig.storage_filesystem), without the
    retries wrapped around it for Ray's own files: rank 0's files keep their own policy."""
    ctx = ray.train.get_context().get_storage()
    return storage.Location(storage.unwrap(ctx.storage_filesystem), ctx.experiment_fs_path, cfg.run_dir())


def make_loaders(cfg: TrainConfig, data: Datasets, worker: Worker, use_cuda: bool, place: Placement):
    # per-sample CPU work (decoding, resizing, PIL transforms) runs in DataLoader worker processes
    workers = cfg.loader_workers if cfg.loader_workers >= 0 else (2 if data.cpu_work else 0)
    common = dict(num_workers=workers, pin_memory=use_cuda, persistent_workers=workers > 0)
    if workers:
        return_large_allocations()
    train_ds, test_ds = data.train, data.test
    train = DataLoader(train_ds, batch_size=cfg.per_worker_batch(worker.world), shuffle=True,
                       drop_last=True, collate_fn=train_ds.collate_fn, **common)
    # Test shards without DistributedSampler's padding, so every image is counted exactly once.
    test = DataLoader(test_ds, batch_size=EVAL_BATCH, sampler=range(worker.rank, len(test_ds), worker.world),
                      collate_fn=test_ds.collate_fn, **common)
    return place.loader(train, True), place.loader(test, False)


def gather(obj: Any, world: int) -> list:
    """`obj` of every rank, in rank order, on every rank."""
    if world == 1:
        return [obj]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, obj)
    return everyone


@dataclass
class Run:
    """What one worker trains with. `worker.master_process` alone decides the side effects (files, logs)."""

    cfg: TrainConfig
    worker: Worker
    model: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_loader: Any
    test_loader: Any
    device: torch.device
    speed: Speed
    steps_per_epoch: int
    steps: EpochSteps        # the training step, with the model, optimizer, schedule, loss, preprocessing
    data_what: str           # the data path, for the run log
    classes: tuple           # the class names in the model's output order (kept in checkpoints)
    store: storage.Location  # the run folder
    files: Optional[RunLog]  # the master process's writer of the run folder; None elsewhere

    def state(self, epoch: int, step: int, metrics: Optional[EpochMetrics]) -> dict:
        """Keyword arguments of save_checkpoint for this position."""
        return dict(model=unwrap(self.model), optimizer=self.optimizer,
                    config=self.cfg.to_dict(), world_size=self.worker.world, epoch=epoch, step=step,
                    metrics=metrics.to_dict() if metrics else {}, classes=self.classes)


def log_topology(run: Run, backend: str) -> None:
    ctx = ray.train.get_context()
    me = dict(rank=ctx.get_world_rank(), local_rank=ctx.get_local_rank(), node_rank=ctx.get_node_rank(),
              hostname=socket.gethostname(), node_ip=ray.util.get_node_ip_address(),
              node_id=ray.get_runtime_context().get_node_id(),
              pid=os.getpid(), device=str(run.device))
    logging.getLogger("ray_job.worker").warning(
        "worker rank %(rank)d: node %(node_rank)d (%(hostname)s %(node_ip)s) local rank "
        "%(local_rank)d device %(device)s pid %(pid)d", me)
    everyone = gather(me, run.worker.world)
    if not run.worker.master_process:
        return
    nodes = sorted({w["node_id"] for w in everyone})  # Ray nodes, even when they share an IP
    master = f"{os.environ.get('MASTER_ADDR', everyone[0]['node_ip'])}:{os.environ.get('MASTER_PORT', '?')}"
    log.info("topology: world size %d on %d node(s), backend %s, master %s", len(everyone),
             len(nodes), backend, master)
    for w in everyone:
        log.info("  rank %(rank)d -> %(hostname)s (%(node_ip)s) local rank %(local_rank)d %(device)s", w)
    run.files.write_json(TOPOLOGY_JSON, dict(world_size=len(everyone), num_nodes=len(nodes),
                                             backend=backend, master=master, workers=everyone))


def epoch_metrics(run: Run, epoch: int, train: EpochStats, test: EpochStats,
                  comm_wait: Optional[float]) -> EpochMetrics:
    """Global metrics of one epoch: counts are summed over all ranks; times are rank 0's."""
    loss, correct, count, tloss, tcorrect, tcount = global_sums(
        [train.loss_sum, train.correct, train.count, test.loss_sum, test.correct, test.count],
        run.device)
    steady = train.step_times[min(len(train.step_times) - 1, 2):] if train.step_times else []
    cuda = run.device.type == "cuda"
    return EpochMetrics(
        epoch=epoch + 1, epochs=run.cfg.epochs, train_loss=loss / max(count, 1),
        train_acc=correct / max(count, 1), test_loss=tloss / max(tcount, 1),
        test_acc=tcorrect / max(tcount, 1), test_images=int(tcount), train_images=int(count),
        epoch_s=train.wall_s + test.wall_s, train_s=train.wall_s, eval_s=test.wall_s,
        images_per_s=count / max(train.wall_s, 1e-9), data_s=train.data_s,
        compute_s=train.wall_s - train.data_s, fwd_bwd_s=train.fwd_bwd_s, optim_s=train.optim_s,
        steps=train.steps, lr=run.optimizer.param_groups[0]["lr"], world_size=run.worker.world,
        time=time.time(), peak_host_mem_gib=peak_rss_gib(),
        grad_bytes=gradient_bytes(unwrap(run.model)),
        # skip the first steps (allocation, autotuning); the median resists noisy neighbours
        steady_images_per_s=(run.cfg.global_batch(run.worker.world) / statistics.median(steady)
                             if steady else None),
        peak_gpu_mem_gib=torch.cuda.max_memory_allocated(run.device) / 2**30 if cuda else None,
        comm_wait_s_per_step=comm_wait)


def announce(run: Run, resume: Resume) -> None:
    cfg = run.cfg
    run.files.keep_epochs_up_to(resume.epoch)
    if resume.state is not None:
        run.files.event(Event.RESUMED, epoch=resume.epoch, step=resume.step, world_size=run.worker.world)
        before = resume.state.get("world_size")
        if before and before != run.worker.world:  # an elastic resize, or a rerun with another size
            run.files.event(Event.WORLD_SIZE_CHANGED, before=before, after=run.worker.world,
                            batch_mode=cfg.batch_mode, global_batch=cfg.global_batch(run.worker.world),
                            lr=cfg.scaled_lr(run.worker.world))
            log.info("world size changed %d -> %d; --batch-mode %s: global batch %d -> %d (%d per "
                     "worker), peak lr %.4g -> %.4g; %s", before, run.worker.world, cfg.batch_mode,
                     cfg.global_batch(before), cfg.global_batch(run.worker.world),
                     cfg.per_worker_batch(run.worker.world), cfg.scaled_lr(before), cfg.scaled_lr(run.worker.world),
                     f"epoch {resume.epoch + 1} is redone from its start (another global batch: the "
                     f"steps done would not cover the same images)" if resume.state.get("step") and not resume.step
                     else f"training continues at epoch {resume.epoch + 1} step {resume.step}")
    model = cfg.model + (f" ({cfg.stem_in_use} stem)" if cfg.stem_in_use != "none" else "")
    log.info("training %s on %d worker(s): %d steps/epoch, global batch %d (%d per worker, "
             "--batch-mode %s), %s, %s peak lr %.4g, %s, data: %s", model, run.worker.world,
             run.steps_per_epoch, cfg.global_batch(run.worker.world), cfg.per_worker_batch(run.worker.world),
             cfg.batch_mode, strategy_words(cfg), cfg.optimizer_in_use, cfg.scaled_lr(run.worker.world),
             "bf16" if run.speed.bf16 else "fp32", run.data_what)


def strategy_words(cfg: TrainConfig) -> str:
    """--strategy and its options, as the run log says them."""
    extra = [w for w, on in (("activation checkpointing", cfg.activation_checkpointing),
                             ("CPU offload", cfg.cpu_offload)) if on]
    return cfg.strategy + (f" ({', '.join(extra)})" if extra else "")


def build_run(cfg: TrainConfig, data: Datasets, resume: Resume, worker: Worker, store: storage.Location,
              files: Optional[RunLog], place: Placement) -> Run:
    """Loaders, model (placed, wrapped, restored), optimizer, the LR schedule at the resumed
    position and the training step: everything a worker trains with."""
    from .checkpoint import restore_training_state
    from ..model.optim import build_scheduler

    speed = Speed.of(cfg, torch.cuda.is_available())
    if speed.cuda:
        torch.backends.cudnn.benchmark = True
    train_loader, test_loader = make_loaders(cfg, data, worker, speed.cuda, place)
    model, optimizer = model_and_optimizer(cfg, data.num_classes, speed, worker.world, place.model,
                                           fresh=resume.state is None, per_node=worker.per_node,
                                           to_device=place.to_device)
    device = next(model.parameters()).device
    steps = len(train_loader) if not cfg.steps_per_epoch else min(cfg.steps_per_epoch, len(train_loader))
    if resume.state is not None:  # the schedule is placed by position below, not by its state
        restore_training_state(resume.state, model=model, optimizer=optimizer)
    for group in optimizer.param_groups:  # the peak LR of *this* world size, not the checkpoint's
        group["lr"] = group["initial_lr"] = cfg.scaled_lr(worker.world)
    scheduler = build_scheduler(optimizer, cfg, steps, start_step=resume.epoch * steps + resume.step)
    step = EpochSteps(model, optimizer, scheduler, torch.nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing),
                      preprocess_for(data.device_augment, device, speed.channels_last), device, speed.bf16,
                      cfg.sync_timing)
    return Run(cfg, worker, model, optimizer, scheduler, train_loader, test_loader, device, speed, steps, step,
               data.what, data.classes, store, files)


def preprocess_for(device_augment: str, device: torch.device, channels_last: bool):
    """What a batch goes through on the device (Datasets.device_augment): crop/flip/normalise, or
    normalise only."""
    from ..data.augment import DeviceAugment

    if device_augment != "none":
        return DeviceAugment(device, channels_last, crop=device_augment == "crop")
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    return lambda x, train: x.contiguous(memory_format=memory_format)
