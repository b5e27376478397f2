"""What the benchmarks share: the device and `train`'s speed choices for it, timed steps, launchers
(torchrun, Ray), and the ceiling: the device's dense matmul FLOP/s measured in the same run and a
model's FLOPs per image (torch.utils.flop_counter), so that every images/s is also a share of the peak."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from ..config import Speed
from ..core.errors import UsageError
from ..peers.raw_ddp import BaselineArgs


BASELINE = BaselineArgs()  # the raw-DDP baseline's recipe: its own defaults (lr, momentum, batch_size)


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


def timed(fn, *args) -> tuple[float, Any]:
    started = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - started, result


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


def torchrun_cmd(workers: int, *module_args: str) -> list[str]:
    """torchrun (as `python -m torch.distributed.run`, which is what the torchrun script runs)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
            "-m", *module_args]


def run_torchrun(what: str, workers: int, args: list[str], threads: int, log: str, out: str,
                 timeout: float) -> None:
    """torchrun of `-m ARGS`, its output in `log`; fails with the log's last lines unless it exits 0
    having written `out`. Its processes find this ray_job even when it is not installed."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": root + (os.pathsep + path if path else "")}
    with open(log, "w") as f:
        proc = subprocess.run(torchrun_cmd(workers, *args), stdout=f, stderr=subprocess.STDOUT, env=env,
                              timeout=timeout)
    if proc.returncode != 0 or not os.path.exists(out):
        with open(log, errors="replace") as f:
            tail = "".join(f.readlines()[-25:])
        raise RuntimeError(f"{what} exited with {proc.returncode}; last lines of {log}:\n{tail}")


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


def check_workers(workers: int, global_batch: int, cuda: bool) -> None:
    if workers < 1:
        raise UsageError("--workers must be at least 1")
    if cuda and workers > torch.cuda.device_count():
        raise UsageError(f"--workers {workers} needs {workers} GPUs (one per process); this machine has "
                         f"{torch.cuda.device_count()}")
    if global_batch < workers:
        raise UsageError(f"--batch-size {global_batch} (global) is smaller than --workers {workers}")


# --- the ceiling ----------------------------------------------------------------------------------

def matmul_flops(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 5) -> float:
    """Dense matmul FLOP/s of this device (best of `repeats`): the peak a training step can use."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    out = torch.empty_like(a)
    inner = 10 if device.type == "cuda" else 1
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    torch.mm(a, b, out=out)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            torch.mm(a, b, out=out)
        sync()
        best = min(best, (time.perf_counter() - t) / inner)
    return 2 * n**3 / best


def device_peaks(cuda: bool, n: int = 0) -> dict:
    """fp32 (and on GPU bf16) matmul FLOP/s, with the size and threads it was measured with."""
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    n = n or (8192 if cuda else 2048)
    peaks = dict(matmul_n=n, threads=torch.get_num_threads(), fp32=matmul_flops(device, torch.float32, n))
    if cuda:
        peaks["bf16"] = matmul_flops(device, torch.bfloat16, n)
        torch.cuda.empty_cache()
    return peaks


def flops_per_image(model: nn.Module, image: tuple = (3, 32, 32), batch: int = 2) -> dict:
    """Forward and training-step (forward + backward) FLOPs per image, counted once on the CPU."""
    from torch.utils.flop_counter import FlopCounterMode

    model = model.cpu().train()
    x = torch.randn(batch, *image)
    with FlopCounterMode(display=False) as fwd:
        with torch.no_grad():
            model(x)
    with FlopCounterMode(display=False) as step:
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    return dict(forward=fwd.get_total_flops() / batch, train_step=step.get_total_flops() / batch)


def flop_share(images_per_s: Optional[float], flops_image: float, peak: float, devices: int = 1) -> dict:
    """Achieved FLOP/s of a run and its share of `devices` x the measured peak."""
    if not images_per_s:
        return dict(achieved_flops=None, flop_share=None)
    achieved = images_per_s * flops_image
    return dict(achieved_flops=achieved, flop_share=achieved / (peak * devices))


def fmt(value: Optional[float], spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def format_peaks(peaks: dict) -> str:
    parts = [f"{k} {peaks[k] / 1e9:,.1f} GFLOP/s" for k in ("fp32", "bf16") if k in peaks]
    return f"device peak (dense {peaks['matmul_n']}x{peaks['matmul_n']} matmul, {peaks['threads']} threads): " \
           + ", ".join(parts)
