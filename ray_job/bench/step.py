"""`python -m ray_job bench step`: images/s of the raw-DDP baseline's pipeline against this
project's training step, measured in one run on whatever device is there:
  1. baseline  the raw-DDP baseline's pipeline: fp32, batch 128, PIL transforms per sample in a
               DataLoader with 0 workers, torchvision ResNet with its 1000-class head;
  2. compute   this project's step on one batch already on the device (augmentation included):
               the ceiling for the data path;
  3. fast      this project's step without Ray: uint8 batches, pinned, copied, augmented on device;
  4. ray       the same step inside Ray Train with 1 worker (prepare_model / prepare_data_loader).
It prints images/s, the data-loading share, peak memory and the ratios, and writes JSON, with the
ceiling (common.py): each row's achieved FLOP/s as a share of the device's matmul peak.

    python -m ray_job bench step                       # CPU-sized defaults, about a minute on 2 cores
    python -m ray_job bench step --stems imagenet,cifar --batch-size 2048 --steps 50   # one GPU
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from ..config import RESNETS
from ..core.errors import UsageError
from ..core.flags import option
from ..peers.raw_ddp import baseline_optimizer, build_baseline_model
from .common import (BASELINE, device_and_flags, device_peaks, fast_setup, flop_share, flops_per_image, fmt,
                     format_peaks, machine, run_steps)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    model: str = option("resnet50", "torchvision ResNet to time", choices=RESNETS)
    stems: str = option("", "comma list of stems (imagenet, cifar); default: imagenet on CPU, imagenet,cifar on GPU")
    batch_size: int = option(0, "batch size; 0 = 256 on CPU, 2048 (imagenet stem) / 512 (cifar stem) on GPU")
    steps: int = option(0, "timed steps; 0 = 4 on CPU, 50 on GPU")
    warmup: int = option(0, "untimed steps first; 0 = 1 on CPU, 15 on GPU")
    baseline_steps: int = option(0, "steps of the raw-DDP baseline's pipeline; 0 = 4 on CPU, 100 on GPU")
    compile: bool = option(False, "torch.compile this project's model")
    ray: bool = option(True, "also time the step under Ray Train (1 worker)")
    matmul_size: int = option(0, "n of the n x n matmul that measures the device's peak FLOP/s; 0 = 2048 on "
                              "CPU, 8192 on GPU")
    out: str = option("results/bench_step.json", "where the JSON report goes")

    def __post_init__(self) -> None:
        if min(self.batch_size, self.steps, self.warmup, self.baseline_steps, self.matmul_size) < 0:
            raise UsageError("bench sizes must not be negative (0 picks the device's default)")

    def resolved(self, cuda: bool) -> StepConfig:
        pick = (lambda gpu, cpu: gpu if cuda else cpu)
        return dataclasses.replace(
            self, stems=self.stems or pick("imagenet,cifar", "imagenet"),
            steps=self.steps or pick(50, 4), warmup=self.warmup or pick(15, 1),
            baseline_steps=self.baseline_steps or pick(100, 4))

    def batch_for(self, stem: str, cuda: bool) -> int:
        if self.batch_size:
            return self.batch_size
        return (2048 if stem == "imagenet" else 512) if cuda else 256


def bench_fast(cfg: StepConfig, stem: str, cuda: bool, compute: bool = True, **prepare) -> dict:
    """The fast path's images/s and, with `compute`, the same step on one batch already on the device."""
    batch = cfg.batch_for(stem, cuda)
    model, opt, batches, aug, device, bf16 = fast_setup(
        cfg.model, stem, batch, batch * max(cfg.steps, cfg.warmup), cuda, cfg.compile, **prepare)
    result = {"fast": run_steps(model, batches, opt, aug, device, bf16, cfg.steps, cfg.warmup)}
    if compute:
        x, y = next(iter(batches()))
        fixed = (lambda: iter([(x, y)] * max(cfg.steps, cfg.warmup)))
        result["compute"] = run_steps(model, fixed, opt, aug, device, bf16, cfg.steps, cfg.warmup)
    return result


def bench_baseline(cfg: StepConfig, cuda: bool) -> dict:
    """The raw-DDP baseline's pipeline: its model, optimizer and per-sample PIL transforms; nothing of
    this project's training code but the timer."""
    from ..data.arrays import TorchvisionDataset
    from ..data.synthetic import make_synthetic

    device = torch.device("cuda") if cuda else torch.device("cpu")
    model = build_baseline_model(cfg.model, BASELINE.num_classes, "imagenet").to(device)
    opt = baseline_optimizer(model, BASELINE.lr, BASELINE.momentum)
    ds = TorchvisionDataset(make_synthetic(BASELINE.batch_size * max(cfg.baseline_steps, 2), 0, True), train=True)

    def batches():
        return iter(torch.utils.data.DataLoader(ds, batch_size=BASELINE.batch_size, shuffle=True, num_workers=0))

    return run_steps(model, batches, opt, lambda x, train: x.to(device), device, False, cfg.baseline_steps, 1)


