"""The per-worker training function that TorchTrainer runs on every rank.

Ray appears only where it must: prepare_model, prepare_data_loader, get_context (also for the run's
storage: the filesystem object the driver gave Ray, so workers need no credentials of their own),
get_checkpoint and report. Everything else is plain PyTorch from engine.py, data.py and
checkpoint.py, and the run folder is reached through storage.py (a local folder or object storage).

Storage faults: rank 0 copies each checkpoint to the run folder itself before `report`, so one that
cannot be saved (storage unreachable, disk full) is logged and skipped -- never reported, so never
taken as the latest -- and training goes on; the next checkpoint tries again, and the run files
catch up once the storage is back. The last checkpoint (end of run, stop request) is retried for up
to --retry-storage-s seconds; if it still fails, the run ends with that error and the same command
later resumes from the last checkpoint that was saved.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Optional

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from . import storage
from .checkpoint import (load_checkpoint, newest_saved_checkpoint, restore_training_state, save_checkpoint,
                         upload_checkpoint)
from .config import Speed, TrainConfig, UsageError
from .data import Datasets, DeviceAugment, load_datasets, return_large_allocations
from .engine import EpochStats, evaluate, global_sums, measure_comm_wait, peak_rss_gib, train_epoch
from .metrics import EpochMetrics
from .model import build_model, gradient_bytes, unwrap
from .optim import build_optimizer, build_scheduler
from .progress import Progress
from .runlog import TOPOLOGY_JSON, RunLog, finite
from .stop import StopPoller

log = logging.getLogger("ray_job")
EVAL_BATCH = 1024


def setup_logging(rank: int) -> None:
    """One timestamped format with the rank; rank 0 logs at INFO, the others only per-worker lines."""
    root = logging.getLogger("ray_job")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
        root.propagate = False
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    # Ray logs every report's full metrics dict from every rank; our epoch line says it once.
    # (that module names its logger by its file path, hence __file__).
    try:
        from ray.train.v2._internal.execution import context as ray_context

        logging.getLogger(ray_context.__file__).setLevel(logging.WARNING)
    except ImportError:  # another Ray layout: only noise is at stake
        pass


@dataclass
class Resume:
    epoch: int = 0           # finished epochs
    step: int = 0            # steps already done in the next epoch
    state: Optional[dict] = None


def run_store(cfg: TrainConfig) -> storage.Location:
    """The run folder on the filesystem Ray was given (RunConfig.storage_filesystem), without the
    retries wrapped around it for Ray's own files: rank 0's files keep their own policy."""
    ctx = ray.train.get_context().get_storage()
    return storage.Location(storage.unwrap(ctx.storage_filesystem), ctx.experiment_fs_path,
                            cfg.run_dir())


def find_resume_state(cfg: TrainConfig, world_size: int, store: storage.Location) -> Resume:
    """Ray's latest checkpoint of this run first, else --resume-from, else a fresh start."""
    checkpoint = ray.train.get_checkpoint()
    recorded = os.path.basename(checkpoint.path.rstrip("/")) if checkpoint is not None else None
    saved = newest_saved_checkpoint(store)
    if saved is not None and (recorded is None or saved > recorded):  # names sort by time
        log.info("resuming from %s: saved completely, but Ray has no record of it (the driver "
                 "stopped right after it was written)", saved)
        state = load_checkpoint(store.join(saved))
    elif checkpoint is not None:  # read by this worker itself, not through a shared download
        state = load_checkpoint(store.at_path(checkpoint.path))
    elif cfg.resume_from:
        state = load_checkpoint(cfg.resume_from, near=store)
    else:
        return Resume()
    # A mid-epoch position only makes sense with the same sharding; otherwise redo that epoch.
    same_world = state.get("world_size") == world_size
    return Resume(state["epoch"], state.get("step", 0) if same_world else 0, state)


def make_loaders(cfg: TrainConfig, data: Datasets, rank: int, world: int, use_cuda: bool):
    # per-sample CPU work (decoding, resizing, PIL transforms) runs in DataLoader worker processes
    workers = cfg.loader_workers if cfg.loader_workers >= 0 else (2 if data.cpu_work else 0)
    common = dict(num_workers=workers, pin_memory=use_cuda, persistent_workers=workers > 0)
    if workers:
        return_large_allocations()
    train_ds, test_ds = data.train, data.test
    train = DataLoader(train_ds, batch_size=cfg.per_worker_batch(world), shuffle=True,
                       drop_last=True, collate_fn=train_ds.collate_fn, **common)
    # Test shards without DistributedSampler's padding, so every image is counted exactly once.
    test = DataLoader(test_ds, batch_size=EVAL_BATCH, sampler=range(rank, len(test_ds), world),
                      collate_fn=test_ds.collate_fn, **common)
    train = ray.train.torch.prepare_data_loader(train)
    test = ray.train.torch.prepare_data_loader(test, add_dist_sampler=False)
    return train, test


