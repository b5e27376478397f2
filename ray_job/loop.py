"""The per-worker training function that TorchTrainer runs on every rank.

Ray appears only where it must: prepare_model, prepare_data_loader, get_context, get_checkpoint and
report. Everything else is plain PyTorch from engine.py, data.py and checkpoint.py.
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
import time
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from .checkpoint import load_checkpoint, restore_training_state, save_checkpoint
from .config import PREEMPT_FILE, TrainConfig
from .data import DeviceAugment, build_dataset, load_splits
from .engine import (EpochStats, evaluate, global_any, global_sums, measure_comm_wait, peak_rss_gib,
                     train_epoch)
from .model import build_model, gradient_bytes, to_device, unwrap
from .optim import build_optimizer, build_scheduler
from .runlog import TOPOLOGY_JSON, RunLog, write_json

log = logging.getLogger("ray_job")
PREEMPT_CHECK_EVERY = 5  # steps between (collective) checks for a preemption request
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


def find_resume_state(cfg: TrainConfig, world_size: int) -> Resume:
    """Ray's latest checkpoint of this run first, else --resume-from, else a fresh start."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = load_checkpoint(d)
    elif cfg.resume_from:
        state = load_checkpoint(cfg.resume_from)
    else:
        return Resume()
    # A mid-epoch position only makes sense with the same sharding; otherwise redo that epoch.
    same_world = state.get("world_size") == world_size
    return Resume(state["epoch"], state.get("step", 0) if same_world else 0, state)


def make_loaders(cfg: TrainConfig, rank: int, world: int, use_cuda: bool):
    train_split, test_split = load_splits(cfg)
    fast = cfg.loader != "torchvision"
    workers = cfg.loader_workers if cfg.loader_workers >= 0 else (0 if fast else 2)
    common = dict(num_workers=workers, pin_memory=use_cuda, persistent_workers=workers > 0)
    train_ds = build_dataset(train_split, True, fast)
    test_ds = build_dataset(test_split, False, fast)
    train = DataLoader(train_ds, batch_size=cfg.per_worker_batch(world), shuffle=True,
                       drop_last=True, collate_fn=train_ds.collate_fn, **common)
    # Test shards without DistributedSampler's padding, so every image is counted exactly once.
    test = DataLoader(test_ds, batch_size=EVAL_BATCH, sampler=range(rank, len(test_ds), world),
                      collate_fn=test_ds.collate_fn, **common)
    train = ray.train.torch.prepare_data_loader(train)
    test = ray.train.torch.prepare_data_loader(test, add_dist_sampler=False)
    return train, test, len(train_split.classes)


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


def log_topology(cfg: TrainConfig, run: Optional[RunLog], device: torch.device, backend: str) -> None:
    ctx = ray.train.get_context()
    me = dict(rank=ctx.get_world_rank(), local_rank=ctx.get_local_rank(), node_rank=ctx.get_node_rank(),
              hostname=socket.gethostname(), node_ip=ray.util.get_node_ip_address(),
              node_id=ray.get_runtime_context().get_node_id(),
              pid=os.getpid(), device=str(device))
    logging.getLogger("ray_job.worker").warning(
        "worker rank %(rank)d: node %(node_rank)d (%(hostname)s %(node_ip)s) local rank "
        "%(local_rank)d device %(device)s pid %(pid)d", me)
    everyone = [me]
    if ctx.get_world_size() > 1:
        everyone = [None] * ctx.get_world_size()
        dist.all_gather_object(everyone, me)
    if run is None:
        return
    nodes = sorted({w["node_id"] for w in everyone})  # Ray nodes, even when they share an IP
    master = f"{os.environ.get('MASTER_ADDR', everyone[0]['node_ip'])}:{os.environ.get('MASTER_PORT', '?')}"
    log.info("topology: world size %d on %d node(s), backend %s, master %s", len(everyone),
             len(nodes), backend, master)
    for w in everyone:
        log.info("  rank %(rank)d -> %(hostname)s (%(node_ip)s) local rank %(local_rank)d %(device)s", w)
    write_json(run.path(TOPOLOGY_JSON), dict(world_size=len(everyone), num_nodes=len(nodes),
                                             backend=backend, master=master, workers=everyone))


