"""`python -m ray_job bench checkpoints`: what checkpoints cost the training step.

One process trains this project's step (the fast path, as bench step) for --steps steps, three times
per storage: without checkpoints, with a checkpoint every --every steps written synchronously (the
step waits for serialisation, upload and check), and asynchronously (`train`'s default: the step
waits only for a snapshot in host memory; train/checkpointer.py uploads it in the background and
reports it once complete). It prints steady images/s against the run without checkpoints, the stall
per checkpoint (that step's time above the median step), the writer's CPU time per checkpoint
(serialising, hashing, writing: what it takes from training where they share the cores), and the
share of the machine busy outside this process meanwhile. A storage is a folder or s3://BUCKET/PREFIX
(the AWS variables as for `train --storage-path`); each run's folder there is removed once measured.

    python -m ray_job bench checkpoints --model resnet50 --steps 60 --every 10
    python -m ray_job bench checkpoints --storage ./results/bench_ckpt,s3://bucket/bench
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time

import torch

from ..config import RESNETS, STEMS
from ..core.errors import UsageError
from ..core.flags import option
from .common import constant_scheduler, fast_setup, fmt, machine, machine_busy_s, own_usage

MODES = ("none", "sync", "async")


@dataclasses.dataclass(frozen=True)
class CheckpointBenchConfig:
    model: str = option("resnet50", "torchvision ResNet", choices=RESNETS)
    stem: str = option("imagenet", "the model's stem", choices=STEMS)
    batch_size: int = option(64, "batch size")
    steps: int = option(60, "timed steps per run")
    warmup: int = option(3, "untimed steps first")
    every: int = option(10, "a checkpoint every this many steps")
    repeats: int = option(2, "passes over the three modes, alternated; each keeps its best pass (the "
                          "first pass also warms the machine up)")
    storage: str = option("", "comma list of storages (folders or s3://...); default: a temporary folder")
    out: str = option("results/bench_checkpoints.json", "where the JSON report goes")

    def __post_init__(self) -> None:
        if min(self.batch_size, self.steps, self.every, self.repeats) < 1 or self.warmup < 0:
            raise UsageError("--batch-size, --steps, --every and --repeats must be at least 1, --warmup not "
                             "negative")


def run(cfg: CheckpointBenchConfig, where: str, mode: str, cuda: bool) -> dict:
    """One run of --steps steps with checkpoints of `mode` to `where`; per-step times."""
    from .. import storage
    from ..train.checkpointer import Checkpointer, LocalReports
    from ..train.engine import EpochSteps
    from ..train.runlog import RunLog

    torch.manual_seed(0)
    model, optimizer, batches, augment, device, bf16 = fast_setup(
        cfg.model, cfg.stem, cfg.batch_size, cfg.batch_size * (cfg.steps + cfg.warmup), cuda, False)
    store = storage.at(where).join(f"{mode}_{os.getpid()}_{time.time_ns()}")
    store.makedirs()
    files = RunLog(store)
    reports = LocalReports()
    ckpt = Checkpointer(store, reports.link(), True, files, 0.0, asynchronous=mode == "async")  # the master
    steps = EpochSteps(model, optimizer, constant_scheduler(optimizer), torch.nn.CrossEntropyLoss(), augment,
                       device, bf16)
    times, marks = [], []
    started = last = time.perf_counter()
    busy, (own, _, _) = machine_busy_s(), own_usage()  # for the CPU used outside this process
    for step in steps.run(batches(), cfg.steps + cfg.warmup):
        if mode == "async" and ckpt.upload_over():  # what the step control decides at its next poll
            ckpt.report_saved()
        if mode != "none" and step.number > cfg.warmup and (step.number - cfg.warmup) % cfg.every == 0:
            if mode == "async" and ckpt.busy():  # the next checkpoint waits for the previous
                ckpt.wait_for_upload()
                ckpt.report_saved()
            state = dict(model=model, optimizer=optimizer, config={}, world_size=1, epoch=0,
                         step=step.number, metrics={})
            ckpt.save(lambda state=state: state, {"step": step.number})
            marks.append(len(times))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        if step.number > cfg.warmup:
            times.append(now - last)
        last = now
    if ckpt.busy():
        ckpt.wait_for_upload()
        ckpt.report_saved()
    wall = time.perf_counter() - started
    other = None if busy is None else max(0.0, machine_busy_s() - busy - (own_usage()[0] - own)) / (
        wall * (os.cpu_count() or 1))
    steps.finish()
    files.close()
    saved = [e for e in storage.read_jsonl(store.join("events.jsonl")) if e["event"] == "checkpoint_saved"]
    store.delete()  # each run's checkpoints (--steps / --every of them, model-sized) go with it
    median = statistics.median([t for i, t in enumerate(times) if i not in marks] or times)
    stalls = [times[i] - median for i in marks]
    return dict(mode=mode, storage=where, steps=len(times), checkpoints=len(saved), reports=len(reports.calls),
                images_per_s=cfg.batch_size * len(times) / sum(times), median_step_s=median,
                stall_s=statistics.mean(stalls) if stalls else 0.0,
                upload_s=statistics.mean(e["upload_s"] for e in saved) if saved else None,
                cpu_s=statistics.mean(e["cpu_s"] for e in saved) if saved else None,
                checkpoint_mib=saved[0]["bytes"] / 2**20 if saved else None, other_cpu_share=other)


def main(cfg: CheckpointBenchConfig) -> dict:
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="rj_bench_ckpt_") as scratch:
        storages = [s for s in cfg.storage.split(",") if s] or [scratch]
        passes = [run(cfg, where, mode, cuda) for _ in range(cfg.repeats) for where in storages for mode in MODES]
    runs = [max((p for p in passes if (p["storage"], p["mode"]) == (where, mode)), key=lambda p: p["images_per_s"])
            for where in storages for mode in MODES]
    report = dict(kind="checkpoints", date=time.strftime("%Y-%m-%d %H:%M:%S %z"), device=machine(cuda),
                  torch=torch.__version__, config=dataclasses.asdict(cfg), runs=runs,
                  load_avg=list(os.getloadavg()))
    by = {(r["storage"], r["mode"]): r for r in runs}
    for r in runs:
        base, sync = by[r["storage"], "none"], by[r["storage"], "sync"]
        r["vs_none"] = r["images_per_s"] / base["images_per_s"]
        r["stall_vs_sync"] = r["stall_s"] / sync["stall_s"] if r["mode"] != "none" and sync["stall_s"] > 0 else None
    print(format_report(report))
    return report


def format_report(r: dict) -> str:
    c = r["config"]
    lines = [f"bench checkpoints {r['date']} on {r['device']}: {c['model']}/{c['stem']} stem, batch "
             f"{c['batch_size']}, {c['steps']} steps, a checkpoint every {c['every']}; load average "
             f"{r['load_avg'][0]:.2f}",
             f"{'storage':<34}{'mode':<7}{'img/s':>9}{'vs none':>9}{'stall ms':>10}{'vs sync':>9}"
             f"{'upload s':>10}{'CPU s':>7}{'MiB':>7}{'saved':>7}{'other CPU':>11}"]
    for x in r["runs"]:
        where = x["storage"] if len(x["storage"]) <= 33 else "..." + x["storage"][-30:]
        lines.append(f"{where:<34}{x['mode']:<7}{x['images_per_s']:>9.1f}{x['vs_none']:>9.1%}"
                     f"{x['stall_s'] * 1e3:>10.1f}{fmt(x['stall_vs_sync'], '.1%'):>9}{fmt(x['upload_s'], '.2f'):>10}"
                     f"{fmt(x['cpu_s'], '.2f'):>7}{fmt(x['checkpoint_mib'], '.0f'):>7}{x['checkpoints']:>7}"
                     f"{fmt(x['other_cpu_share'], '.1%'):>11}")
    lines.append("CPU s: the writer's CPU time per checkpoint; other CPU: share of the machine busy outside this "
                 "process (an S3 server on this machine, other jobs)")
    lines.append("targets: async keeps >= 98% of the images/s without checkpoints; its stall <= 10% of sync's")
    return "\n".join(lines)