def make_model(cfg: TrainConfig, num_classes: int, channels_last: bool):
    model = build_model(cfg.model, cfg.stem, num_classes)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    # Gradients as views into DDP's buckets save a copy per step; compiled backward graphs may
    # lay gradients out differently from the buckets, which would undo that, so not with --compile.
    model = ray.train.torch.prepare_model(model, parallel_strategy_kwargs=dict(
        gradient_as_bucket_view=not cfg.compile, bucket_cap_mb=cfg.ddp_bucket_mb))
    if cfg.grad_compression == "bf16" and hasattr(model, "register_comm_hook"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    return model


def first_error(error: Optional[str], world: int) -> Optional[str]:
    """The first rank's bad-input error, known to every rank (so all of them stop together)."""
    if world == 1:
        return error
    everyone: list = [None] * world
    dist.all_gather_object(everyone, error)
    return next((e for e in everyone if e), None)


@dataclass
class Run:
    """What one worker trains with. `is_rank0` alone decides the side effects (files, logs)."""

    cfg: TrainConfig
    model: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_loader: Any
    test_loader: Any
    device: torch.device
    speed: Speed
    world: int
    steps_per_epoch: int
    device_augment: str      # Datasets.device_augment: what the device does with a batch
    data_what: str           # the data path, for the run log
    is_rank0: bool
    store: storage.Location  # the run folder
    files: Optional[RunLog]  # rank 0's writer of the run folder; None elsewhere

    def state(self, epoch: int, step: int, metrics: Optional[EpochMetrics]) -> dict:
        """Keyword arguments of save_checkpoint for this position."""
        return dict(model=unwrap(self.model), optimizer=self.optimizer,
                    config=self.cfg.to_dict(), world_size=self.world, epoch=epoch, step=step,
                    metrics=metrics.to_dict() if metrics else {})


def log_topology(run: Run, backend: str) -> None:
    ctx = ray.train.get_context()
    me = dict(rank=ctx.get_world_rank(), local_rank=ctx.get_local_rank(), node_rank=ctx.get_node_rank(),
              hostname=socket.gethostname(), node_ip=ray.util.get_node_ip_address(),
              node_id=ray.get_runtime_context().get_node_id(),
              pid=os.getpid(), device=str(run.device))
    logging.getLogger("ray_job.worker").warning(
        "worker rank %(rank)d: node %(node_rank)d (%(hostname)s %(node_ip)s) local rank "
        "%(local_rank)d device %(device)s pid %(pid)d", me)
    everyone = [me]
    if run.world > 1:
        everyone = [None] * run.world
        dist.all_gather_object(everyone, me)
    if not run.is_rank0:
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
        steps=train.steps, lr=run.optimizer.param_groups[0]["lr"], world_size=run.world,
        time=time.time(), peak_host_mem_gib=peak_rss_gib(),
        grad_bytes=gradient_bytes(unwrap(run.model)),
        # skip the first steps (allocation, autotuning); the median resists noisy neighbours
        steady_images_per_s=(run.cfg.global_batch(run.world) / statistics.median(steady)
                             if steady else None),
        peak_gpu_mem_gib=torch.cuda.max_memory_allocated(run.device) / 2**30 if cuda else None,
        comm_wait_s_per_step=comm_wait)


def report(run: Run, metrics: dict, state: Optional[dict], last: bool = False) -> Optional[str]:
    """Every rank calls report (it is a barrier); only rank 0 saves a checkpoint and passes it.

    Rank 0 copies the checkpoint to the run folder first and reports it only once it is complete.
    One that cannot be saved is skipped (training goes on); the `last` one is retried for up to
    --retry-storage-s seconds, and its error is returned if it still fails."""
    checkpoint, error = None, None
    if run.is_rank0 and state is not None:
        checkpoint, error = save_to_storage(run, state, run.cfg.retry_storage_s if last else 0.0)
    ray.train.report(finite(metrics), checkpoint=checkpoint,
                     checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD)
    return error if last else None


