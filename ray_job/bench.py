"""python -m ray_job bench: images/s of the seed's pipeline against this project's fast path.

Measured in one run, on whatever device is there:
  1. seed      the seed's pipeline: fp32, batch 128, PIL transforms per sample in a DataLoader with
               0 workers, torchvision ResNet with its 1000-class head;
  2. compute   this project's step on one batch already on the device (augmentation included):
               the ceiling for the data path;
  3. fast      this project's step without Ray: uint8 batches, pinned, copied, augmented on device;
  4. ray       the same step inside Ray Train with 1 worker (prepare_model / prepare_data_loader).
It prints images/s, the data-loading share, peak memory and the ratios, and writes JSON. In the
same run it measures the ceiling: the device's dense matmul FLOP/s (fp32; bf16 too on GPU), and each
row's achieved FLOP/s (FLOPs per image, counted once with torch.utils.flop_counter, x images/s) as a
share of it.

`--vs-ddp --workers N` instead compares with the seed's raw DDP (torchrun vs Ray Train, the seed's
loop vs ours), and `--vs-ddp --to-accuracy A` races the two recipes to a test accuracy: see vsddp.py.

    python -m ray_job bench                       # CPU-sized defaults, about a minute here
    python -m ray_job bench --stems imagenet,cifar --batch-size 2048 --steps 50   # one GPU
    python -m ray_job bench --vs-ddp --workers 2  # torchrun vs Ray Train, seed's loop vs ours
    python -m ray_job bench --data-path --data-src DIR   # the input pipeline alone: see databench.py
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from collections.abc import Callable
from typing import Optional

import torch
from torch import nn

from .cli import option
from .config import DATASETS, MODELS, Speed, UsageError, resolve_path

SEED_BATCH = 128


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    model: str = option("resnet50", "torchvision ResNet to time", choices=MODELS)
    stems: str = option("", "comma list of stems (imagenet, cifar); default: imagenet on CPU, "
                        "imagenet,cifar on GPU")
    batch_size: int = option(0, "batch size; 0 = 256 on CPU, 2048 (imagenet stem) / 512 (cifar stem) "
                             "on GPU; with --vs-ddp the global batch, 0 = the seed's 128")
    steps: int = option(0, "timed steps; 0 = 4 on CPU, 50 on GPU (--vs-ddp: 12 on CPU, 50 on GPU)")
    warmup: int = option(0, "untimed steps first; 0 = 1 on CPU, 15 on GPU (--vs-ddp: 2 on CPU, 10 on GPU)")
    seed_steps: int = option(0, "steps of the seed pipeline; 0 = 4 on CPU, 100 on GPU")
    compile: bool = option(False, "torch.compile this project's model")
    ray: bool = option(True, "also time the step under Ray Train (1 worker)")
    matmul_size: int = option(0, "n of the n x n matmul that measures the device's peak FLOP/s; 0 = 2048 on "
                              "CPU, 8192 on GPU")
    out: str = option("", "where the JSON report goes; default results/bench.json, bench_vs_ddp.json with "
                      "--vs-ddp, bench_to_accuracy.json with --to-accuracy")
    # --- the input pipeline alone (databench.py) ---
    data_path: bool = option(False, "instead: the data path alone (no model) on one set of images: in-memory "
                             "uint8, prepared (memory-mapped), and JPEG bytes decoded to --image-size; img/s "
                             "per training and loader worker, RssAnon; then RssAnon of 1 vs 2 processes and "
                             "of a 4x dataset")
    data_src: str = option("", "--data-path: image folder of same-size images (SRC/{train,test}/<class>/*); "
                           "default: generated CIFAR-shaped JPEGs")
    data_work: str = option("", "--data-path: folder for the prepared copies (default: beside --out)")
    data_images: int = option(20000, "--data-path: images timed per loader")
    data_generate: int = option(5000, "--data-path without --data-src: train images to generate")
    data_memory: bool = option(True, "--data-path: also the 1-vs-2-processes and 4x-dataset memory measurement")
    image_size: int = option(64, "--data-path: the size JPEGs are decoded and resized to")
    loader_workers: int = option(2, "--data-path: DataLoader workers for the JPEG path")
    # --- side by side with the seed's raw DDP (vsddp.py) ---
    vs_ddp: bool = option(False, "instead: the same model, global batch (--batch-size, default the seed's 128) "
                          "and steps under torchrun with --workers processes and under Ray Train with "
                          "--workers workers, each with the seed's loop and with ours; steady img/s, launch to "
                          "first step, peak memory per process, FLOP share, ratios")
    workers: int = option(1, "--vs-ddp: processes (torchrun) and workers (Ray Train); one GPU each on GPU")
    repeats: int = option(1, "--vs-ddp: passes over the four runs, interleaved; each keeps its pass with the "
                          "least CPU used outside its processes (other jobs, the launcher's daemons)")
    run_timeout_s: float = option(1800.0, "--vs-ddp: give up on a torchrun run after this many seconds")
    to_accuracy: float = option(0.0, "--vs-ddp: instead of throughput, train the seed's recipe (torchrun) and "
                                "--recipe fast (Ray Train) until this test accuracy or --budget-s each (0 = off)")
    budget_s: float = option(600.0, "--to-accuracy: time budget per recipe, seconds from its launch")
    eval_every_images: int = option(0, "--to-accuracy: evaluate every this many training images, for both "
                                    "recipes (0 = once per epoch)")
    data: str = option("synthetic", "--to-accuracy: dataset, as `train --data`", choices=DATASETS)
    data_dir: str = option("./data", "--to-accuracy: dataset folder (cifar10 / imagefolder)")
    synthetic_train_size: int = option(1024, "--to-accuracy: images in the synthetic train split")
    synthetic_test_size: int = option(256, "--to-accuracy: images in the synthetic test split")
    ours_flags: str = option("", "--to-accuracy: more `train` flags for our recipe, on top of --recipe fast "
                             "(e.g. '--epochs 4 --batch-size 512')")
    seed_flags: str = option("", "--to-accuracy: more ray_job.peers.seed_ddp flags for the seed's recipe")

    def resolved(self, cuda: bool) -> BenchConfig:
        pick = (lambda gpu, cpu: gpu if cuda else cpu)
        return dataclasses.replace(
            self, stems=self.stems or pick("imagenet,cifar", "imagenet"),
            steps=self.steps or pick(50, 4), warmup=self.warmup or pick(15, 1),
            seed_steps=self.seed_steps or pick(100, 4))

    def batch_for(self, stem: str, cuda: bool) -> int:
        if self.batch_size:
            return self.batch_size
        return (2048 if stem == "imagenet" else 512) if cuda else 256


def device_and_flags(cuda: bool):
    """The device and `train`'s own choice of bf16 / channels_last for it (flags at their defaults)."""
    speed = Speed.choose("auto", "auto", use_gpu=cuda, cuda_available=cuda)
    device = torch.device("cuda", torch.cuda.current_device()) if speed.cuda else torch.device("cpu")
    return device, speed.bf16, speed.channels_last