def epoch_metrics(epoch: int, cfg: TrainConfig, train: EpochStats, test: EpochStats, lr: float,
                  device: torch.device, world: int) -> dict:
    """Global metrics of one epoch: counts are summed over all ranks; times are rank maxima."""
    loss, correct, count, tloss, tcorrect, tcount = global_sums(
        [train.loss_sum, train.correct, train.count, test.loss_sum, test.correct, test.count], device)
    m = dict(epoch=epoch + 1, epochs=cfg.epochs, train_loss=loss / max(count, 1),
             train_acc=correct / max(count, 1), test_loss=tloss / max(tcount, 1),
             test_acc=tcorrect / max(tcount, 1), test_images=int(tcount), train_images=int(count),
             epoch_s=train.wall_s + test.wall_s, train_s=train.wall_s, eval_s=test.wall_s,
             images_per_s=count / max(train.wall_s, 1e-9), data_s=train.data_s,
             compute_s=train.wall_s - train.data_s, fwd_bwd_s=train.fwd_bwd_s,
             optim_s=train.optim_s, steps=train.steps, lr=lr, world_size=world, time=time.time())
    steady = train.step_times[min(len(train.step_times) - 1, 2):] if train.step_times else []
    if steady:  # skip the first steps (allocation, autotuning); the median resists noisy neighbours
        m["steady_images_per_s"] = cfg.global_batch(world) / statistics.median(steady)
    if device.type == "cuda":
        m["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    m["peak_host_mem_gib"] = peak_rss_gib()
    return m


def report(metrics: dict, run: Optional[RunLog], save_kwargs: Optional[dict]) -> None:
    """Every rank calls report (it is a barrier); only rank 0 writes and passes a checkpoint."""
    if run is None or save_kwargs is None:
        ray.train.report(metrics, checkpoint=None)
        return
    with tempfile.TemporaryDirectory() as d:
        save_checkpoint(d, **save_kwargs)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))


def train_loop_per_worker(config: dict) -> dict:
    cfg = TrainConfig(**config)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    setup_logging(rank)
    torch.manual_seed(cfg.seed + rank)
    torch.set_num_threads(max(1, int(cfg.cpus_per_worker)))
    run = RunLog(cfg.run_dir()) if rank == 0 else None  # rank-0-only side effects go through `run`

    use_cuda = bool(cfg.use_gpu) and torch.cuda.is_available()
    channels_last = cfg.channels_last == "on" or (cfg.channels_last == "auto" and use_cuda)
    bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and use_cuda)
    if use_cuda:
        torch.backends.cudnn.benchmark = True
    train_loader, test_loader, num_classes = make_loaders(cfg, rank, world, use_cuda)
    model = make_model(cfg, num_classes, channels_last)
    device = next(model.parameters()).device
    backend = dist.get_backend() if dist.is_initialized() else "none (1 worker)"
    log_topology(cfg, run, device, backend)

    steps_per_epoch = len(train_loader) if not cfg.steps_per_epoch else min(cfg.steps_per_epoch, len(train_loader))
    optimizer = build_optimizer(unwrap(model), cfg, world, device)
    resume = find_resume_state(cfg, world)
    if resume.state is not None:  # the schedule is placed by position below, not by its state
        restore_training_state(resume.state, model=model, optimizer=optimizer, scheduler=None,
                               scaler=None)
    for group in optimizer.param_groups:  # the peak LR of *this* world size, not the checkpoint's
        group["lr"] = group["initial_lr"] = cfg.scaled_lr(world)
    scheduler = build_scheduler(optimizer, cfg, steps_per_epoch,
                                start_step=resume.epoch * steps_per_epoch + resume.step)
    if cfg.compile:
        model = torch.compile(model)
    return fit_epochs(cfg, model, optimizer, scheduler, train_loader, test_loader, device, bf16,
                      channels_last, resume, run, steps_per_epoch, world)


