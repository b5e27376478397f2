"""`python -m ray_job bench vs-ddp`: this project side by side with the raw-DDP baseline.

The same model, global batch and steps, run four times on synthetic data:
    torchrun  baseline loop  the raw-DDP baseline's loop (ray_job.peers.raw_ddp: fp32, PIL per
                             sample, SGD)
    ray       baseline loop  the same code in a Ray Train worker (prepare_model / prepare_data_loader)
    torchrun  our loop       this project's step (uint8 batches, device augmentation, Speed.choose)
    ray       our loop       the same under Ray Train, as `train` runs it
Under torchrun the loops wrap DDP and a DistributedSampler themselves, exactly as Ray's prepare_*
helpers do; everything else is the same function (`run_loop`). The ratios: Ray/torchrun for the
same loop, ours/the baseline's loop; each run also as a share of the device's peak (common.py).

    python -m ray_job bench vs-ddp --workers 2
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Optional

import torch

from ..config import RESNETS, STEMS
from ..core.errors import UsageError
from ..core.flags import option
from ..storage import read_json, write_json
from .common import (BASELINE, check_workers, connect_ray, device_peaks, flop_share, flops_per_image, fmt,
                     format_peaks, machine, run_torchrun)
from .loops import LOOPS, RunSpec, _ray_worker


@dataclasses.dataclass(frozen=True)
class VsDdpConfig:
    workers: int = option(1, "processes (torchrun) and workers (Ray Train); one GPU each on GPU")
    model: str = option("resnet50", "torchvision ResNet", choices=RESNETS)
    stem: str = option("imagenet", "the model's stem", choices=STEMS)
    batch_size: int = option(0, "global batch; 0 = the baseline's 128")
    steps: int = option(0, "timed steps; 0 = 12 on CPU, 50 on GPU")
    warmup: int = option(0, "untimed steps first; 0 = 2 on CPU, 10 on GPU")
    repeats: int = option(1, "passes over the four runs, interleaved; each keeps its pass with the least "
                          "CPU used outside its processes (other jobs, the launcher's daemons)")
    run_timeout_s: float = option(1800.0, "give up on a torchrun run after this many seconds")
    matmul_size: int = option(0, "n of the n x n matmul that measures the device's peak FLOP/s; 0 = 2048 on "
                              "CPU, 8192 on GPU")
    out: str = option("results/bench_vs_ddp.json", "where the JSON report goes")

    def __post_init__(self) -> None:
        if min(self.batch_size, self.steps, self.warmup, self.matmul_size) < 0 or self.repeats < 1:
            raise UsageError("bench sizes must not be negative (0 picks the device's default); --repeats >= 1")


LAUNCHERS = ("torchrun", "ray")


def launch(launcher: str, spec: RunSpec, workers: int, work: str, timeout: float) -> dict:
    """One run under torchrun or Ray Train, with the time from its launch to its first finished step."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    extra = {}
    if launcher == "torchrun":
        name = os.path.join(work, f"torchrun_{spec.loop}")
        spec = dataclasses.replace(spec, out=f"{name}.json")
        write_json(f"{name}_spec.json", dataclasses.asdict(spec))
        launched = time.time()
        run_torchrun("torchrun", workers, ["ray_job.bench.loops", f"{name}_spec.json"], spec.threads,
                     f"{name}.log", spec.out, timeout)
        result, extra["log"] = read_json(spec.out), f"{name}.log"
    else:
        resources = {"CPU": spec.threads, **({"GPU": 1} if spec.cuda else {})}
        trainer = TorchTrainer(
            _ray_worker, train_loop_config={"spec": dataclasses.asdict(spec)},
            torch_config=TorchConfig(backend="nccl" if spec.cuda else "gloo"),
            scaling_config=ScalingConfig(num_workers=workers, use_gpu=spec.cuda, resources_per_worker=resources),
            run_config=RunConfig(name=f"vsddp_{spec.loop}_{int(time.time())}", storage_path=os.path.join(work, "ray")))
        launched = time.time()
        result = trainer.fit().return_value
    result.update(launcher=launcher, launch_to_first_step_s=result["first_step_time"] - launched,
                  process_wall_s=time.time() - launched, **extra)
    return result


