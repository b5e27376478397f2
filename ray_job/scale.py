"""Scaling sweep: the trainer once per worker count, strong and weak, for a fixed amount of work.

    python -m ray_job scale --workers 1,2,4,8 --mode both --data cifar10 --address auto
    python -m ray_job scale --predict --workers 8,16,32,64 --link ib

Each point is a real `train` run in <storage-path>/<name>/<mode>_w<N>/ (the 1-worker run is shared:
strong and weak are the same job there). The sweep folder gets scaling.csv/.json/.md/.png: wall time,
time to first step, steady images/s, the step split (data / compute / all-reduce wait / optimizer),
speedup and efficiency against 1 worker, and the communication model's prediction beside each point
(see commmodel.py). A count the cluster cannot hold is a `skipped` row with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import json
import logging
import math
import os
import platform
import shlex
import sys
import threading
import time
from typing import Any, Optional

from . import commmodel
from .cli import ArgumentParser, Formatter, add_config_args, apply_recipe, config_from_args
from .config import PREEMPT_FILE, TrainConfig, UsageError
from .launch import (EXIT_PREEMPTED, check_storage, connect, finished_summary, run_training,
                     with_default_name)
from .runlog import CONFIG_JSON, SUMMARY_JSON, write_json

log = logging.getLogger("ray_job.scale")

# A fixed, short amount of work per point; --sync-timing makes the GPU step split exact.
SCALE_DEFAULTS = dict(epochs=1, steps_per_epoch=50, sync_timing=True, max_failures=0)
MODES = {"strong": "global", "weak": "per-worker"}  # scaling mode -> --batch-mode
# Single-worker speed used by --predict when no --from / --step-ms is given: seconds per image,
# measured on the GPU machine (one H200, bf16, channels_last, no Ray; /work/shared/device/README.md).
REFERENCE_S_PER_IMAGE = {
    ("resnet50", "cifar"): (1 / 15557, "ResNet-50 CIFAR stem on one H200, bf16 channels_last, batch "
                            "512: 15,557 img/s (measured 2026-11-30)"),
    ("resnet50", "imagenet"): (1 / 117665, "ResNet-50 ImageNet stem on one H200, bf16 channels_last, "
                               "batch 2048: 117,665 img/s (measured 2026-11-30)"),
}
COLUMNS = ["mode", "workers", "status", "reason", "run", "global_batch", "per_worker_batch", "steps",
           "wall_s", "time_to_first_step_s", "train_s", "images_per_s", "steady_images_per_s",
           "step_s", "data_s_per_step", "compute_s_per_step", "comm_wait_s_per_step",
           "optim_s_per_step", "speedup", "efficiency", "grad_bytes", "pred_comm_s",
           "pred_exposed_comm_s", "pred_step_s", "pred_efficiency", "pred_step_error_pct"]
SCALING_JSON, SCALING_CSV, SCALING_MD, SCALING_PNG = ("scaling.json", "scaling.csv", "scaling.md",
                                                      "scaling.png")


# --- command line ------------------------------------------------------------------------------

def build_parser(argv: list[str]) -> ArgumentParser:
    parser = ArgumentParser(prog="python -m ray_job scale", formatter_class=Formatter,
                            description=DESCRIPTION)
    g = parser.add_argument_group("scaling sweep")
    g.add_argument("--workers", type=worker_list, default=[1, 2, 4, 8],
                   help="worker counts, comma-separated (1 is always added: it is the baseline)")
    g.add_argument("--mode", choices=("strong", "weak", "both"), default="both",
                   help="strong: fixed global --batch-size split across workers (the seed's chart); "
                   "weak: every worker takes --batch-size")
    g.add_argument("--link", default="auto", help=f"interconnect for the model: {', '.join(commmodel.LINKS)}"
                   ", custom (give both numbers), or auto (a sweep on one node: nvlink with NCCL, loopback "
                   "with gloo; several nodes: ib. --predict: ib)")
    g.add_argument("--bandwidth-gbps", type=float, help="override the link's bus bandwidth (Gbit/s)")
    g.add_argument("--latency-us", type=float, help="override the link's per-step latency (us)")
    g.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="model DDP's overlap of all-reduce with backward; default: on for GPU "
                   "workers, off for CPU workers (gloo reduces on the cores that compute backward, "
                   "so little is hidden); --predict prints both")
    p = parser.add_argument_group("--predict: on paper, no Ray, nothing run")
    p.add_argument("--predict", action="store_true", help="print the model's projection and exit")
    p.add_argument("--from", dest="from_path", metavar="SCALING_JSON",
                   help="take the single-worker step and gradient size (and train flags' defaults) "
                   "from a previous sweep's scaling.json")
    p.add_argument("--step-ms", type=float, help="single-worker step time at --batch-size per worker "
                   "(default: a reference measurement on one H200 for resnet50, both stems)")
    p.add_argument("--optim-ms", type=float, help="part of --step-ms that does not shrink with the "
                   "batch (optimizer step); default 0")
    p.add_argument("--grad-mb", type=float, help="MB all-reduced per step (default: from --model, "
                   "fp32, halved by --grad-compression bf16)")
    add_config_args(parser, skip=("num_workers", "batch_mode"))
    apply_recipe(parser, argv)
    parser.set_defaults(**SCALE_DEFAULTS)
    return parser


def worker_list(text: str) -> list[int]:
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of counts") from None
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError("worker counts must be positive integers")
    return counts


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, TrainConfig, Optional[dict]]:
    """Scale options, the train config, and the --from sweep (whose config gives the defaults)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--from", dest="from_path")
    previous = load_sweep(pre.parse_known_args(argv)[0].from_path)
    parser = build_parser(argv)
    if previous is not None:
        saved = previous.get("config", {})
        parser.set_defaults(**{k: v for k, v in saved.items() if k not in ("num_workers", "batch_mode")})
    ns = parser.parse_args(argv)
    if not ns.predict and any(v is not None for v in (ns.from_path, ns.step_ms, ns.optim_ms, ns.grad_mb)):
        raise UsageError("--from, --step-ms, --optim-ms and --grad-mb describe a projection: add --predict")
    cfg = config_from_args(ns)
    if not cfg.name:
        cfg = dataclasses.replace(cfg, name=time.strftime("scale_%Y%m%d_%H%M%S"))
    return ns, cfg, previous


