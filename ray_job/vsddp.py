"""`bench --vs-ddp`: this project side by side with what users would run instead, and the ceiling.

Throughput (`--vs-ddp --workers N`): the same model, global batch and steps, run four times on
synthetic data:
    torchrun  seed loop   the seed's loop (ray_job.peers.seed_ddp: fp32, PIL per sample, SGD)
    ray       seed loop   the same code in a Ray Train worker (prepare_model / prepare_data_loader)
    torchrun  our loop    this project's step (uint8 batches, device augmentation, Speed.choose)
    ray       our loop    the same under Ray Train, as `train` runs it
Under torchrun the loops wrap DDP and a DistributedSampler themselves, exactly as Ray's prepare_*
helpers do; everything else is the same function (`run_loop`). Each run reports steady images/s
(the timed steps after the warm-up ones), the time from launch to the first finished step, and
each process's peak memory; the ratios are Ray/torchrun for the same loop and ours/seed's loop.

Time to accuracy (`--vs-ddp --to-accuracy A`): the seed's recipe (the peer under torchrun) and
`train --recipe fast` (Ray Train) on the same data, model and world size, each until test accuracy
A or `--budget-s`.

The ceiling: the device's dense matmul FLOP/s (fp32 on CPU; bf16 and fp32 on GPU), measured in the
same run, and the model's FLOPs per image counted once with torch.utils.flop_counter, so every
images/s figure is also a share of the machine's peak.

    python -m ray_job.vsddp SPEC.json    # one torchrun process of a throughput run (internal)
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from .config import Speed, UsageError

LOOPS = ("seed", "ours")
LAUNCHERS = ("torchrun", "ray")
DDP_KWARGS = dict(gradient_as_bucket_view=True, bucket_cap_mb=25)  # as `train` (loop.make_model)


# --- the ceiling --------------------------------------------------------------------------------

def matmul_flops(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 5) -> float:
    """Dense matmul FLOP/s of this device (best of `repeats`): the peak a training step can use."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    out = torch.empty_like(a)
    inner = 10 if device.type == "cuda" else 1

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

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
    peaks = dict(matmul_n=n, threads=torch.get_num_threads(),
                 fp32=matmul_flops(device, torch.float32, n))
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


# --- one throughput run: the same code under both launchers -------------------------------------

@dataclasses.dataclass(frozen=True)
class RunSpec:
    loop: str             # "seed" | "ours"
    model: str
    stem: str
    global_batch: int
    steps: int            # timed
    warmup: int           # untimed, first
    threads: int          # torch threads per process
    cuda: bool
    num_classes: int = 10
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
        from .peers.seed_ddp import wrap_ddp

        return wrap_ddp(model.to(self.device), self.device, self.world, **ddp)

    def sampler(self, dataset) -> Optional[DistributedSampler]:
        if self.ray or self.world == 1:
            return None  # Ray's prepare_data_loader adds it
        return DistributedSampler(dataset, num_replicas=self.world, rank=self.rank, shuffle=True)

    def wrap_loader(self, loader: DataLoader, move: bool):
        if self.ray:
            import ray.train.torch

            return ray.train.torch.prepare_data_loader(loader)
        return _ToDevice(loader, self.device) if move else loader


class _ToDevice:
    """Batches copied to the device without blocking (what prepare_data_loader does under Ray)."""

    def __init__(self, loader: DataLoader, device: torch.device):
        self.loader, self.device, self.sampler = loader, device, loader.sampler

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for x, y in self.loader:
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


def _set_epoch(loader, epoch: int) -> None:
    if isinstance(getattr(loader, "sampler", None), DistributedSampler):
        loader.sampler.set_epoch(epoch)