def _ray_worker(config: dict) -> dict:
    import ray.train.torch

    from ..train.build import ray_placement

    torch.set_num_threads(config["threads"])
    return bench_fast(StepConfig(**config["bench"]), config["stem"], torch.cuda.is_available() and config["cuda"],
                      False, prepare_model=ray_placement().model,
                      prepare_loader=ray.train.torch.prepare_data_loader)["fast"]


def bench_ray(cfg: StepConfig, stem: str, cuda: bool) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ..config import TrainConfig
    from ..train.trainer import connect

    connect(TrainConfig())  # $RAY_ADDRESS, else a local cluster
    threads = torch.get_num_threads()
    trainer = TorchTrainer(
        _ray_worker,
        train_loop_config={"bench": dataclasses.asdict(cfg), "stem": stem, "threads": threads, "cuda": cuda},
        scaling_config=ScalingConfig(num_workers=1, use_gpu=cuda, resources_per_worker={"CPU": threads}),
        run_config=RunConfig(name=f"bench_{stem}_{int(time.time())}",
                             storage_path=os.path.join(os.path.dirname(cfg.out), "bench_ray")))
    return trainer.fit().return_value


def add_flop_shares(report: dict, cuda: bool) -> None:
    """The ceiling: each row's achieved FLOP/s as a share of the device's measured matmul peak."""
    from ..model.zoo import named as build_model

    cfg, peaks = report["config"], report["ceiling"]
    ours = "bf16" if device_and_flags(cuda)[1] else "fp32"
    groups = [("fp32", build_baseline_model(cfg["model"], BASELINE.num_classes, "imagenet"),
                [report["baseline"]])]
    for stem in cfg["stems"].split(","):
        rows = [report[stem][k] for k in ("compute", "fast", "ray") if k in report[stem]]
        groups.append((ours, build_model(cfg["model"], stem, 10), rows))
    for precision, model, rows in groups:
        flops = flops_per_image(model)["train_step"]
        for row in rows:
            row.update(precision=precision, flops_per_image=flops,
                       **flop_share(row["images_per_s"], flops, peaks.get(precision, peaks["fp32"])))


def main(cfg: StepConfig) -> dict:
    cuda = torch.cuda.is_available()
    cfg = cfg.resolved(cuda)
    report = dict(date=time.strftime("%Y-%m-%d %H:%M"), device=torch.cuda.get_device_name() if cuda else machine(False),
                  torch=torch.__version__, threads=torch.get_num_threads(), config=dataclasses.asdict(cfg),
                  load_avg_before=list(os.getloadavg()))
    report["ceiling"] = device_peaks(cuda, cfg.matmul_size)
    report["baseline"] = bench_baseline(cfg, cuda)
    for stem in cfg.stems.split(","):
        if stem not in ("imagenet", "cifar"):
            raise UsageError(f"--stems takes imagenet and/or cifar, not {stem!r}")
        entry = bench_fast(cfg, stem, cuda)
        entry["speedup_vs_baseline"] = entry["fast"]["images_per_s"] / report["baseline"]["images_per_s"]
        entry["fast_vs_compute"] = entry["fast"]["images_per_s"] / entry["compute"]["images_per_s"]
        if cfg.ray:
            entry["ray"] = bench_ray(cfg, stem, cuda)
            entry["ray_vs_fast"] = entry["ray"]["images_per_s"] / entry["fast"]["images_per_s"]
        report[stem] = entry
    add_flop_shares(report, cuda)
    report["load_avg_after"] = list(os.getloadavg())
    print(format_report(report))
    return report


def format_report(r: dict) -> str:
    lines = [f"bench step {r['date']} on {r['device']} (torch {r['torch']}, {r['threads']} threads); load average "
             f"{r['load_avg_before'][0]:.2f} -> {r['load_avg_after'][0]:.2f}",
             format_peaks(r["ceiling"]),
             f"{'pipeline':<24}{'batch':>7}{'img/s':>11}{'data share':>12}{'peak GPU GiB':>14}{'peak host GiB':>15}"
             f"{'GFLOP/s':>10}{'of peak':>9}"]

    def row(name, m):
        lines.append(f"{name:<24}{m['batch']:>7}{m['images_per_s']:>11.1f}{m['data_share']:>11.0%}"
                     f"{fmt(m.get('peak_gpu_mem_gib'), '.2f'):>14}{m['peak_host_mem_gib']:>15.2f}"
                     f"{fmt(m.get('achieved_flops'), ',.1f', 1e-9):>10}{fmt(m.get('flop_share'), '.1%'):>9}")

    row("raw-DDP baseline (fp32, PIL)", r["baseline"])
    for stem in r["config"]["stems"].split(","):
        e = r[stem]
        for kind in ("compute", "fast", "ray"):
            if kind in e:
                row(f"{stem} stem: {kind}", e[kind])
        ratios = (f"  {stem} stem: fast/baseline {e['speedup_vs_baseline']:.2f}x, "
                  f"fast/compute {e['fast_vs_compute']:.0%}")
        if "ray_vs_fast" in e:
            ratios += f", ray/fast {e['ray_vs_fast']:.1%}"
        lines.append(ratios)
    return "\n".join(lines)