def load_sweep(path: Optional[str]) -> Optional[dict]:
    if path is None:
        return None
    if os.path.isdir(path):
        path = os.path.join(path, SCALING_JSON)
    try:
        with open(path) as f:
            sweep = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"--from {path}: cannot read a scaling.json ({e})") from None
    if not (sweep.get("model") or {}).get("profile"):
        raise UsageError(f"--from {path} has no single-worker profile (its 1-worker run did not "
                         f"finish); rerun the sweep or give --step-ms")
    return sweep


def modes_of(ns: argparse.Namespace) -> list[str]:
    return ["strong", "weak"] if ns.mode == "both" else [ns.mode]


def main(argv: list[str]) -> int:
    ns, cfg, previous = parse_args(argv)
    if ns.predict:
        return print_projection(ns, cfg, chosen_link(ns, "ib"), previous)
    # auto: the sweep picks the link once it sees the cluster
    return run_sweep(ns, cfg, None if ns.link == "auto" else chosen_link(ns, ""), argv)


def chosen_link(ns: argparse.Namespace, auto: str) -> commmodel.Link:
    name = auto if ns.link == "auto" else ns.link
    try:
        return commmodel.make_link(name, ns.bandwidth_gbps, ns.latency_us)
    except ValueError as e:
        raise UsageError(str(e)) from None


# --- the sweep ---------------------------------------------------------------------------------