def _seed_loop(spec: RunSpec, place: Placement, split, per_rank: int):
    from .peers import seed_ddp

    env = seed_ddp.DistEnv(place.rank, place.world, 0, "ray" if place.ray else "torchrun")
    model = place.wrap_model(seed_ddp.build_seed_model(spec.model, spec.num_classes, spec.stem))
    optimizer = seed_ddp.seed_optimizer(model, SeedRecipe.lr, SeedRecipe.momentum)
    loader = place.wrap_loader(seed_ddp.seed_train_loader(split, per_rank, env, 0, 0, not place.ray), move=False)
    criterion = nn.CrossEntropyLoss()

    def epoch(e: int, steps: int):
        _set_epoch(loader, e)
        return seed_ddp.train_epoch(model, loader, optimizer, criterion, place.device, e, 2, env,
                                    print_every=0, max_steps=steps)
    return epoch, False


def _our_loop(spec: RunSpec, place: Placement, split, per_rank: int):
    from .bench import constant_scheduler
    from .config import TrainConfig
    from .data import ArrayDataset, DeviceAugment
    from .engine import train_epoch
    from .model import build_model, unwrap
    from .optim import build_optimizer

    cuda = place.device.type == "cuda"
    speed = Speed.choose("auto", "auto", use_gpu=cuda, cuda_available=cuda)
    if cuda:
        torch.backends.cudnn.benchmark = True
    model = build_model(spec.model, spec.stem, spec.num_classes)
    if speed.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = place.wrap_model(model, **DDP_KWARGS)
    optimizer = build_optimizer(unwrap(model), TrainConfig(batch_size=spec.global_batch,
                                                           lr_ref_batch=spec.global_batch),
                                place.world, place.device)
    scheduler = constant_scheduler(optimizer)
    ds = ArrayDataset(split)
    sampler = place.sampler(ds)
    loader = place.wrap_loader(DataLoader(ds, batch_size=per_rank, shuffle=sampler is None, sampler=sampler,
                                          drop_last=True, collate_fn=ds.collate_fn, pin_memory=cuda), move=True)
    augment, loss_fn = DeviceAugment(place.device, speed.channels_last), nn.CrossEntropyLoss()

    def epoch(e: int, steps: int):
        _set_epoch(loader, e)
        return train_epoch(model, loader, optimizer, scheduler, loss_fn, augment, place.device,
                           speed.bf16, max_steps=steps)
    return epoch, speed.bf16


def machine_busy_s() -> Optional[float]:
    """CPU seconds this machine has been busy (all cores, all processes; Linux /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait


def own_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_loop(spec: RunSpec, place: Placement) -> Optional[dict]:
    """Warm-up steps, then timed steps; rank 0 returns everyone's figures, the others None."""
    from .data import make_synthetic
    from .engine import peak_rss_gib

    torch.set_num_threads(spec.threads)
    torch.manual_seed(0)
    split = make_synthetic(spec.global_batch * max(spec.steps, spec.warmup), 0, True)
    per_rank = spec.global_batch // place.world
    epoch, bf16 = (_seed_loop if spec.loop == "seed" else _our_loop)(spec, place, split, per_rank)
    warm = epoch(0, spec.warmup)
    busy0, own0 = machine_busy_s(), own_cpu_s()
    timed = epoch(1, spec.steps)
    busy1, own1 = machine_busy_s(), own_cpu_s()
    cuda = place.device.type == "cuda"
    mine = dict(rank=place.rank, host=socket.gethostname(), count=timed.count, wall_s=timed.wall_s, steps=timed.steps,
                step_s_median=statistics.median(timed.step_times) if timed.step_times else None,
                split_s=dict(data=timed.data_s, fwd_bwd=timed.fwd_bwd_s, optim=timed.optim_s),
                own_cpu_s=own1 - own0, machine_busy_s=None if busy0 is None else busy1 - busy0,
                first_step_time=warm.first_step_time, peak_host_mem_gib=peak_rss_gib(),
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
                step_ms_median=1000 * mine["step_s_median"] if mine["step_s_median"] else None,
                # rank 0's mean ms per step: waiting for data (+ its preprocessing), forward +
                # backward (the seed's loop: + optimizer step), optimizer step
                split_ms={k: 1000 * v / max(timed.steps, 1) for k, v in mine["split_s"].items()},
                first_step_time=min(r["first_step_time"] for r in everyone),
                peak_host_mem_gib=max(r["peak_host_mem_gib"] for r in everyone),
                peak_host_mem_gib_per_process=[r["peak_host_mem_gib"] for r in everyone],
                peak_gpu_mem_gib=max(gpu) if gpu else None,
                other_cpu_share=other_cpu_share(mine, everyone))


