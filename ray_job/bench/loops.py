"""One throughput run of `bench vs-ddp` (vsddp.py): the raw-DDP baseline's loop or ours, the same
code under torchrun and under Ray Train.

    python -m ray_job.bench.loops SPEC.json    # one torchrun process of a run (vsddp.py starts it)
"""

from __future__ import annotations

import dataclasses
import os
import socket
import statistics
import sys
import tempfile
import threading
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from ..config import Speed
from ..peers import raw_ddp
from ..storage import read_json, write_json
from .common import BASELINE, machine_busy_s, own_usage

LOOPS = ("baseline", "ours")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    loop: str             # "baseline" | "ours"
    model: str
    stem: str
    global_batch: int
    steps: int            # timed
    warmup: int           # untimed, first
    threads: int          # torch threads per process
    cuda: bool
    out: str = ""         # torchrun: where rank 0 writes its result


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the launcher put this process. Under Ray, prepare_model / prepare_data_loader wrap
    DDP, add the DistributedSampler and move batches; under torchrun the same is done by hand."""

    rank: int
    world: int
    device: torch.device
    ray: bool

    def wrap_model(self, model: nn.Module, **ddp: Any) -> nn.Module:
        if self.ray:
            import ray.train.torch

            return ray.train.torch.prepare_model(model, parallel_strategy_kwargs=ddp)
        return raw_ddp.wrap_ddp(model.to(self.device), self.device, self.world, **ddp)

    def wrap_loader(self, loader: DataLoader):
        if not self.ray:
            return loader
        import ray.train.torch

        return ray.train.torch.prepare_data_loader(loader)


def _baseline_loop(spec: RunSpec, place: Placement, split, per_rank: int):
    env = raw_ddp.DistEnv(place.rank, place.world, 0, "ray" if place.ray else "torchrun")
    model = place.wrap_model(raw_ddp.build_baseline_model(spec.model, 10, spec.stem))
    optimizer = raw_ddp.baseline_optimizer(model, BASELINE.lr, BASELINE.momentum)
    loader = place.wrap_loader(raw_ddp.baseline_train_loader(split, per_rank, env, 0, 0, not place.ray))
    criterion = nn.CrossEntropyLoss()

    def epoch(e: int, steps: int):
        raw_ddp.set_epoch(loader, e)
        return raw_ddp.train_epoch(model, loader, optimizer, criterion, place.device, e, 2, env,
                                    print_every=0, max_steps=steps)
    return epoch, False


def _our_loop(spec: RunSpec, place: Placement, split, per_rank: int):
    from ..config import TrainConfig
    from ..data.arrays import ArrayDataset
    from ..data.augment import DeviceAugment
    from ..model.setup import model_and_optimizer
    from ..train.control import StepControl, controlled_steps
    from ..train.engine import EpochSteps
    from ..train.progress import Progress
    from .common import constant_scheduler

    cuda = place.device.type == "cuda"
    speed = Speed.choose("auto", "auto", use_gpu=cuda, cuda_available=cuda)
    if cuda:
        torch.backends.cudnn.benchmark = True
    cfg = TrainConfig(model=spec.model, stem=spec.stem, batch_size=spec.global_batch, lr_ref_batch=spec.global_batch)
    model, optimizer = model_and_optimizer(cfg, 10, speed, place.world, place.wrap_model)
    ds = ArrayDataset(split)
    sampler = (None if place.ray or place.world == 1  # Ray's prepare_data_loader adds it
               else DistributedSampler(ds, num_replicas=place.world, rank=place.rank, shuffle=True))
    loader = place.wrap_loader(DataLoader(ds, batch_size=per_rank, shuffle=sampler is None, sampler=sampler,
                                          drop_last=True, collate_fn=ds.collate_fn, pin_memory=cuda))
    steps = EpochSteps(model, optimizer, constant_scheduler(optimizer), nn.CrossEntropyLoss(),
                       DeviceAugment(place.device, speed.channels_last), place.device, speed.bf16)
    # The step control looks for a stop request in a run folder, as in `train`: a scratch one here.
    scratch = tempfile.TemporaryDirectory(prefix="rj_bench_run_")
    control = StepControl(scratch.name, place.rank == 0, place.device)

    def epoch(e: int, count: int):
        """One epoch of `count` steps on `train`'s per-step path: the step, rank 0's progress lines
        (--log-every 10, as `train`'s default) and the step control's poll."""
        raw_ddp.set_epoch(loader, e)
        # batches copied to the device without blocking, as Ray's prepare_data_loader does
        batches = loader if place.ray else ((x.to(place.device, non_blocking=True),
                                             y.to(place.device, non_blocking=True)) for x, y in loader)
        progress = Progress("lines", 2, count, spec.global_batch, 10) if place.rank == 0 else None
        if progress is not None:
            progress.start_epoch(e, 0, None)
        for _ in controlled_steps(steps, batches, count, 0, control, progress):
            pass
        if progress is not None:
            progress.close()
        return steps.finish()
    epoch.scratch = scratch  # removed when `epoch` is
    return epoch, speed.bf16


def run_loop(spec: RunSpec, place: Placement) -> Optional[dict]:
    """Warm-up steps, then timed steps; rank 0 returns everyone's figures, the others None."""
    from ..data.synthetic import make_synthetic
    from ..train.engine import peak_rss_gib

    torch.set_num_threads(spec.threads)
    torch.manual_seed(0)
    split = make_synthetic(spec.global_batch * max(spec.steps, spec.warmup), 0, True)
    per_rank = spec.global_batch // place.world
    epoch, bf16 = (_baseline_loop if spec.loop == "baseline" else _our_loop)(spec, place, split, per_rank)
    warm = epoch(0, spec.warmup)
    busy0, (own0, sys0, faults0) = machine_busy_s(), own_usage()
    timed = epoch(1, spec.steps)
    busy1, (own1, sys1, faults1) = machine_busy_s(), own_usage()
    cuda = place.device.type == "cuda"
    mine = dict(host=socket.gethostname(), count=timed.count, wall_s=timed.wall_s, own_cpu_s=own1 - own0,
                machine_busy_s=None if busy0 is None else busy1 - busy0, sys_cpu_s=sys1 - sys0,
                page_faults=faults1 - faults0, first_step_time=warm.first_step_time, peak_host_mem_gib=peak_rss_gib(),
                peak_gpu_mem_gib=torch.cuda.max_memory_allocated(place.device) / 2**30 if cuda else None)
    everyone = [mine]
    if place.world > 1 and dist.is_initialized():
        everyone = [None] * place.world
        dist.all_gather_object(everyone, mine)
    if place.rank != 0:
        return None
    gpu = [r["peak_gpu_mem_gib"] for r in everyone if r["peak_gpu_mem_gib"] is not None]
    return dict(loop=spec.loop, world_size=place.world, batch_per_process=per_rank,
                global_batch=per_rank * place.world, steps=timed.steps, warmup=spec.warmup,
                precision="bf16" if bf16 else "fp32", threads_per_process=spec.threads,
                images_per_s=sum(r["count"] for r in everyone) / max(r["wall_s"] for r in everyone),
                step_ms_median=1000 * statistics.median(timed.step_times) if timed.step_times else None,
                # rank 0's mean ms per step: waiting for data (+ its preprocessing), forward +
                # backward (the baseline's loop: + optimizer step), optimizer step
                split_ms={k: 1000 * v / max(timed.steps, 1) for k, v in (("data", timed.data_s),
                                                                       ("fwd_bwd", timed.fwd_bwd_s),
                                                                       ("optim", timed.optim_s))},
                first_step_time=min(r["first_step_time"] for r in everyone),
                peak_host_mem_gib=max(r["peak_host_mem_gib"] for r in everyone),
                peak_host_mem_gib_per_process=[r["peak_host_mem_gib"] for r in everyone],
                peak_gpu_mem_gib=max(gpu) if gpu else None,
                other_cpu_share=other_cpu_share(mine, everyone),
                # what the kernel did for the training processes: minor page faults per step (memory
                # the allocator gave back and takes again) and the system share of their CPU time
                page_faults_per_step=sum(r["page_faults"] for r in everyone) / max(timed.steps * place.world, 1),
                system_cpu_share=sum(r["sys_cpu_s"] for r in everyone) / max(sum(r["own_cpu_s"] for r in everyone),
                                                                             1e-9),
                main_thread=threading.current_thread() is threading.main_thread())


def other_cpu_share(rank0: dict, everyone: list[dict]) -> Optional[float]:
    """Share of rank 0's machine busy OUTSIDE the training processes during the timed steps: the
    launcher's own processes (Ray's daemons) plus anyone else's jobs. Counts the processes on rank
    0's host only (same hostname), so it stays meaningful on several nodes."""
    if rank0["machine_busy_s"] is None or not rank0["wall_s"]:
        return None
    own = sum(r["own_cpu_s"] for r in everyone if r["host"] == rank0["host"])
    return max(0.0, rank0["machine_busy_s"] - own) / (rank0["wall_s"] * (os.cpu_count() or 1))


def worker_main(argv: list[str]) -> int:
    """One torchrun process: `python -m ray_job.bench.loops SPEC.json`."""
    spec = RunSpec(**read_json(argv[0]))
    env = raw_ddp.dist_env()
    device = raw_ddp.init_distributed(env)
    result = run_loop(spec, Placement(env.rank, env.world, device, ray=False))
    if result is not None:
        write_json(spec.out, result)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _ray_worker(config: dict) -> Optional[dict]:
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    place = Placement(ctx.get_world_rank(), ctx.get_world_size(), ray.train.torch.get_device(), ray=True)
    return run_loop(RunSpec(**config["spec"]), place)


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