def fit_epochs(cfg, model, optimizer, scheduler, train_loader, test_loader, device, bf16,
               channels_last, resume: Resume, run: Optional[RunLog], steps_per_epoch: int,
               world: int) -> dict:
    fast = cfg.loader != "torchvision"
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    preprocess = DeviceAugment(device, channels_last) if fast else (
        lambda x, train: x.contiguous(memory_format=memory_format))
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
    eval_loss = torch.nn.CrossEntropyLoss()
    if run is not None:
        run.keep_epochs_up_to(resume.epoch)
        if resume.state is not None:
            run.event("resumed", epoch=resume.epoch, step=resume.step)
        log.info("training %s/%s stem on %d worker(s): %d steps/epoch, global batch %d (%d per "
                 "worker, --batch-mode %s), peak lr %.4g, %s, %s loader", cfg.model, cfg.stem, world,
                 steps_per_epoch, cfg.global_batch(world), cfg.per_worker_batch(world), cfg.batch_mode,
                 cfg.scaled_lr(world), "bf16" if bf16 else "fp32", "fast" if fast else "torchvision")
    stop_file = os.path.join(cfg.run_dir(), PREEMPT_FILE)

    def should_stop(step: int) -> bool:
        if step % PREEMPT_CHECK_EVERY:
            return False
        return global_any(run is not None and os.path.exists(stop_file), device)

    last: dict[str, Any] = {}
    comm_wait = None
    for epoch in range(resume.epoch, cfg.epochs):
        if isinstance(getattr(train_loader, "sampler", None), DistributedSampler):
            train_loader.sampler.set_epoch(epoch)  # a new shuffle every epoch
        skip = resume.step if epoch == resume.epoch else 0
        if run is not None:
            run.event("epoch_start", epoch=epoch + 1, step=skip)
        on_step = progress_logger(epoch, cfg, steps_per_epoch) if run is not None else None
        stats = train_epoch(model, train_loader, optimizer, scheduler, loss_fn, preprocess, device,
                            bf16=bf16, max_steps=steps_per_epoch, skip_steps=skip,
                            sync_timing=cfg.sync_timing,
                            on_step=on_step, should_stop=should_stop)
        if run is not None and stats.first_step_time is not None and epoch == resume.epoch:
            run.event("first_step", time=stats.first_step_time, epoch=epoch + 1)
        state = dict(model=unwrap(model), optimizer=optimizer, scheduler=scheduler, scaler=None,
                     config=cfg.to_dict(), world_size=world)
        if stats.stopped_early:  # preemption requested: save where we are and stop
            pos = skip + stats.steps
            log.info("preemption requested: checkpoint at epoch %d step %d, stopping", epoch + 1, pos)
            report(dict(epoch=epoch, step=pos, preempted=True, test_acc=-1.0), run,
                   dict(state, epoch=epoch, step=pos, metrics=last))
            return {"preempted": True, "epoch": epoch, "step": pos}
        if comm_wait is None and world > 1 and cfg.steps_per_epoch:
            comm_wait = measure_comm_wait(model, next(iter(train_loader)), loss_fn, preprocess, device, bf16)
        test = evaluate(model, test_loader, eval_loss, preprocess, device, bf16)
        last = epoch_metrics(epoch, cfg, stats, test, optimizer.param_groups[0]["lr"], device, world)
        if comm_wait is not None:
            last["comm_wait_s_per_step"] = comm_wait
        last["grad_bytes"] = gradient_bytes(unwrap(model))
        if run is not None:
            run.epoch(last)
            log.info(format_epoch(last))
        report(last, run, dict(state, epoch=epoch + 1, step=0, metrics=last))
    if run is not None:
        run.close()
    return {"preempted": False, "epoch": cfg.epochs, "metrics": last}


def progress_logger(epoch: int, cfg: TrainConfig, steps: int):
    def on_step(step: int, loss: torch.Tensor, data_s: float, compute_s: float) -> None:
        if cfg.log_every and step % cfg.log_every == 0:
            log.info("Epoch [%d/%d], Step [%d/%d], Loss: %.4f, data %.1f ms, train %.1f ms",
                     epoch + 1, cfg.epochs, step, steps, loss.item(), data_s * 1e3, compute_s * 1e3)
    return on_step


def format_epoch(m: dict) -> str:
    return (f"epoch {m['epoch']}/{m['epochs']}: train loss {m['train_loss']:.4f} acc "
            f"{m['train_acc']:.3f} | test loss {m['test_loss']:.4f} acc {m['test_acc']:.3f} | "
            f"{m['epoch_s']:.1f}s, {m['images_per_s']:.0f} img/s, data {m['data_s']:.1f}s vs compute "
            f"{m['compute_s']:.1f}s | lr {m['lr']:.4g}")