def other_cpu_share(rank0: dict, everyone: list[dict]) -> Optional[float]:
    """Share of rank 0's machine busy OUTSIDE the training processes during the timed steps: the
    launcher's own processes (Ray's daemons) plus anyone else's jobs. Counts the processes on rank
    0's host only (same hostname), so it stays meaningful on several nodes."""
    if rank0["machine_busy_s"] is None or not rank0["wall_s"]:
        return None
    own = sum(r["own_cpu_s"] for r in everyone if r["host"] == rank0["host"])
    return max(0.0, rank0["machine_busy_s"] - own) / (rank0["wall_s"] * (os.cpu_count() or 1))


def worker_main(argv: list[str]) -> int:
    """One torchrun process: `python -m ray_job.vsddp SPEC.json`."""
    from .peers.seed_ddp import dist_env, init_distributed
    from .runlog import read_json, write_json

    spec = RunSpec(**read_json(argv[0]))
    env = dist_env()
    device = init_distributed(env)
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


# --- launching ----------------------------------------------------------------------------------

class SeedRecipe:
    """The seed's optimiser settings (ray_job.peers.seed_ddp's defaults)."""

    lr = 1e-4
    momentum = 0.9
    batch = 128


def child_env(threads: int) -> dict:
    """Environment of launched processes: they find this ray_job even when it is not installed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "OMP_NUM_THREADS": str(threads),
            "PYTHONPATH": root + (os.pathsep + path if path else "")}


def torchrun_cmd(workers: int, *module_args: str) -> list[str]:
    """torchrun (as `python -m torch.distributed.run`, which is what the torchrun script runs)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
            "-m", *module_args]


def _tail(path: str, n: int = 25) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def launch_torchrun(spec: RunSpec, workers: int, work: str, timeout: float) -> dict:
    from .runlog import read_json, write_json

    name = f"torchrun_{spec.loop}"
    spec = dataclasses.replace(spec, out=os.path.join(work, f"{name}.json"))
    write_json(os.path.join(work, f"{name}_spec.json"), dataclasses.asdict(spec))
    log = os.path.join(work, f"{name}.log")
    launched = time.time()
    with open(log, "w") as f:
        proc = subprocess.run(torchrun_cmd(workers, "ray_job.vsddp", os.path.join(work, f"{name}_spec.json")),
                              stdout=f, stderr=subprocess.STDOUT, env=child_env(spec.threads), timeout=timeout)
    if proc.returncode != 0 or not os.path.exists(spec.out):
        raise RuntimeError(f"torchrun exited with {proc.returncode}; last lines of {log}:\n{_tail(log)}")
    result = read_json(spec.out)
    result.update(launcher="torchrun", launch_to_first_step_s=result["first_step_time"] - launched,
                  process_wall_s=time.time() - launched, log=log)
    return result


def launch_ray(spec: RunSpec, workers: int, work: str) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    resources = {"CPU": spec.threads, **({"GPU": 1} if spec.cuda else {})}
    trainer = TorchTrainer(
        _ray_worker, train_loop_config={"spec": dataclasses.asdict(spec)},
        torch_config=TorchConfig(backend="nccl" if spec.cuda else "gloo"),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=spec.cuda, resources_per_worker=resources),
        run_config=RunConfig(name=f"vsddp_{spec.loop}_{int(time.time())}", storage_path=os.path.join(work, "ray")))
    launched = time.time()
    result = trainer.fit().return_value
    result.update(launcher="ray", launch_to_first_step_s=result["first_step_time"] - launched,
                  process_wall_s=time.time() - launched)
    return result