def constant_scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def run_steps(model, batches, optimizer, preprocess: Callable, device, bf16: bool, steps: int,
              warmup: int) -> dict:
    """img/s and data share over `steps` steps after `warmup` untimed ones (train_epoch timing)."""
    from .engine import peak_rss_gib, train_epoch

    loss_fn = nn.CrossEntropyLoss()
    sched = constant_scheduler(optimizer)
    if warmup:
        train_epoch(model, batches(), optimizer, sched, loss_fn, preprocess, device, bf16, max_steps=warmup)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    stats = train_epoch(model, batches(), optimizer, sched, loss_fn, preprocess, device, bf16,
                        max_steps=steps)
    result = dict(images_per_s=stats.count / stats.wall_s, data_share=stats.data_s / stats.wall_s,
                  steps=stats.steps, batch=stats.count // max(stats.steps, 1), seconds=stats.wall_s,
                  peak_host_mem_gib=peak_rss_gib())
    if device.type == "cuda":
        result["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return result


def fast_setup(model_name: str, stem: str, batch: int, images: int, cuda: bool, compile_: bool,
               prepare_model: Optional[Callable] = None, prepare_loader: Optional[Callable] = None):
    """This project's fast path: model, optimizer, loader factory and device augmentation."""
    from .config import TrainConfig
    from .data import ArrayDataset, DeviceAugment, make_synthetic
    from .model import build_model, to_device
    from .optim import build_optimizer

    device, bf16, channels_last = device_and_flags(cuda)
    model = build_model(model_name, stem, 10)
    if prepare_model is not None:
        model = prepare_model(model.to(memory_format=torch.channels_last) if channels_last else model)
    else:
        model = to_device(model, device, channels_last)
    optimizer = build_optimizer(model, TrainConfig(batch_size=batch, lr_ref_batch=batch), 1, device)
    if compile_:
        model = torch.compile(model)
    ds = ArrayDataset(make_synthetic(images, 0, True))

    def batches():
        loader = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, drop_last=True,
                                             collate_fn=ds.collate_fn, pin_memory=cuda)
        if prepare_loader is not None:
            return prepare_loader(loader)
        return ((x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in loader)

    return model, optimizer, batches, DeviceAugment(device, channels_last), device, bf16


def bench_fast(cfg: BenchConfig, stem: str, cuda: bool) -> dict:
    batch = cfg.batch_for(stem, cuda)
    model, opt, batches, aug, device, bf16 = fast_setup(
        cfg.model, stem, batch, batch * max(cfg.steps, cfg.warmup), cuda, cfg.compile)
    fast = run_steps(model, batches, opt, aug, device, bf16, cfg.steps, cfg.warmup)
    x, y = next(iter(batches()))
    fixed = (lambda: iter([(x, y)] * max(cfg.steps, cfg.warmup)))
    compute = run_steps(model, fixed, opt, aug, device, bf16, cfg.steps, cfg.warmup)
    return {"fast": fast, "compute": compute}


def bench_seed(cfg: BenchConfig, cuda: bool) -> dict:
    """The seed's pipeline as it was: nothing here is this project's code but the timer."""
    import torchvision

    from .data import TorchvisionDataset, make_synthetic

    device = torch.device("cuda") if cuda else torch.device("cpu")
    model = torchvision.models.__dict__[cfg.model](weights=None).to(device)  # 1000-class head
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ds = TorchvisionDataset(make_synthetic(SEED_BATCH * max(cfg.seed_steps, 2), 0, True), train=True)

    def batches():
        return iter(torch.utils.data.DataLoader(ds, batch_size=SEED_BATCH, shuffle=True, num_workers=0))

    to_device = (lambda x, train: x.to(device))
    return run_steps(model, batches, opt, to_device, device, False, cfg.seed_steps, 1)


def _ray_worker(config: dict) -> dict:
    import ray.train.torch

    cfg, stem = BenchConfig(**config["bench"]), config["stem"]
    torch.set_num_threads(config["threads"])
    cuda = torch.cuda.is_available() and config["cuda"]
    batch = cfg.batch_for(stem, cuda)
    model, opt, batches, aug, device, bf16 = fast_setup(
        cfg.model, stem, batch, batch * max(cfg.steps, cfg.warmup), cuda, cfg.compile,
        prepare_model=ray.train.torch.prepare_model,
        prepare_loader=lambda loader: ray.train.torch.prepare_data_loader(loader))
    return run_steps(model, batches, opt, aug, device, bf16, cfg.steps, cfg.warmup)


def bench_ray(cfg: BenchConfig, stem: str, cuda: bool) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from .config import TrainConfig
    from .launch import connect

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
    import torchvision

    from .model import build_model
    from .vsddp import flop_share, flops_per_image

    cfg, peaks = report["config"], report["ceiling"]
    _, bf16, _ = device_and_flags(cuda)
    seed_flops = flops_per_image(torchvision.models.__dict__[cfg["model"]](weights=None))  # 1000-class head
    report["seed"].update(precision="fp32", flops_per_image=seed_flops["train_step"],
                          **flop_share(report["seed"]["images_per_s"], seed_flops["train_step"], peaks["fp32"]))
    for stem in cfg["stems"].split(","):
        flops = flops_per_image(build_model(cfg["model"], stem, 10))["train_step"]
        for kind in ("compute", "fast", "ray"):
            if kind in report[stem]:
                row = report[stem][kind]
                precision = "bf16" if bf16 else "fp32"
                row.update(precision=precision, flops_per_image=flops,
                           **flop_share(row["images_per_s"], flops, peaks.get(precision, peaks["fp32"])))


def measure(cfg: BenchConfig) -> dict:
    from .vsddp import device_peaks

    cuda = torch.cuda.is_available()
    cfg = cfg.resolved(cuda)
    report = dict(date=time.strftime("%Y-%m-%d %H:%M"), device=torch.cuda.get_device_name() if cuda
                  else f"CPU ({os.cpu_count()} cores, {platform.processor() or platform.machine()})",
                  torch=torch.__version__, threads=torch.get_num_threads(), config=dataclasses.asdict(cfg),
                  load_avg_before=list(os.getloadavg()))
    report["ceiling"] = device_peaks(cuda, cfg.matmul_size)
    report["seed"] = bench_seed(cfg, cuda)
    for stem in cfg.stems.split(","):
        if stem not in ("imagenet", "cifar"):
            raise UsageError(f"--stems takes imagenet and/or cifar, not {stem!r}")
        entry = bench_fast(cfg, stem, cuda)
        if cfg.ray:
            entry["ray"] = bench_ray(cfg, stem, cuda)
        entry["speedup_vs_seed"] = entry["fast"]["images_per_s"] / report["seed"]["images_per_s"]
        entry["fast_vs_compute"] = entry["fast"]["images_per_s"] / entry["compute"]["images_per_s"]
        if cfg.ray:
            entry["ray_vs_fast"] = entry["ray"]["images_per_s"] / entry["fast"]["images_per_s"]
        report[stem] = entry
    add_flop_shares(report, cuda)
    report["load_avg_after"] = list(os.getloadavg())
    return report


def format_report(r: dict) -> str:
    from .vsddp import format_peaks

    lines = [f"bench {r['date']} on {r['device']} (torch {r['torch']}, {r['threads']} threads); load average "
             f"{r['load_avg_before'][0]:.2f} -> {r['load_avg_after'][0]:.2f}",
             format_peaks(r["ceiling"]),
             f"{'pipeline':<24}{'batch':>7}{'img/s':>11}{'data share':>12}{'peak GPU GiB':>14}{'peak host GiB':>15}"
             f"{'GFLOP/s':>10}{'of peak':>9}"]

    def row(name, m):
        gpu = f"{m['peak_gpu_mem_gib']:.2f}" if "peak_gpu_mem_gib" in m else "-"
        share = "-" if m.get("flop_share") is None else f"{m['flop_share']:.1%}"
        achieved = "-" if m.get("achieved_flops") is None else f"{m['achieved_flops'] / 1e9:,.1f}"
        lines.append(f"{name:<24}{m['batch']:>7}{m['images_per_s']:>11.1f}{m['data_share']:>11.0%}"
                     f"{gpu:>14}{m['peak_host_mem_gib']:>15.2f}{achieved:>10}{share:>9}")

    row("seed (fp32, PIL, 1000)", r["seed"])
    for stem in r["config"]["stems"].split(","):
        e = r[stem]
        for kind in ("compute", "fast", "ray"):
            if kind in e:
                row(f"{stem} stem: {kind}", e[kind])
        ratios = f"  {stem} stem: fast/seed {e['speedup_vs_seed']:.2f}x, fast/compute {e['fast_vs_compute']:.0%}"
        if "ray_vs_fast" in e:
            ratios += f", ray/fast {e['ray_vs_fast']:.1%}"
        lines.append(ratios)
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from .cli import ArgumentParser, Formatter, add_dataclass_args
    from .runlog import write_json

    parser = ArgumentParser(prog="python -m ray_job bench", formatter_class=Formatter,
                            description=__doc__.split("\n\n")[0])
    add_dataclass_args(parser, BenchConfig)
    cfg = BenchConfig(**vars(parser.parse_args(argv)))
    default_out = ("results/bench_data.json" if cfg.data_path else
                   "results/bench_to_accuracy.json" if cfg.to_accuracy else
                   "results/bench_vs_ddp.json" if cfg.vs_ddp else "results/bench.json")
    cfg = dataclasses.replace(cfg, out=resolve_path(cfg.out or default_out), data_dir=resolve_path(cfg.data_dir),
                              data_src=resolve_path(cfg.data_src), data_work=resolve_path(cfg.data_work))
    if min(cfg.batch_size, cfg.steps, cfg.warmup, cfg.seed_steps, cfg.matmul_size, cfg.eval_every_images) < 0:
        raise UsageError("bench sizes must not be negative (0 picks the device's default)")
    if cfg.repeats < 1:
        raise UsageError("--repeats must be at least 1")
    if cfg.to_accuracy and not cfg.vs_ddp:
        raise UsageError("--to-accuracy is a mode of --vs-ddp: add --vs-ddp")
    if not 0 <= cfg.to_accuracy <= 1:
        raise UsageError(f"--to-accuracy is a test accuracy between 0 and 1, not {cfg.to_accuracy}")
    os.makedirs(os.path.dirname(cfg.out), exist_ok=True)
    if cfg.data_path:
        if min(cfg.data_images, cfg.data_generate, cfg.loader_workers) < 0 or cfg.image_size < 8:
            raise UsageError("--data-images, --data-generate, --loader-workers must not be negative, "
                             "--image-size at least 8")
        from .databench import main as data_path_main

        return data_path_main(cfg)
    if cfg.vs_ddp:
        from .vsddp import main as vs_ddp_main

        return vs_ddp_main(cfg)
    report = measure(cfg)
    print(format_report(report))
    write_json(cfg.out, report)
    print(f"written: {cfg.out}")
    return 0
