"""`python -m ray_job bench race`: time to accuracy. The raw-DDP baseline's recipe (the peer under
torchrun) and `train --recipe fast` (Ray Train) on the same data, model and world size, each until
test accuracy --target or --budget-s.

    python -m ray_job bench race --target 0.5 --budget-s 300 --model resnet18 --data imagefolder \
        --data-dir ./cifar10-jpeg --eval-every-images 10240 --ours-flags "--epochs 5 --batch-size 512"
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import threading
import time
from typing import Any, Optional

import torch

from ..config import DATASETS, RESNETS, STEMS
from ..core.errors import UsageError
from ..core.flags import option
from ..storage import read_json, read_jsonl
from .common import BASELINE, check_workers, connect_ray, fmt, machine, run_torchrun, timed


@dataclasses.dataclass(frozen=True)
class RaceConfig:
    target: float = option(0.5, "the test accuracy both recipes race to")
    budget_s: float = option(600.0, "time budget per recipe, seconds from its launch")
    workers: int = option(1, "processes (torchrun) and workers (Ray Train); one GPU each on GPU")
    model: str = option("resnet50", "torchvision ResNet", choices=RESNETS)
    stem: str = option("imagenet", "the model's stem", choices=STEMS)
    eval_every_images: int = option(0, "evaluate every this many training images, for both recipes (0 = "
                                    "once per epoch)")
    data: str = option("synthetic", "dataset, as `train --data`", choices=DATASETS)
    data_dir: str = option("./data", "dataset folder (cifar10 / imagefolder)")
    synthetic_train_size: int = option(1024, "images in the synthetic train split")
    synthetic_test_size: int = option(256, "images in the synthetic test split")
    ours_flags: str = option("", "more `train` flags for our recipe, on top of --recipe fast (e.g. '--epochs "
                             "4 --batch-size 512')")
    baseline_flags: str = option("", "more ray_job.peers.raw_ddp flags for the baseline's recipe")
    out: str = option("results/bench_race.json", "where the JSON report goes")

    def __post_init__(self) -> None:
        if not 0 < self.target <= 1:
            raise UsageError(f"--target is a test accuracy between 0 and 1, not {self.target}")
        if self.budget_s <= 0 or self.eval_every_images < 0:
            raise UsageError("--budget-s must be positive and --eval-every-images not negative")


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


def race_baseline(cfg: RaceConfig, work: str, threads: int, data_args: list[str]) -> dict:
    """The raw-DDP baseline's recipe under torchrun, stopping at the target or the budget."""
    report = os.path.join(work, "baseline_report.json")
    steps = cfg.eval_every_images // BASELINE.batch_size if cfg.eval_every_images else 0
    args = ["ray_job.peers.raw_ddp", "--model", cfg.model, "--stem", cfg.stem, "--num-classes", "10",
            *data_args, "--epochs", "100000", "--target-acc", str(cfg.target),
            "--time-budget-s", str(cfg.budget_s), "--steps-per-epoch", str(steps),
            "--checkpoint-dir", os.path.join(work, "baseline_checkpoints"), "--report-json", report,
            *shlex.split(cfg.baseline_flags)]
    log = os.path.join(work, "baseline.log")
    launched = time.time()
    run_torchrun("the baseline recipe", cfg.workers, args, threads, log, report, cfg.budget_s * 2 + 600)
    wall = time.time() - launched
    r = read_json(report)
    keep = f"epoch_{r['epochs'][-1]['epoch']}" if r["epochs"] else None
    for folder in os.listdir(os.path.join(work, "baseline_checkpoints")):  # one per evaluation: keep the last
        if folder != keep:
            shutil.rmtree(os.path.join(work, "baseline_checkpoints", folder), ignore_errors=True)
    return _recipe_result(r["epochs"], launched, r["first_step_time"], cfg.target, r["stopped"], wall,
                          launcher="torchrun", recipe=f"raw-DDP baseline: fp32, global batch {BASELINE.batch_size}, "
                          f"SGD lr {BASELINE.lr:g} momentum {BASELINE.momentum:g}, PIL pipeline", log=log,
                          command="torchrun " + shlex.join(args))


def race_ours(cfg: RaceConfig, work: str, threads: int, data_args: list[str]) -> dict:
    """`train --recipe fast` under Ray Train; a watcher asks it to stop (a stop request) at the
    target or the budget."""
    from ..config import parse_train_args
    from ..train import stop
    from ..train.driver import run_training
    from ..train.runfiles import EVENTS_JSONL, METRICS_JSONL, Event

    name = f"race_ours_{time.strftime('%Y%m%d_%H%M%S')}"
    argv = ["--recipe", "fast", "--model", cfg.model, "--stem", cfg.stem, *data_args,
            "--num-workers", str(cfg.workers), "--cpus-per-worker", str(threads), "--storage-path", work,
            "--name", name, "--log-every", "0", "--max-failures", "0", "--keep-checkpoints", "1",
            *shlex.split(cfg.ours_flags)]
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
            reached = bool(rows) and rows[-1]["test_acc"] >= cfg.target
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
    first = [e["time"] for e in read_jsonl(os.path.join(run_dir, EVENTS_JSONL)) if e["event"] == Event.FIRST_STEP]
    return _recipe_result(rows, launched, first[0] if first else None, cfg.target, why["stopped"],
                          wall, launcher="ray", recipe="ours: train --recipe fast", run_dir=run_dir,
                          command="python -m ray_job train " + shlex.join(argv))