def save_to_storage(run: Run, state: dict, wait_s: float) -> tuple[Optional[Any], Optional[str]]:
    """(the saved checkpoint for Ray, None) or (None, why it could not be saved)."""
    dest = run.store.join(ray.train.get_context().get_storage().make_default_checkpoint_dir_name())
    with tempfile.TemporaryDirectory() as d:
        save_checkpoint(d, **state)
        nbytes = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
        started = time.perf_counter()
        try:
            upload_checkpoint(d, dest, wait_s)
        except storage.StorageError as e:
            where = (f"epoch {state['epoch'] + 1} step {state['step']}" if state["step"]
                     else f"the end of epoch {state['epoch']}")
            log.warning("checkpoint at %s NOT saved: %s%s", where, e,
                        "" if wait_s else "; training goes on, the next checkpoint tries again")
            run.files.event("checkpoint_failed", epoch=state["epoch"], step=state["step"],
                            error=str(e))
            return None, f"the checkpoint at {where} was not saved: {e}"
    upload_s = time.perf_counter() - started
    run.files.event("checkpoint_saved", checkpoint=dest.uri.rsplit("/", 1)[-1], epoch=state["epoch"],
                    step=state["step"], bytes=nbytes, upload_s=upload_s)
    # on Ray's own filesystem object: a checkpoint it manages (keeps, deletes, hands back)
    return ray.train.Checkpoint(path=dest.path,
                                filesystem=ray.train.get_context().get_storage().storage_filesystem), None


def train_loop_per_worker(config: dict) -> dict:
    cfg = TrainConfig(**config)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    setup_logging(rank)
    torch.manual_seed(cfg.seed + rank)
    torch.set_num_threads(max(1, int(cfg.cpus_per_worker)))
    # Bad input found here (data, checkpoint) is no fault a restart fixes: every rank learns of
    # it before the first collective of DDP, and the run ends at once with the driver's error.
    error, data, resume = None, None, Resume()
    store = run_store(cfg)
    try:
        data = load_datasets(cfg)
        resume = find_resume_state(cfg, world, store)
    except UsageError as e:
        error = str(e)
    error = first_error(error, world)
    if error:
        return {"usage_error": error}

    speed = Speed.of(cfg, torch.cuda.is_available())
    if speed.cuda:
        torch.backends.cudnn.benchmark = True
    train_loader, test_loader = make_loaders(cfg, data, rank, world, speed.cuda)
    model = make_model(cfg, data.num_classes, speed.channels_last)
    device = next(model.parameters()).device
    steps_per_epoch = len(train_loader) if not cfg.steps_per_epoch else min(cfg.steps_per_epoch, len(train_loader))
    optimizer = build_optimizer(unwrap(model), cfg, world, device)
    if resume.state is not None:  # the schedule is placed by position below, not by its state
        restore_training_state(resume.state, model=model, optimizer=optimizer)
    for group in optimizer.param_groups:  # the peak LR of *this* world size, not the checkpoint's
        group["lr"] = group["initial_lr"] = cfg.scaled_lr(world)
    scheduler = build_scheduler(optimizer, cfg, steps_per_epoch,
                                start_step=resume.epoch * steps_per_epoch + resume.step)
    if cfg.compile:
        model = torch.compile(model)
    run = Run(cfg, model, optimizer, scheduler, train_loader, test_loader, device, speed, world,
              steps_per_epoch, data.device_augment, data.what, is_rank0=rank == 0, store=store,
              files=RunLog(store) if rank == 0 else None)
    log_topology(run, dist.get_backend() if dist.is_initialized() else "none (1 worker)")
    return fit_epochs(run, resume)


def announce(run: Run, resume: Resume) -> None:
    cfg = run.cfg
    run.files.keep_epochs_up_to(resume.epoch)
    if resume.state is not None:
        run.files.event("resumed", epoch=resume.epoch, step=resume.step)
        before = resume.state.get("world_size")
        if before and before != run.world:  # an elastic resize, or a rerun with another size
            cfg = run.cfg
            run.files.event("world_size_changed", before=before, after=run.world,
                            batch_mode=cfg.batch_mode, global_batch=cfg.global_batch(run.world),
                            lr=cfg.scaled_lr(run.world))
            log.info("world size changed %d -> %d; --batch-mode %s: global batch %d -> %d (%d per "
                     "worker), peak lr %.4g -> %.4g; epoch %d is redone from its start (the sampler "
                     "re-shards for %d workers)", before, run.world, cfg.batch_mode,
                     cfg.global_batch(before), cfg.global_batch(run.world),
                     cfg.per_worker_batch(run.world), cfg.scaled_lr(before), cfg.scaled_lr(run.world),
                     resume.epoch + 1, run.world)
    log.info("training %s/%s stem on %d worker(s): %d steps/epoch, global batch %d (%d per "
             "worker, --batch-mode %s), peak lr %.4g, %s, data: %s", cfg.model, cfg.stem, run.world,
             run.steps_per_epoch, cfg.global_batch(run.world), cfg.per_worker_batch(run.world),
             cfg.batch_mode, cfg.scaled_lr(run.world), "bf16" if run.speed.bf16 else "fp32",
             run.data_what)