def run_sweep(ns: argparse.Namespace, cfg: TrainConfig, link: Optional[commmodel.Link],
              argv: list[str]) -> int:
    cfg = with_default_name(cfg)  # checks that --name is a plain folder name
    check_storage(cfg)
    sweep_dir = cfg.run_dir()
    os.makedirs(sweep_dir, exist_ok=True)
    stale = os.path.join(sweep_dir, PREEMPT_FILE)
    if os.path.exists(stale):
        os.remove(stale)  # a requeued job must not stop at once
    connect(cfg)
    cluster = cluster_info()
    link = link or auto_link(cluster, cfg, ns)
    use_gpu = cfg.use_gpu if cfg.use_gpu is not None else cluster["gpus"] > 0
    overlap = ns.overlap if ns.overlap is not None else use_gpu
    load_before = os.getloadavg()[0]
    rows = measure_all(cfg, sweep_dir, modes_of(ns), sorted({1, *ns.workers}))
    # Other jobs on the driver's host skew the timings: keep the load beside them.
    cluster["driver_host_load_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    profile = profile_from_baseline(rows[0], cfg)
    add_speedups_and_predictions(rows, profile, link, overlap, cfg)
    sweep = dict(sweep=cfg.name, sweep_dir=sweep_dir, date=time.strftime("%Y-%m-%d %H:%M:%S %z"),
                 command="python -m ray_job scale " + shlex.join(argv), host=platform.node(),
                 cluster=cluster, config=cfg.to_dict(), rows=rows,
                 model=dict(link=dataclasses.asdict(link), overlap=overlap,
                            backward_fraction=commmodel.BACKWARD_FRACTION,
                            profile=profile.to_dict() if profile else None))
    print(write_outputs(sweep))
    print(f"scaling results: {sweep_dir}/{{{SCALING_CSV},{SCALING_JSON},{SCALING_MD},{SCALING_PNG}}}")
    statuses = {r["status"] for r in rows}
    if statuses & {"preempted", "not run"}:
        print("sweep stopped on request; run the same command (same --name) to finish it: finished "
              "points are reused")
        return EXIT_PREEMPTED
    return 1 if "failed" in statuses else 0


def measure_all(cfg: TrainConfig, sweep_dir: str, modes: list[str], counts: list[int]) -> list[dict]:
    """One row per (mode, count), modes in order; the 1-worker run is shared by all modes."""
    plan = [(m, n) for m in modes for n in counts if not (n == 1 and m != modes[0])]
    rows = []
    for i, (mode, n) in enumerate(plan, 1):
        if os.path.exists(os.path.join(sweep_dir, PREEMPT_FILE)):
            rows.append(dict(mode=mode, workers=n, status="not run", run="",
                             reason="the sweep was asked to stop (preemption / time limit)"))
            continue
        log.info("scale: point %d/%d: %s scaling, %d worker(s)", i, len(plan), mode, n)
        rows.append(measure_point(cfg, sweep_dir, mode, n))
    for mode in modes[1:]:
        rows.insert(modes.index(mode) * len(counts), {**rows[0], "mode": mode})
    return rows


def cluster_info() -> dict:
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    res = ray.cluster_resources()
    return dict(nodes=len(nodes), cpus=res.get("CPU", 0), gpus=res.get("GPU", 0))


def auto_link(cluster: dict, cfg: TrainConfig, ns: argparse.Namespace) -> commmodel.Link:
    use_gpu = cfg.use_gpu if cfg.use_gpu is not None else cluster["gpus"] > 0
    if cluster["nodes"] > 1:
        name = "ib"
    elif use_gpu and cfg.backend != "gloo":
        name = "nvlink"
    else:
        name = "loopback"
    return commmodel.make_link(name, ns.bandwidth_gbps, ns.latency_us)


def point_config(cfg: TrainConfig, sweep_dir: str, mode: str, workers: int) -> TrainConfig:
    if workers == 1:  # the same job in every mode, so any later sweep of either mode reuses it
        return dataclasses.replace(cfg, storage_path=sweep_dir, num_workers=1, name="w1",
                                   batch_mode="global")
    return dataclasses.replace(cfg, storage_path=sweep_dir, num_workers=workers,
                               name=f"{mode}_w{workers}", batch_mode=MODES[mode])


def measure_point(cfg: TrainConfig, sweep_dir: str, mode: str, workers: int) -> dict:
    """Runs one point; a count that cannot run is a row with status skipped/failed and the reason."""
    point = point_config(cfg, sweep_dir, mode, workers)
    row: dict[str, Any] = dict(mode=mode, workers=workers, status="ok", reason="", run=point.name)
    if finished_point(point):
        row["reason"] = "reused: finished by an earlier run of this sweep"
    try:
        with forward_preempt(sweep_dir, point.run_dir()):
            rc = run_training(point)
    except UsageError as e:  # does not fit, batch too small for this count, ...
        log.warning("scale: %s %d worker(s) skipped: %s", mode, workers, e)
        return {**row, "status": "skipped", "reason": str(e)}
    except Exception as e:  # one broken point must not lose the whole sweep
        log.exception("scale: %s %d worker(s) failed", mode, workers)
        return {**row, "status": "failed", "reason": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    if rc == EXIT_PREEMPTED:
        return {**row, "status": "preempted", "reason": "stopped on request; rerun to measure it"}
    if rc != 0:
        return {**row, "status": "failed", "reason": f"train exited with {rc}; see {point.run_dir()}"}
    return {**row, **measurements(point)}


def finished_point(point: TrainConfig) -> bool:
    """True when this point already finished with the same flags (a requeued or repeated sweep).

    An unfinished point folder is moved aside: resuming it would time only part of the work.
    """
    d = point.run_dir()
    if not os.path.isdir(d):
        return False
    if finished_summary(point) is not None:
        with open(os.path.join(d, CONFIG_JSON)) as f:
            saved = json.load(f)
        ignore = ("address", "use_gpu")  # the address changes with every SLURM job
        if {k: v for k, v in saved.items() if k not in ignore} != \
                {k: v for k, v in point.to_dict().items() if k not in ignore}:
            raise UsageError(f"{d} holds a finished point run with other flags; use a new --name")
        return True
    aside = f"{d}.interrupted-{time.strftime('%Y%m%d_%H%M%S')}"
    log.warning("scale: moving the unfinished point %s aside to %s and running it again", d, aside)
    os.replace(d, aside)
    return False


@contextlib.contextmanager
def forward_preempt(sweep_dir: str, point_dir: str):
    """The SLURM script asks <sweep>/.preempt to stop; the running point watches its own folder."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(1.0):
            if os.path.exists(os.path.join(sweep_dir, PREEMPT_FILE)) and os.path.isdir(point_dir):
                with open(os.path.join(point_dir, PREEMPT_FILE), "w") as f:
                    f.write(str(time.time()))

    thread = threading.Thread(target=watch, name="forward-preempt", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def measurements(point: TrainConfig) -> dict:
    """The timing columns of one finished run, from its summary.json (last epoch's metrics)."""
    with open(os.path.join(point.run_dir(), SUMMARY_JSON)) as f:
        summary = json.load(f)
    m = summary["final"]
    steps = max(m["steps"], 1)
    comm = m.get("comm_wait_s_per_step") or 0.0
    steady = m.get("steady_images_per_s") or m["images_per_s"]
    gb = point.global_batch(point.num_workers)
    return dict(global_batch=gb, per_worker_batch=point.per_worker_batch(point.num_workers),
                steps=m["steps"], wall_s=summary["wall_s"],
                time_to_first_step_s=summary["time_to_first_step_s"], train_s=m["train_s"],
                images_per_s=m["images_per_s"], steady_images_per_s=steady, step_s=gb / steady,
                data_s_per_step=m["data_s"] / steps,
                compute_s_per_step=max(0.0, m["fwd_bwd_s"] / steps - comm),
                comm_wait_s_per_step=comm, optim_s_per_step=m["optim_s"] / steps,
                grad_bytes=m["grad_bytes"])


def profile_from_baseline(row: dict, cfg: TrainConfig) -> Optional[commmodel.StepProfile]:
    """The model's single-worker step: the 1-worker run's split, scaled to its steady step time."""
    if row["status"] != "ok":
        return None
    parts = row["data_s_per_step"], row["compute_s_per_step"], row["optim_s_per_step"]
    k = row["step_s"] / sum(parts)  # the split is a mean over all steps; step_s skips the first
    nbytes = row["grad_bytes"] * (0.5 if cfg.grad_compression == "bf16" else 1.0)
    return commmodel.StepProfile(batch=row["per_worker_batch"], data_s=parts[0] * k,
                                 fwd_bwd_s=parts[1] * k, optim_s=parts[2] * k, grad_bytes=int(nbytes),
                                 bucket_bytes=cfg.ddp_bucket_mb * 2**20,
                                 source=f"1-worker run {row['run']}: steady step "
                                 f"{row['step_s'] * 1e3:.1f} ms at batch {row['per_worker_batch']}")


def add_speedups_and_predictions(rows: list[dict], profile: Optional[commmodel.StepProfile],
                                 link: commmodel.Link, overlap: bool, cfg: TrainConfig) -> None:
    """Speedup = steady images/s against 1 worker in the same mode; efficiency = speedup / N."""
    base = {r["mode"]: r for r in rows if r["workers"] == 1 and r["status"] == "ok"}
    for r in rows:
        for key in COLUMNS:
            r.setdefault(key, None)
        if r["status"] != "ok" or r["mode"] not in base:
            continue
        r["speedup"] = r["steady_images_per_s"] / base[r["mode"]]["steady_images_per_s"]
        r["efficiency"] = r["speedup"] / r["workers"]
        if profile is None:
            continue
        p = commmodel.predict(profile, link, r["workers"], r["mode"], cfg.batch_size, overlap)
        if p is None:
            continue
        r.update(pred_comm_s=p.comm_s, pred_exposed_comm_s=p.exposed_comm_s, pred_step_s=p.step_s,
                 pred_efficiency=p.efficiency,
                 pred_step_error_pct=100 * (p.step_s - r["step_s"]) / r["step_s"])


# --- outputs -----------------------------------------------------------------------------------

def write_outputs(sweep: dict) -> str:
    d = sweep["sweep_dir"]
    write_json(os.path.join(d, SCALING_JSON), sweep)
    with open(os.path.join(d, SCALING_CSV), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({k: ("" if r[k] is None else r[k]) for k in COLUMNS} for r in sweep["rows"])
    table = markdown(sweep)
    with open(os.path.join(d, SCALING_MD), "w") as f:
        f.write(table + "\n")
    plot(sweep, os.path.join(d, SCALING_PNG))
    return table


def _fmt(value: Optional[float], spec: str, scale: float = 1.0) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else format(value * scale, spec)


def load_text(cluster: dict) -> str:
    before, after = cluster.get("driver_host_load_1min") or (math.nan, math.nan)
    return f"{before:.1f} at start, {after:.1f} at end"


def markdown(sweep: dict) -> str:
    link, cl = sweep["model"]["link"], sweep["cluster"]
    head = ["mode", "N", "global batch", "steps", "train s", "wall s", "1st step s", "img/s",
            "step ms", "data ms", "compute ms", "comm wait ms", "optim ms", "speedup", "efficiency",
            "model step ms", "model comm wait ms", "model efficiency", "model error"]
    lines = [f"# Scaling sweep `{sweep['sweep']}`", "",
             f"{sweep['date']} on {sweep['host']} ({cl['nodes']} node(s), {cl['cpus']:g} CPUs, "
             f"{cl['gpus']:g} GPUs; driver host load {load_text(cl)})  ", f"`{sweep['command']}`", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sweep["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['mode']} | {r['workers']} | {r['status']} |" + " |" * (len(head) - 3))
            continue
        ms = lambda k: _fmt(r[k], ".1f", 1e3)  # noqa: E731
        cells = [r["mode"], str(r["workers"]), str(r["global_batch"]), str(r["steps"]),
                 _fmt(r["train_s"], ".1f"), _fmt(r["wall_s"], ".1f"),
                 _fmt(r["time_to_first_step_s"], ".1f"), _fmt(r["steady_images_per_s"], ".0f"),
                 ms("step_s"), ms("data_s_per_step"), ms("compute_s_per_step"),
                 ms("comm_wait_s_per_step"), ms("optim_s_per_step"), _fmt(r["speedup"], ".2f"),
                 _fmt(r["efficiency"], ".2f"), ms("pred_step_s"), ms("pred_exposed_comm_s"),
                 _fmt(r["pred_efficiency"], ".2f"), _fmt(r["pred_step_error_pct"], "+.0f") +
                 ("%" if r["pred_step_error_pct"] is not None else "")]
        lines.append("| " + " | ".join(cells) + " |")
    for r in sweep["rows"]:
        if r["status"] != "ok":
            lines.append(f"\n{r['mode']} {r['workers']} worker(s) {r['status']}: {r['reason']}")
    lines += ["", f"Speedup = steady img/s / 1 worker's (same mode); efficiency = speedup / N. Step "
              f"split: mean ms per step on rank 0; comm wait = DDP backward with minus without "
              f"gradient sync. Model: ring all-reduce on {link['name']} ({link['bandwidth_gbps']:g} "
              f"Gbit/s, {link['latency_us']:g} us; {link['note']}), overlap with backward "
              f"{'on' if sweep['model']['overlap'] else 'off'}; model error = (model - measured) / "
              f"measured step time."]
    return "\n".join(lines)


def plot(sweep: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in sweep["rows"] if r["status"] == "ok"]
    fig, (ax_t, ax_e, ax_s) = plt.subplots(1, 3, figsize=(16, 4.8))
    colours = {"strong": "tab:blue", "weak": "tab:orange"}
    for mode, colour in colours.items():
        pts = [r for r in rows if r["mode"] == mode]
        if not pts:
            continue
        n = [r["workers"] for r in pts]
        ax_t.plot(n, [r["train_s"] for r in pts], "o-", color=colour, label=f"{mode}: training")
        ax_t.plot(n, [r["wall_s"] for r in pts], "s--", color=colour, alpha=0.5,
                  label=f"{mode}: wall (Ray start, eval)")
        ax_e.plot(n, [r["efficiency"] for r in pts], "o-", color=colour, label=f"{mode}: measured")
        pred = [(r["workers"], r["pred_efficiency"]) for r in pts if r["pred_efficiency"] is not None]
        if pred:
            ax_e.plot(*zip(*pred), ":", color=colour, label=f"{mode}: model")
    ax_e.axhline(1.0, color="grey", lw=0.8)
    ax_t.set(xlabel="workers", ylabel="seconds", title="time for the fixed work")
    ax_e.set(xlabel="workers", ylabel="speedup / workers", title="scaling efficiency", ylim=(0, 1.2))
    for ax in (ax_t, ax_e):
        ax.set_xticks(sorted({r["workers"] for r in rows}))
        ax.legend(fontsize=8)
    split_bars(ax_s, rows)
    fig.suptitle(f"{sweep['sweep']} ({sweep['date']}, {sweep['host']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def split_bars(ax, rows: list[dict]) -> None:
    parts = [("data_s_per_step", "data"), ("compute_s_per_step", "forward+backward"),
             ("comm_wait_s_per_step", "all-reduce wait"), ("optim_s_per_step", "optimizer")]
    labels = [f"{r['mode'][0]}{r['workers']}" for r in rows]
    bottom = [0.0] * len(rows)
    for key, name in parts:
        values = [(r[key] or 0.0) * 1e3 for r in rows]
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(ylabel="ms per step (mean, rank 0)", title="where a step goes (s=strong, w=weak; N)")
    ax.legend(fontsize=8)


# --- on paper ----------------------------------------------------------------------------------

def paper_profile(ns: argparse.Namespace, cfg: TrainConfig, previous: Optional[dict]) -> commmodel.StepProfile:
    """The single-worker step for --predict: --from's sweep, else flags, else a reference measurement."""
    if previous is not None and ns.step_ms is None:
        profile = commmodel.StepProfile(**previous["model"]["profile"])
    else:
        step_s, source = reference_step_s(ns, cfg)
        optim = (ns.optim_ms or 0.0) / 1e3
        if not 0 <= optim < step_s:
            raise UsageError("--optim-ms must be below the step time")
        profile = commmodel.StepProfile(batch=cfg.batch_size, data_s=0.0, fwd_bwd_s=step_s - optim,
                                        optim_s=optim, grad_bytes=0, source=source)
    if ns.grad_mb is not None:
        nbytes, what = ns.grad_mb * 1e6, "--grad-mb"
    elif previous is not None:  # the sweep's bytes, re-halved if --grad-compression differs
        saved_bf16 = previous["config"].get("grad_compression") == "bf16"
        nbytes = profile.grad_bytes * (2 if saved_bf16 else 1) * (0.5 if cfg.grad_compression == "bf16" else 1)
        what = f"the sweep's model, {'bf16' if cfg.grad_compression == 'bf16' else 'fp32'}"
    else:
        from .model import build_model, gradient_bytes

        nbytes = gradient_bytes(build_model(cfg.model, cfg.stem, 10))
        nbytes *= 0.5 if cfg.grad_compression == "bf16" else 1.0
        what = f"{cfg.model} fp32{' -> bf16' if cfg.grad_compression == 'bf16' else ''}"
    return dataclasses.replace(profile, grad_bytes=int(nbytes), bucket_bytes=cfg.ddp_bucket_mb * 2**20,
                               source=f"{profile.source}; gradients {nbytes / 1e6:.1f} MB ({what})")


def reference_step_s(ns: argparse.Namespace, cfg: TrainConfig) -> tuple[float, str]:
    if ns.step_ms is not None:
        if ns.step_ms <= 0:
            raise UsageError("--step-ms must be positive")
        return ns.step_ms / 1e3, f"--step-ms {ns.step_ms:g} at batch {cfg.batch_size}"
    ref = REFERENCE_S_PER_IMAGE.get((cfg.model, cfg.stem))
    if ref is None:
        raise UsageError(f"no reference step time for {cfg.model}/{cfg.stem} stem: give --step-ms "
                         f"(one worker's step at --batch-size) or --from a sweep's scaling.json")
    return ref[0] * cfg.batch_size, f"reference: {ref[1]}, i.e. {ref[0] * cfg.batch_size * 1e3:.2f} " \
                                    f"ms at batch {cfg.batch_size}"


def print_projection(ns: argparse.Namespace, cfg: TrainConfig, link: commmodel.Link,
                     previous: Optional[dict]) -> int:
    profile = paper_profile(ns, cfg, previous)
    counts = sorted({1, *ns.workers})
    print(f"projection on {link.name}: {link.bandwidth_gbps:g} Gbit/s, {link.latency_us:g} us per "
          f"ring step ({link.note})\nsingle worker: {profile.source}\n"
          f"+overlap: backward hides up to {commmodel.BACKWARD_FRACTION:.2f} of forward+backward")
    head = (f"{'mode':>6} {'N':>5} {'batch/worker':>12} {'all-reduce ms':>13} {'step ms':>9} "
            f"{'+overlap':>9} {'efficiency':>10} {'+overlap':>9}")
    print(head + "\n" + "-" * len(head))
    for mode in modes_of(ns):
        for n in counts:
            plain = commmodel.predict(profile, link, n, mode, cfg.batch_size, overlap=False)
            over = commmodel.predict(profile, link, n, mode, cfg.batch_size, overlap=True)
            if plain is None or over is None:
                print(f"{mode:>6} {n:>5} {'< 1 image per worker: global --batch-size too small':>50}")
                continue
            print(f"{mode:>6} {n:>5} {plain.per_worker_batch:>12} {plain.comm_s * 1e3:>13.2f} "
                  f"{plain.step_s * 1e3:>9.2f} {over.step_s * 1e3:>9.2f} {plain.efficiency:>10.2f} "
                  f"{over.efficiency:>9.2f}")
    return 0


DESCRIPTION = """\
Run the trainer for several worker counts (strong and/or weak scaling) and report wall time, time to
the first step, steady images/s, where a step goes, speedup and efficiency against 1 worker, and the
communication model's prediction beside each point. Train flags pass through; the defaults here are a
fixed short amount of work (--epochs 1 --steps-per-epoch 50 --sync-timing --max-failures 0).

Outputs in <storage-path>/<name>/ (default name scale_<date>_<time>): scaling.csv, scaling.json,
scaling.md, scaling.png, and one run folder per point.

--predict projects on paper without Ray: the single-worker step comes from --from (a previous
sweep's scaling.json), else --step-ms, else a reference measurement for ResNet-50 on one H200; the
gradient size from --grad-mb, else --from, else the --model's parameter count.

examples:
  python -m ray_job scale --workers 1,2,4,8 --data cifar10 --address auto
  python -m ray_job scale --workers 1,2 --no-gpu --data synthetic --model resnet18 --stem imagenet
  python -m ray_job scale --predict --workers 8,16,32,64 --link ib
  python -m ray_job scale --predict --from results/scale_x/scaling.json --workers 2,4,8 --link 10gbe
"""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