def main(cfg: VsDdpConfig) -> dict:
    from ..model.zoo import named as build_model

    cuda = torch.cuda.is_available()
    size = dict(model=cfg.model, stem=cfg.stem, global_batch=cfg.batch_size or BASELINE.batch_size,
                steps=cfg.steps or (50 if cuda else 12), warmup=cfg.warmup or (10 if cuda else 2))
    check_workers(cfg.workers, size["global_batch"], cuda)
    work = os.path.join(os.path.dirname(cfg.out), "bench_vs_ddp")
    os.makedirs(work, exist_ok=True)
    cluster_s, threads = connect_ray(cfg.workers, cuda)
    load_before = os.getloadavg()
    peaks = device_peaks(cuda, cfg.matmul_size)
    flops = flops_per_image(build_model(cfg.model, cfg.stem, 10))
    report = dict(kind="vs_ddp", date=time.strftime("%Y-%m-%d %H:%M:%S %z"), device=machine(cuda),
                  torch=torch.__version__, workers=cfg.workers, threads_per_process=threads, **size,
                  repeats=cfg.repeats, ceiling=peaks, flops_per_image=flops, ray_cluster_start_s=cluster_s,
                  runs={}, failed_passes={})
    devices = cfg.workers if cuda else 1  # on CPU the measured peak is already the whole machine's
    passes: dict[str, list] = {}
    for rep in range(cfg.repeats):
        for loop in LOOPS:  # interleaved, so that a change of machine load hits both launchers alike
            spec = RunSpec(loop=loop, **size, threads=threads, cuda=cuda)
            for launcher in LAUNCHERS:
                key = f"{launcher}_{loop}"
                print(f"vs-ddp: {launcher} with {cfg.workers} process(es), {loop} loop (pass {rep + 1}/"
                      f"{cfg.repeats}) ...", flush=True)
                try:
                    run = launch(launcher, spec, cfg.workers, work, cfg.run_timeout_s)
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
    print(format_vs_ddp(report))
    return report


def ratios(runs: dict) -> dict:
    def ratio(a: str, b: str) -> Optional[float]:
        a, b = runs.get(a, {}).get("images_per_s"), runs.get(b, {}).get("images_per_s")
        return a / b if a and b else None

    return dict(ray_vs_torchrun={loop: ratio(f"ray_{loop}", f"torchrun_{loop}") for loop in LOOPS},
                ours_vs_baseline={lr: ratio(f"{lr}_ours", f"{lr}_baseline") for lr in LAUNCHERS})


def format_vs_ddp(r: dict) -> str:
    load = r["load_avg"]
    lines = [f"bench vs-ddp {r['date']} on {r['device']} (torch {r['torch']}): {r['workers']} process(es) x "
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
             f"{'other CPU':>10}{'faults/step':>12}{'sys CPU':>8}"]
    for run in r["runs"].values():
        lines.append(f"{run['launcher']:<10}{run['loop']:<6}{run['precision']:>6}{run['images_per_s']:>10.1f}"
                     f"{fmt(run['step_ms_median'], '.1f'):>9}{run['launch_to_first_step_s']:>20.1f}"
                     f"{run['peak_host_mem_gib']:>20.2f}{fmt(run['peak_gpu_mem_gib'], '.2f'):>19}"
                     f"{fmt(run['achieved_flops'], ',.1f', 1e-9):>10}{fmt(run['flop_share'], '.1%'):>9}"
                     f"{fmt(run['other_cpu_share'], '.0%'):>10}{fmt(run.get('page_faults_per_step'), ',.0f'):>12}"
                     f"{fmt(run.get('system_cpu_share'), '.0%'):>8}")
    lines.append("other CPU: share of the machine busy outside the training processes during the timed steps "
                 "(the launcher's own processes, plus anyone else's jobs); faults/step: minor page faults per "
                 "process and step; sys CPU: the kernel's share of the training processes' CPU time")
    for key, err in r["errors"].items():
        lines.append(f"{key}: FAILED ({err.splitlines()[0][:150]})")
    rt = r["ratios"]
    lines.append("ray/torchrun (same loop): " + ", ".join(
        f"{loop} loop {fmt(v, '.1%')}" for loop, v in rt["ray_vs_torchrun"].items())
        + "   (target: within 3%)")
    lines.append("ours/the baseline's loop: " + ", ".join(
        f"{launcher} {fmt(v, '.2f')}x" for launcher, v in rt["ours_vs_baseline"].items()) + "   (target: >= 1)")
    return "\n".join(lines)