def fit_epochs(run: Run, resume: Resume) -> dict:
    cfg = run.cfg
    memory_format = torch.channels_last if run.speed.channels_last else torch.contiguous_format
    preprocess = (DeviceAugment(run.device, run.speed.channels_last, crop=run.device_augment == "crop")
                  if run.device_augment != "none"
                  else (lambda x, train: x.contiguous(memory_format=memory_format)))
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
    eval_loss = torch.nn.CrossEntropyLoss()
    if run.is_rank0:
        announce(run, resume)
    should_stop = StopPoller(run.store, run.is_rank0, run.device,
                             checkpoint_every_s=cfg.checkpoint_every_min * 60)
    last: Optional[EpochMetrics] = None
    comm_wait, error = None, None
    for epoch in range(resume.epoch, cfg.epochs):
        if isinstance(getattr(run.train_loader, "sampler", None), DistributedSampler):
            run.train_loader.sampler.set_epoch(epoch)  # a new shuffle every epoch
        skip = resume.step if epoch == resume.epoch else 0
        progress = None
        if run.is_rank0:
            run.files.event("epoch_start", epoch=epoch + 1, step=skip)
            progress = Progress(cfg.progress, epoch, cfg.epochs, run.steps_per_epoch, skip,
                                cfg.global_batch(run.world), cfg.log_every,
                                eval_s=last.eval_s if last else None)
        stats = train_epoch(run.model, run.train_loader, run.optimizer, run.scheduler, loss_fn,
                            preprocess, run.device, bf16=run.speed.bf16,
                            max_steps=run.steps_per_epoch, skip_steps=skip,
                            sync_timing=cfg.sync_timing,
                            should_stop=functools.partial(at_step, run, should_stop, epoch, last=last),
                            on_step=progress.on_step if progress else None)
        if progress:
            progress.close()
        if run.is_rank0 and stats.first_step_time is not None and epoch == resume.epoch:
            run.files.event("first_step", time=stats.first_step_time, epoch=epoch + 1)
        if stats.stopped_early:  # a stop was requested: save where we are and stop
            pos = skip + stats.steps
            log.info("stop requested: checkpoint at epoch %d step %d, stopping", epoch + 1, pos)
            error = report(run, dict(epoch=epoch, step=pos, preempted=True, test_acc=-1.0),
                           run.state(epoch, pos, last), last=True)
            return finish(run, should_stop, {"preempted": True, "epoch": epoch, "step": pos}, error)
        if comm_wait is None and run.world > 1 and cfg.steps_per_epoch:
            comm_wait = measure_comm_wait(run.model, next(iter(run.train_loader)), loss_fn,
                                          preprocess, run.device, run.speed.bf16)
        test = evaluate(run.model, run.test_loader, eval_loss, preprocess, run.device, run.speed.bf16)
        last = epoch_metrics(run, epoch, stats, test, comm_wait)
        if run.is_rank0:
            run.files.epoch(last)
            log.info(last.line())
        # asked during the epoch's last steps: this epoch's checkpoint is the one to stop with
        stopping = should_stop.at_epoch_end() and epoch + 1 < cfg.epochs
        error = report(run, last.to_dict(), run.state(epoch + 1, 0, last),
                       last=stopping or epoch + 1 == cfg.epochs)
        should_stop.checkpointed()
        if stopping:
            log.info("stop requested: checkpoint at the end of epoch %d, stopping", epoch + 1)
            return finish(run, should_stop, {"preempted": True, "epoch": epoch + 1, "step": 0}, error)
    return finish(run, should_stop, {"preempted": False, "epoch": cfg.epochs}, error)


def at_step(run: Run, should_stop: StopPoller, epoch: int, step: int,
            last: Optional[EpochMetrics]) -> bool:
    """After each step (every rank, same answers): stop now? Saves the timed checkpoint
    (--checkpoint-every-min) when it falls due before the epoch's last step."""
    if should_stop(step):
        return True
    if should_stop.checkpoint_due and step < run.steps_per_epoch:
        log.info("checkpoint after %g min: epoch %d step %d", run.cfg.checkpoint_every_min,
                 epoch + 1, step)
        report(run, dict(epoch=epoch, step=step, preempted=False, test_acc=-1.0),
               run.state(epoch, step, last))
        should_stop.checkpointed()
    return False


def finish(run: Run, should_stop: StopPoller, outcome: dict, error: Optional[str]) -> dict:
    """The loop's result; rank 0 writes the run files that are left and adds a storage error."""
    should_stop.close()
    if run.is_rank0:
        unwritten = run.files.close(0.0 if error else run.cfg.retry_storage_s)
        error = error or unwritten
        if error:
            outcome["storage_error"] = error
    return outcome
