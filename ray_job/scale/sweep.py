"""The sweep on a Ray cluster: one real `train` run per (mode, worker count), then the report.

Each point is a run in <sweep>/<mode>_w<N>/ (the 1-worker run, w1, is shared: strong and weak are the
same job there), run by `train`'s own run_training with the sweep's config, the point's folder, worker
count and batch rule. A finished point is reused when the same sweep runs again (a requeued SLURM job,
or the same command: its default name is the same); a count the cluster cannot hold is a `skipped`
row with the reason.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import shlex
import time
from typing import Any, Optional

from .. import storage
from ..config import TrainConfig, choose_use_gpu
from ..core.errors import UsageError
from ..core.exits import ExitCode, is_stop
from ..storage import read_json
from ..train import stop, tracked
from ..train.driver import make_way, open_folder, preflight, run_training
from ..train.metrics import EpochMetrics
from ..train.runfiles import SUMMARY_JSON
from ..train.trainer import connect
from . import COLUMNS, MODES, OUTPUTS, ScaleOptions
from .report import write_outputs

log = logging.getLogger("ray_job.scale")


def run_sweep(opts: ScaleOptions, cfg: TrainConfig, argv: list[str]) -> int:
    """The whole sweep: the points, then the report; the exit code."""
    cfg = preflight(cfg)  # paths resolved and storage checked before any point config is built
    sweep_dir = open_folder(cfg.run_dir()).uri  # without a requeued sweep's stop request
    with stop.stop_on_signals(sweep_dir) as signals:  # USR1 (SLURM's time limit), Ctrl-C, SIGTERM
        connect(cfg)
        cluster = cluster_info()
        cfg = dataclasses.replace(cfg, use_gpu=choose_use_gpu(cfg.use_gpu, cluster["gpus"]))
        load_before = os.getloadavg()[0]
        parent = tracked.open_parent(cfg, sweep_dir, "scale sweep", {**cfg.to_dict(), **dataclasses.asdict(opts)})
        rows = measure_all(cfg, sweep_dir, opts.modes, opts.counts, parent.run_id if parent else None)
        # Other jobs on the driver's host skew the timings: keep the load beside them.
        cluster["driver_host_load_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        add_speedups(rows)
        sweep = dict(sweep=cfg.name, sweep_dir=sweep_dir, date=time.strftime("%Y-%m-%d %H:%M:%S %z"),
                     command="python -m ray_job scale " + shlex.join(argv), host=platform.node(),
                     cluster=cluster, config=cfg.to_dict(), rows=rows)
        print(write_outputs(sweep))
        print(f"scaling results: {sweep_dir}/{{{','.join(OUTPUTS)}}}")
        statuses = {r["status"] for r in rows}
        if statuses & {"preempted", "not run"}:
            print("sweep stopped on request; run the same command (same --name) to finish it: finished "
                  "points are reused")
            rc = signals.exit_code
        else:
            rc = ExitCode.FAILED if "failed" in statuses else ExitCode.DONE
        tracked.finish_parent(parent, sweep_dir, OUTPUTS, rc)
        return rc


def measure_all(cfg: TrainConfig, sweep_dir: str, modes: list[str], counts: list[int],
                parent_id: Optional[str] = None) -> list[dict]:
    """One row per (mode, count), modes in order; the 1-worker run is shared by all modes.
    `parent_id`: the sweep's MLflow run (--mlflow), each point a child of it."""
    plan = [(m, n) for m in modes for n in counts if not (n == 1 and m != modes[0])]
    rows = []
    for i, (mode, n) in enumerate(plan, 1):
        if stop.requested(sweep_dir):
            rows.append(dict(mode=mode, workers=n, status="not run", run="",
                             reason="the sweep was asked to stop (preemption / time limit)"))
            continue
        log.info("scale: point %d/%d: %s scaling, %d worker(s)", i, len(plan), mode, n)
        rows.append(measure_point(cfg, sweep_dir, mode, n, parent_id))
        if rows[-1]["status"] == "preempted":  # asked to stop while running: stop the sweep too
            stop.request(sweep_dir)
    for mode in modes[1:]:
        rows.insert(modes.index(mode) * len(counts), {**rows[0], "mode": mode})
    return rows