def connect_ray(workers: int, cuda: bool) -> tuple[float, int]:
    """Joins $RAY_ADDRESS or starts a local cluster: (seconds it took, torch threads per process).

    Every process of either launcher gets the same share of the CPUs this machine and the Ray
    cluster both have; fails if N workers of that size cannot fit."""
    import ray

    from .config import TrainConfig
    from .launch import connect, workers_that_fit

    t = time.time()
    connect(TrainConfig())
    cpus = min(len(os.sched_getaffinity(0)), int(ray.cluster_resources().get("CPU", 1)))
    threads = max(1, cpus // workers)
    fits = workers_that_fit(threads, 1 if cuda else 0)
    if fits < workers:
        raise UsageError(f"--workers {workers} of {threads} CPU{' + 1 GPU' if cuda else ''} cannot fit: the "
                         f"Ray cluster holds {fits}; lower --workers")
    return time.time() - t, threads


def machine(cuda: bool) -> str:
    import platform

    if cuda:
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    return f"CPU ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"


def sizes(cfg, cuda: bool) -> dict:
    """--vs-ddp sizes: the seed's global batch of 128 unless given; enough steps to be steady."""
    stem = (cfg.stems or "imagenet").split(",")[0]
    if stem not in ("imagenet", "cifar"):
        raise UsageError(f"--stems takes imagenet or cifar, not {stem!r}")
    return dict(model=cfg.model, stem=stem, global_batch=cfg.batch_size or SeedRecipe.batch,
                steps=cfg.steps or (50 if cuda else 12), warmup=cfg.warmup or (10 if cuda else 2))


def check_workers(workers: int, global_batch: int, cuda: bool) -> None:
    if workers < 1:
        raise UsageError("--workers must be at least 1")
    if cuda and workers > torch.cuda.device_count():
        raise UsageError(f"--workers {workers} needs {workers} GPUs (one per process); this machine has "
                         f"{torch.cuda.device_count()}")
    if global_batch < workers:
        raise UsageError(f"--batch-size {global_batch} (global) is smaller than --workers {workers}")


def measure_vs_ddp(cfg) -> dict:
    """The four runs, the ceiling and the ratios, as one report."""
    from .model import build_model

    cuda = torch.cuda.is_available()
    size = sizes(cfg, cuda)
    check_workers(cfg.workers, size["global_batch"], cuda)
    work = os.path.join(os.path.dirname(cfg.out), "bench_vs_ddp")
    os.makedirs(work, exist_ok=True)
    cluster_s, threads = connect_ray(cfg.workers, cuda)
    load_before = os.getloadavg()
    peaks = device_peaks(cuda, cfg.matmul_size)
    flops = flops_per_image(build_model(size["model"], size["stem"], 10))
    report = dict(kind="vs_ddp", date=time.strftime("%Y-%m-%d %H:%M:%S %z"), device=machine(cuda),
                  torch=torch.__version__, workers=cfg.workers, threads_per_process=threads, **size,
                  repeats=cfg.repeats, ceiling=peaks, flops_per_image=flops, ray_cluster_start_s=cluster_s,
                  runs={}, failed_passes={})
    devices = cfg.workers if cuda else 1  # on CPU the measured peak is already the whole machine's
    passes: dict[str, list] = {}
    for rep in range(cfg.repeats):
        for loop in LOOPS:  # interleaved, so that a change of machine load hits both launchers alike
            spec = RunSpec(loop=loop, model=size["model"], stem=size["stem"], global_batch=size["global_batch"],
                           steps=size["steps"], warmup=size["warmup"], threads=threads, cuda=cuda)
            for launcher in LAUNCHERS:
                key = f"{launcher}_{loop}"
                print(f"vs-ddp: {launcher} with {cfg.workers} process(es), {loop} loop (pass {rep + 1}/"
                      f"{cfg.repeats}) ...", flush=True)
                try:
                    run = (launch_torchrun(spec, cfg.workers, work, cfg.run_timeout_s) if launcher == "torchrun"
                           else launch_ray(spec, cfg.workers, work))
                except Exception as e:  # keep the other runs' figures; the report says what failed
                    report["failed_passes"][f"{key}_pass{rep + 1}"] = f"{type(e).__name__}: {e}"[:2000]
                    print(f"vs-ddp: {key} failed: {e}", file=sys.stderr, flush=True)
                    continue
                peak = peaks.get(run["precision"], peaks["fp32"])
                run.update(flop_share(run["images_per_s"], flops["train_step"], peak, devices), passed=rep + 1)
                passes.setdefault(key, []).append(run)
    # each configuration's pass under the cleanest conditions: least CPU used outside its processes
    report["runs"] = {key: min(runs, key=lambda r: r["other_cpu_share"] if r["other_cpu_share"] is not None
                               else float("inf")) for key, runs in passes.items()}
    report["passes"] = passes
    report["errors"] = {key: next(v for k, v in report["failed_passes"].items() if k.startswith(key + "_pass"))
                        for key in (f"{lr}_{lp}" for lp in LOOPS for lr in LAUNCHERS) if key not in passes}
    report["load_avg"] = dict(before=list(load_before), after=list(os.getloadavg()))
    report["ratios"] = ratios(report["runs"])
    return report


def _ratio(a: Optional[dict], b: Optional[dict], key: str = "images_per_s") -> Optional[float]:
    return a[key] / b[key] if a and b and a.get(key) and b.get(key) else None


def ratios(runs: dict) -> dict:
    return dict(ray_vs_torchrun={loop: _ratio(runs.get(f"ray_{loop}"), runs.get(f"torchrun_{loop}"))
                                 for loop in LOOPS},
                ours_vs_seed={launcher: _ratio(runs.get(f"{launcher}_ours"), runs.get(f"{launcher}_seed"))
                              for launcher in LAUNCHERS})


def _f(value: Optional[float], spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def format_peaks(peaks: dict) -> str:
    parts = [f"{k} {peaks[k] / 1e9:,.1f} GFLOP/s" for k in ("fp32", "bf16") if k in peaks]
    return f"device peak (dense {peaks['matmul_n']}x{peaks['matmul_n']} matmul, {peaks['threads']} threads): " \
           + ", ".join(parts)


def format_vs_ddp(r: dict) -> str:
    load = r["load_avg"]
    lines = [f"bench --vs-ddp {r['date']} on {r['device']} (torch {r['torch']}): {r['workers']} process(es) x "
             f"{r['threads_per_process']} thread(s), {r['model']}/{r['stem']} stem, global batch "
             f"{r['global_batch']}, {r['steps']} timed steps after {r['warmup']}, best of {r['repeats']} "
             f"pass(es) by other CPU; load average "
             f"{load['before'][0]:.2f} -> {load['after'][0]:.2f}",
             format_peaks(r["ceiling"]),
             f"model: {r['flops_per_image']['train_step'] / 1e9:.3f} GFLOP per image per training step "
             f"({r['flops_per_image']['forward'] / 1e9:.3f} forward); Ray cluster start "
             f"{r['ray_cluster_start_s']:.1f} s (before the runs, not in them)",
             f"{'launcher':<10}{'loop':<6}{'prec':>6}{'img/s':>10}{'step ms':>9}{'launch->1st step s':>20}"
             f"{'peak host GiB/proc':>20}{'peak GPU GiB/proc':>19}{'GFLOP/s':>10}{'of peak':>9}"
             f"{'other CPU':>10}"]
    for run in r["runs"].values():
        lines.append(f"{run['launcher']:<10}{run['loop']:<6}{run['precision']:>6}{run['images_per_s']:>10.1f}"
                     f"{_f(run['step_ms_median'], '.1f'):>9}{run['launch_to_first_step_s']:>20.1f}"
                     f"{run['peak_host_mem_gib']:>20.2f}{_f(run['peak_gpu_mem_gib'], '.2f'):>19}"
                     f"{_f(run['achieved_flops'], ',.1f', 1e-9):>10}{_f(run['flop_share'], '.1%'):>9}"
                     f"{_f(run['other_cpu_share'], '.0%'):>10}")
    lines.append("other CPU: share of the machine busy outside the training processes during the timed steps "
                 "(the launcher's own processes, plus anyone else's jobs)")
    for key, err in r["errors"].items():
        lines.append(f"{key}: FAILED ({err.splitlines()[0][:150]})")
    rt = r["ratios"]
    lines.append("ray/torchrun (same loop): " + ", ".join(
        f"{loop} loop {_f(v, '.1%')}" for loop, v in rt["ray_vs_torchrun"].items())
        + "   (target: within 3%)")
    lines.append("ours/seed's loop: " + ", ".join(
        f"{launcher} {_f(v, '.2f')}x" for launcher, v in rt["ours_vs_seed"].items()) + "   (target: >= 1)")
    return "\n".join(lines)


# --- time to accuracy ---------------------------------------------------------------------------

def _first_at(history: list[dict], acc: float) -> Optional[dict]:
    return next((h for h in history if h["test_acc"] is not None and h["test_acc"] >= acc), None)


def _recipe_result(history: list[dict], launched: float, first_step: Optional[float], target: float,
                   stopped: str, wall_s: float, **extra: Any) -> dict:
    hist = [dict(h, t_s=h["time"] - launched) for h in history]
    hit = _first_at(hist, target)
    accs = [h["test_acc"] for h in hist if h["test_acc"] is not None]
    return dict(stopped=stopped, evaluations=len(hist), final_acc=accs[-1] if accs else None,
                best_acc=max(accs) if accs else None, reached=hit is not None, wall_s=wall_s,
                time_to_target_s=hit["t_s"] if hit else None,
                train_time_to_target_s=(hit["time"] - first_step) if hit and first_step else None,
                launch_to_first_step_s=(first_step - launched) if first_step else None,
                history=[dict(epoch=h["epoch"], t_s=h["t_s"], test_acc=h["test_acc"]) for h in hist], **extra)


def race_seed(cfg, size: dict, work: str, threads: int, data_args: list[str]) -> dict:
    """The seed's recipe: the peer under torchrun, stopping at the target or the budget."""
    from .runlog import read_json

    report = os.path.join(work, "seed_report.json")
    steps = cfg.eval_every_images // SeedRecipe.batch if cfg.eval_every_images else 0
    args = ["ray_job.peers.seed_ddp", "--model", size["model"], "--stem", size["stem"], "--num-classes", "10",
            *data_args, "--epochs", "100000", "--target-acc", str(cfg.to_accuracy),
            "--time-budget-s", str(cfg.budget_s), "--steps-per-epoch", str(steps),
            "--checkpoint-dir", os.path.join(work, "seed_checkpoints"), "--report-json", report,
            *shlex.split(cfg.seed_flags)]
    log = os.path.join(work, "seed.log")
    launched = time.time()
    with open(log, "w") as f:
        proc = subprocess.run(torchrun_cmd(cfg.workers, *args), stdout=f, stderr=subprocess.STDOUT,
                              env=child_env(threads), timeout=cfg.budget_s * 2 + 600)
    wall = time.time() - launched
    if proc.returncode != 0 or not os.path.exists(report):
        raise RuntimeError(f"the seed recipe exited with {proc.returncode}; last lines of {log}:\n{_tail(log)}")
    r = read_json(report)
    keep = f"epoch_{r['epochs'][-1]['epoch']}" if r["epochs"] else None
    for folder in os.listdir(os.path.join(work, "seed_checkpoints")):  # one per evaluation: keep the last
        if folder != keep:
            shutil.rmtree(os.path.join(work, "seed_checkpoints", folder), ignore_errors=True)
    return _recipe_result(r["epochs"], launched, r["first_step_time"], cfg.to_accuracy, r["stopped"], wall,
                          launcher="torchrun", recipe="seed: fp32, global batch 128, SGD lr 1e-4 momentum 0.9, "
                          "PIL pipeline", log=log, command="torchrun " + shlex.join(args))


def race_ours(cfg, size: dict, work: str, threads: int, data_args: list[str]) -> dict:
    """`train --recipe fast` under Ray Train; a watcher asks it to stop (ray_job.stop) at the
    target or the budget."""
    from . import stop
    from .cli import parse_train_args
    from .launch import run_training
    from .runlog import EVENTS_JSONL, METRICS_JSONL, read_jsonl

    name = f"race_ours_{time.strftime('%Y%m%d_%H%M%S')}"
    argv = ["--recipe", "fast", "--model", size["model"], "--stem", size["stem"], *data_args,
            "--num-workers", str(cfg.workers), "--cpus-per-worker", str(threads), "--storage-path", work,
            "--name", name, "--log-every", "0",
            "--max-failures", "0", "--keep-checkpoints", "1", *shlex.split(cfg.ours_flags)]
    train_cfg = parse_train_args(argv)
    if cfg.eval_every_images:
        steps = max(1, cfg.eval_every_images // train_cfg.global_batch(cfg.workers))
        train_cfg = dataclasses.replace(train_cfg, steps_per_epoch=steps)
    run_dir = os.path.join(work, name)
    launched = time.time()
    deadline = launched + cfg.budget_s
    done, why = threading.Event(), {"stopped": "epochs"}

    def watch() -> None:
        while not done.wait(0.5):
            try:
                rows = read_jsonl(os.path.join(run_dir, METRICS_JSONL))
            except ValueError:  # a line being written
                continue
            reached = bool(rows) and rows[-1]["test_acc"] >= cfg.to_accuracy
            if reached or time.time() > deadline:
                why["stopped"] = "target" if reached else "budget"
                stop.request(run_dir)
                return

    watcher = threading.Thread(target=watch, name="race-watch", daemon=True)
    watcher.start()
    try:
        code = run_training(train_cfg)
    finally:
        done.set()
        watcher.join()
    wall = time.time() - launched
    if code not in (0, 3):
        raise RuntimeError(f"--recipe fast exited with {code} (see the lines above)")
    if code == 0 and why["stopped"] == "budget":  # it finished its epochs before the stop took effect
        why["stopped"] = "epochs"
    rows = read_jsonl(os.path.join(run_dir, METRICS_JSONL))
    first = [e["time"] for e in read_jsonl(os.path.join(run_dir, EVENTS_JSONL)) if e["event"] == "first_step"]
    history = [dict(epoch=r["epoch"], time=r["time"], test_acc=r["test_acc"]) for r in rows]
    return _recipe_result(history, launched, first[0] if first else None, cfg.to_accuracy, why["stopped"],
                          wall, launcher="ray", recipe="ours: train --recipe fast", run_dir=run_dir,
                          command="python -m ray_job train " + shlex.join(argv))


def measure_to_accuracy(cfg) -> dict:
    from .config import TrainConfig
    from .data import check_data, load_splits

    cuda = torch.cuda.is_available()
    size = sizes(cfg, cuda)
    check_workers(cfg.workers, SeedRecipe.batch, cuda)
    if cfg.budget_s <= 0:
        raise UsageError("--to-accuracy needs a positive --budget-s")
    work = os.path.join(os.path.dirname(cfg.out), f"bench_to_accuracy_{time.strftime('%Y%m%d_%H%M%S')}")
    os.makedirs(work, exist_ok=True)
    data_args = ["--data", cfg.data, "--data-dir", cfg.data_dir, "--synthetic-train-size",
                 str(cfg.synthetic_train_size), "--synthetic-test-size", str(cfg.synthetic_test_size)]
    data_cfg = TrainConfig(data=cfg.data, data_dir=cfg.data_dir, synthetic_train_size=cfg.synthetic_train_size,
                           synthetic_test_size=cfg.synthetic_test_size)
    check_data(data_cfg)
    t = time.time()
    load_splits(data_cfg)  # decodes an image folder once into its cache, so neither recipe pays for it
    data_s = time.time() - t
    cluster_s, threads = connect_ray(cfg.workers, cuda)
    load_before = os.getloadavg()
    report = dict(kind="to_accuracy", date=time.strftime("%Y-%m-%d %H:%M:%S %z"), device=machine(cuda),
                  torch=torch.__version__, workers=cfg.workers, target_acc=cfg.to_accuracy, budget_s=cfg.budget_s,
                  data=cfg.data, data_dir=cfg.data_dir, eval_every_images=cfg.eval_every_images,
                  data_prepare_s=data_s, ray_cluster_start_s=cluster_s, **size)
    report["seed"] = race_seed(cfg, size, work, threads, data_args)
    report["ours"] = race_ours(cfg, size, work, threads, data_args)
    report["load_avg"] = dict(before=list(load_before), after=list(os.getloadavg()))
    report["comparison"] = compare(report["seed"], report["ours"], cfg.to_accuracy)
    return report


def compare(seed: dict, ours: dict, target: float) -> dict:
    """Our time to the accuracy the seed reached (the target, or its final one if it fell short)."""
    if seed["final_acc"] is None:
        return dict(reference_acc=None, seed_s=None, ours_s=None, ours_vs_seed_time=None)
    ref = min(target, seed["best_acc"]) if seed["reached"] else seed["final_acc"]
    s, o = _first_at(seed["history"], ref), _first_at(ours["history"], ref)
    return dict(reference_acc=ref, seed_s=s["t_s"] if s else None, ours_s=o["t_s"] if o else None,
                ours_vs_seed_time=(o["t_s"] / s["t_s"]) if s and o else None)


def format_to_accuracy(r: dict) -> str:
    load = r["load_avg"]
    lines = [f"bench --vs-ddp --to-accuracy {r['target_acc']} {r['date']} on {r['device']}: {r['workers']} "
             f"process(es), {r['model']}/{r['stem']} stem, data {r['data']}, budget {r['budget_s']:.0f} s "
             f"each; load average {load['before'][0]:.2f} -> {load['after'][0]:.2f}",
             f"{'recipe':<8}{'launcher':<10}{'stopped':<9}{'evals':>6}{'final acc':>10}{'best acc':>9}"
             f"{'wall s':>8}{'1st step s':>11}{'to target s':>12}{'(train s)':>10}"]
    for key in ("seed", "ours"):
        x = r[key]
        lines.append(f"{key:<8}{x['launcher']:<10}{x['stopped']:<9}{x['evaluations']:>6}"
                     f"{_f(x['final_acc'], '.4f'):>10}{_f(x['best_acc'], '.4f'):>9}{x['wall_s']:>8.1f}"
                     f"{_f(x['launch_to_first_step_s'], '.1f'):>11}{_f(x['time_to_target_s'], '.1f'):>12}"
                     f"{_f(x['train_time_to_target_s'], '.1f'):>10}")
    c = r["comparison"]
    lines.append(f"seed's accuracy {_f(c['reference_acc'], '.4f')}: seed {_f(c['seed_s'], '.1f')} s, ours "
                 f"{_f(c['ours_s'], '.1f')} s from launch -> ours/seed {_f(c['ours_vs_seed_time'], '.2f')}x "
                 f"(target: <= 0.33)")
    return "\n".join(lines)


def main(cfg) -> int:
    """`bench --vs-ddp [--to-accuracy A]`, called by bench.main with its BenchConfig."""
    from .runlog import write_json

    if cfg.to_accuracy:
        report = measure_to_accuracy(cfg)
        text = format_to_accuracy(report)
    else:
        report = measure_vs_ddp(cfg)
        text = format_vs_ddp(report)
    print(text)
    write_json(cfg.out, report)
    print(f"written: {cfg.out}")
    return 1 if report.get("errors") else 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
