"""What the benchmarks share: the device and `train`'s own speed choices for it, timed steps, the
machine's name, launching torchrun processes that find this ray_job, and joining Ray."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Optional

import torch
from torch import nn

from ..config import Speed
from ..core.errors import UsageError


class BaselineRecipe:
    """The raw-DDP baseline's optimiser settings (ray_job.peers.raw_ddp's defaults)."""

    lr = 1e-4
    momentum = 0.9
    batch = 128


def device_and_flags(cuda: bool):
    """The device and `train`'s own choice of bf16 / channels_last for it (flags at their defaults)."""
    speed = Speed.choose("auto", "auto", use_gpu=cuda, cuda_available=cuda)
    device = torch.device("cuda", torch.cuda.current_device()) if speed.cuda else torch.device("cpu")
    return device, speed.bf16, speed.channels_last


def constant_scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def run_steps(model, batches, optimizer, preprocess: Callable, device, bf16: bool, steps: int,
              warmup: int) -> dict:
    """img/s and data share over `steps` steps after `warmup` untimed ones (EpochSteps' timing)."""
    from ..train.engine import EpochSteps, peak_rss_gib

    step = EpochSteps(model, optimizer, constant_scheduler(optimizer), nn.CrossEntropyLoss(), preprocess, device,
                      bf16)
    if warmup:
        step.train_epoch(batches(), max_steps=warmup)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    stats = step.train_epoch(batches(), max_steps=steps)
    result = dict(images_per_s=stats.count / stats.wall_s, data_share=stats.data_s / stats.wall_s,
                  steps=stats.steps, batch=stats.count // max(stats.steps, 1), seconds=stats.wall_s,
                  peak_host_mem_gib=peak_rss_gib())
    if device.type == "cuda":
        result["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return result


def fast_setup(model_name: str, stem: str, batch: int, images: int, cuda: bool, compile_: bool,
               prepare_model: Optional[Callable] = None, prepare_loader: Optional[Callable] = None):
    """This project's fast path, set up as `train` does (model.setup): model, optimizer, loader
    factory and device augmentation; `prepare_model`: Ray's, else the model is moved to the device."""
    from ..config import TrainConfig
    from ..data.arrays import ArrayDataset
    from ..data.augment import DeviceAugment
    from ..data.synthetic import make_synthetic
    from ..model.setup import model_and_optimizer

    device, bf16, channels_last = device_and_flags(cuda)
    cfg = TrainConfig(model=model_name, stem=stem, batch_size=batch, lr_ref_batch=batch, compile=compile_)
    place = prepare_model or (lambda model, **ddp: model.to(device))
    model, optimizer = model_and_optimizer(cfg, 10, Speed(cuda, bf16, channels_last), 1, place)
    ds = ArrayDataset(make_synthetic(images, 0, True))

    def batches():
        loader = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, drop_last=True,
                                             collate_fn=ds.collate_fn, pin_memory=cuda)
        if prepare_loader is not None:
            return prepare_loader(loader)
        return ((x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in loader)

    return model, optimizer, batches, DeviceAugment(device, channels_last), device, bf16


def machine_busy_s() -> Optional[float]:
    """CPU seconds this machine has been busy (all cores, all processes; Linux /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait


def own_usage() -> tuple[float, float, int]:
    """This process's CPU seconds (user + system), system seconds, and minor page faults so far."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_stime, usage.ru_minflt


def machine(cuda: bool) -> str:
    import platform

    if cuda:
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    return f"CPU ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"


def child_env(threads: int) -> dict:
    """Environment of launched processes: they find this ray_job even when it is not installed."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "OMP_NUM_THREADS": str(threads),
            "PYTHONPATH": root + (os.pathsep + path if path else "")}


def torchrun_cmd(workers: int, *module_args: str) -> list[str]:
    """torchrun (as `python -m torch.distributed.run`, which is what the torchrun script runs)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
            "-m", *module_args]


def tail(path: str, n: int = 25) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def connect_ray(workers: int, cuda: bool) -> tuple[float, int]:
    """Joins $RAY_ADDRESS or starts a local cluster: (seconds it took, torch threads per process).

    Every process of either launcher gets the same share of the CPUs this machine and the Ray
    cluster both have; fails if N workers of that size cannot fit."""
    import ray

    from ..config import TrainConfig
    from ..train.trainer import connect, workers_that_fit

    t = time.time()
    connect(TrainConfig())
    cpus = min(len(os.sched_getaffinity(0)), int(ray.cluster_resources().get("CPU", 1)))
    threads = max(1, cpus // workers)
    fits = workers_that_fit(threads, 1 if cuda else 0)
    if fits < workers:
        raise UsageError(f"--workers {workers} of {threads} CPU{' + 1 GPU' if cuda else ''} cannot fit: the "
                         f"Ray cluster holds {fits}; lower --workers")
    return time.time() - t, threads