def cluster_info() -> dict:
    import ray

    res = ray.cluster_resources()
    return dict(nodes=sum(1 for n in ray.nodes() if n.get("Alive")), cpus=res.get("CPU", 0), gpus=res.get("GPU", 0))


def measure_point(cfg: TrainConfig, sweep_dir: str, mode: str, workers: int, parent_id: Optional[str]) -> dict:
    """Runs one point; a count that cannot run is a row with status skipped/failed and the reason."""
    # w1 is the same job in every mode, so any later sweep of either mode reuses it
    point = dataclasses.replace(cfg, storage_path=sweep_dir, num_workers=workers,
                                name="w1" if workers == 1 else f"{mode}_w{workers}",
                                batch_mode="global" if workers == 1 else MODES[mode])
    row: dict[str, Any] = dict(mode=mode, workers=workers, status="ok", reason="", run=point.name)
    # an unfinished point is run again from its start: resumed, it would time only part of the work
    if make_way(point, resume=False, refuse_other=True):
        row["reason"] = "reused: finished by an earlier run of this sweep"
    try:
        with stop.forward(sweep_dir, point.run_dir()):
            rc = run_training(point, parent_id)
    except UsageError as e:  # does not fit, batch too small for this count, ...
        log.warning("scale: %s %d worker(s) skipped: %s", mode, workers, e)
        return {**row, "status": "skipped", "reason": str(e)}
    except Exception as e:  # one broken point must not lose the whole sweep
        log.exception("scale: %s %d worker(s) failed", mode, workers)
        return {**row, "status": "failed", "reason": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    if is_stop(rc):
        return {**row, "status": "preempted", "reason": "stopped on request; rerun to measure it"}
    if rc != 0:
        return {**row, "status": "failed", "reason": f"train exited with {rc}; see {point.run_dir()}"}
    summary = read_json(storage.at(point.run_dir()).join(SUMMARY_JSON))  # the timings: its last epoch's
    if summary.get("final") is None:
        return {**row, "status": "failed", "reason": f"{point.run_dir()}/{SUMMARY_JSON} has no finished epoch"}
    m = EpochMetrics.from_dict(summary["final"])
    steps = max(m.steps, 1)
    comm = m.comm_wait_s_per_step or 0.0
    steady = m.steady_images_per_s or m.images_per_s
    gb = point.global_batch(point.num_workers)
    return dict(row, global_batch=gb, per_worker_batch=point.per_worker_batch(point.num_workers),
                steps=m.steps, wall_s=summary["wall_s"],
                time_to_first_step_s=summary["time_to_first_step_s"], train_s=m.train_s,
                images_per_s=m.images_per_s, steady_images_per_s=steady, step_s=gb / steady,
                data_s_per_step=m.data_s / steps,
                compute_s_per_step=max(0.0, m.fwd_bwd_s / steps - comm),
                comm_wait_s_per_step=comm, optim_s_per_step=m.optim_s / steps,
                grad_bytes=m.grad_bytes)


def add_speedups(rows: list[dict]) -> None:
    """Speedup = steady images/s against 1 worker in the same mode; efficiency = speedup / N."""
    base = {r["mode"]: r for r in rows if r["workers"] == 1 and r["status"] == "ok"}
    for r in rows:
        for key in COLUMNS:
            r.setdefault(key, None)
        if r["status"] == "ok" and r["mode"] in base:
            r["speedup"] = r["steady_images_per_s"] / base[r["mode"]]["steady_images_per_s"]
            r["efficiency"] = r["speedup"] / r["workers"]