def main(cfg: RaceConfig) -> dict:
    from ..config import TrainConfig
    from ..data.datasets import check_data, load_splits

    cuda = torch.cuda.is_available()
    check_workers(cfg.workers, BASELINE.batch_size, cuda)
    work = os.path.join(os.path.dirname(cfg.out), f"bench_to_accuracy_{time.strftime('%Y%m%d_%H%M%S')}")
    os.makedirs(work, exist_ok=True)
    data_args = ["--data", cfg.data, "--data-dir", cfg.data_dir, "--synthetic-train-size",
                 str(cfg.synthetic_train_size), "--synthetic-test-size", str(cfg.synthetic_test_size)]
    data_cfg = TrainConfig(data=cfg.data, data_dir=cfg.data_dir, synthetic_train_size=cfg.synthetic_train_size,
                           synthetic_test_size=cfg.synthetic_test_size)
    check_data(data_cfg)
    data_s = timed(load_splits, data_cfg)[0]  # an image folder decoded once into its cache: neither recipe pays
    cluster_s, threads = connect_ray(cfg.workers, cuda)
    load_before = os.getloadavg()
    report = dict(kind="to_accuracy", date=time.strftime("%Y-%m-%d %H:%M:%S %z"), device=machine(cuda),
                  torch=torch.__version__, workers=cfg.workers, target_acc=cfg.target, budget_s=cfg.budget_s,
                  data=cfg.data, data_dir=cfg.data_dir, eval_every_images=cfg.eval_every_images, model=cfg.model,
                  stem=cfg.stem, data_prepare_s=data_s, ray_cluster_start_s=cluster_s)
    report["baseline"] = race_baseline(cfg, work, threads, data_args)
    report["ours"] = race_ours(cfg, work, threads, data_args)
    report["load_avg"] = dict(before=list(load_before), after=list(os.getloadavg()))
    report["comparison"] = compare(report["baseline"], report["ours"], cfg.target)
    print(format_to_accuracy(report))
    return report


def compare(baseline: dict, ours: dict, target: float) -> dict:
    """Our time to the accuracy the baseline reached (the target, or its final one if it fell short)."""
    if baseline["final_acc"] is None:
        return dict(reference_acc=None, baseline_s=None, ours_s=None, ours_vs_baseline_time=None)
    ref = min(target, baseline["best_acc"]) if baseline["reached"] else baseline["final_acc"]
    b, o = _first_at(baseline["history"], ref), _first_at(ours["history"], ref)
    return dict(reference_acc=ref, baseline_s=b["t_s"] if b else None, ours_s=o["t_s"] if o else None,
                ours_vs_baseline_time=(o["t_s"] / b["t_s"]) if b and o else None)


def format_to_accuracy(r: dict) -> str:
    load = r["load_avg"]
    lines = [f"bench race to {r['target_acc']} {r['date']} on {r['device']}: {r['workers']} "
             f"process(es), {r['model']}/{r['stem']} stem, data {r['data']}, budget {r['budget_s']:.0f} s "
             f"each; load average {load['before'][0]:.2f} -> {load['after'][0]:.2f}",
             f"{'recipe':<9}{'launcher':<10}{'stopped':<9}{'evals':>6}{'final acc':>10}{'best acc':>9}"
             f"{'wall s':>8}{'1st step s':>11}{'to target s':>12}{'(train s)':>10}"]
    for key in ("baseline", "ours"):
        x = r[key]
        lines.append(f"{key:<9}{x['launcher']:<10}{x['stopped']:<9}{x['evaluations']:>6}"
                     f"{fmt(x['final_acc'], '.4f'):>10}{fmt(x['best_acc'], '.4f'):>9}{x['wall_s']:>8.1f}"
                     f"{fmt(x['launch_to_first_step_s'], '.1f'):>11}{fmt(x['time_to_target_s'], '.1f'):>12}"
                     f"{fmt(x['train_time_to_target_s'], '.1f'):>10}")
    c = r["comparison"]
    lines.append(f"the baseline's accuracy {fmt(c['reference_acc'], '.4f')}: baseline {fmt(c['baseline_s'], '.1f')} "
                 f"s, ours {fmt(c['ours_s'], '.1f')} s from launch -> ours/baseline "
                 f"{fmt(c['ours_vs_baseline_time'], '.2f')}x (target: <= 0.33)")
    return "\n".join(lines)
