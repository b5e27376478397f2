"""The Ray side of the driver: joining or starting a cluster, deciding the workers from what it
holds, building the TorchTrainer (scaling, storage, retention, failure handling); and the driver's
account of a run: summary.json, the final table, "already finished", and the last words of a run
that ends otherwise (aborted, out of resources, the storage failing)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional

from .. import storage
from ..cluster import raypriv, rayenv
from ..cluster.ports import free_port
from ..config import TrainConfig, choose_use_gpu
from ..core.errors import UsageError
from ..core.exits import ExitCode
from ..storage import StorageError
from . import hold, stop
from .checkpointer import SCORE_METRIC, SCORE_ORDER, saved_checkpoints
from .runfiles import EVENTS_JSONL, METRICS_JSONL, SUMMARY_JSON, Event
from .runlog import read_metrics

log = logging.getLogger("ray_job.driver")
# How long one start of the worker group waits for its resources: --resource-wait-s for a fixed size;
# an elastic run may try a size that a lost node still seems to offer (the GCS takes a few heartbeats
# to mark it dead), so each try waits at most this long before Ray Train decides again.
ELASTIC_START_TIMEOUT_S = 30.0
# Before a restart Ray Train waits this long for the old group's workers to destroy their process
# group, then kills them; a hung or lost worker never answers, and Ray's default (30 s) delayed
# every such restart by that much. A healthy group is done in well under a second.
PG_SHUTDOWN_TIMEOUT_S = 5
# How often Ray Train's controller polls the workers (Ray's default: 2 s). A worker's report waits in a
# queue of one until the next poll takes the previous one, and the end of training is seen at a poll:
# at 2 s every run ended ~3.7 s after its last checkpoint was saved (two reports back to back, then
# the return), and every stop or restart waited as much. A poll is one small actor call per worker.
CONTROLLER_POLL_S = 0.5


def connect(cfg: TrainConfig) -> None:
    import ray

    if ray.is_initialized():  # e.g. the test suite's shared cluster
        return
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    # Read by Ray Train's controller: how long a worker group may wait for its resources, for the
    # old group's process group to be destroyed before a restart, and how often it polls the
    # workers; the workers' malloc; a hold asked for (hold.py).
    wait_s = min(cfg.resource_wait_s, ELASTIC_START_TIMEOUT_S) if cfg.min_workers else cfg.resource_wait_s
    runtime_env = {"env_vars": {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": f"{wait_s:g}",
                                "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S": str(PG_SHUTDOWN_TIMEOUT_S),
                                "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": f"{CONTROLLER_POLL_S:g}",
                                **rayenv.worker_malloc(os.environ),
                                **({hold.ENV: os.environ[hold.ENV]} if hold.ENV in os.environ else {})}}
    if address:
        log.info("joining the Ray cluster at %s", address)
        ray.init(address=address, log_to_driver=True, runtime_env=runtime_env)
    else:
        log.info("no --address / RAY_ADDRESS: starting a local Ray cluster in this process")
        rayenv.apply_defaults()  # as every cluster of ours: no usage stats, no drain, no watcher noise
        # Ray Train's placement-group cleaner asks the state API; with other clusters on this
        # machine it cannot tell which one is ours unless told (the workers inherit this env).
        port = free_port(avoid=raypriv.default_ports())  # a kernel's pick once was 52365, the agent's
        os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
        ray.init(address="local", dashboard_port=port, runtime_env=runtime_env)
    try:  # a warm-up: if it fails, the controller starts the coordinator itself, 5 s later
        raypriv.start_autoscaling_coordinator()
    except Exception as e:  # nothing about the run depends on it
        log.debug("could not start Ray's autoscaling coordinator ahead: %s", e)


def workers_that_fit(cpus: float, gpus: float, nodes: Optional[list] = None) -> int:
    """How many workers of this size the alive nodes (default: ray.nodes()) can ever hold (not
    just right now)."""
    import ray

    return sum(workers_on_node(n.get("Resources", {}), cpus, gpus)
               for n in (ray.nodes() if nodes is None else nodes) if n.get("Alive"))


def workers_on_node(resources: dict, cpus: float, gpus: float) -> int:
    """How many workers of this size one node's resources hold."""
    on_cpus = int(resources.get("CPU", 0) // cpus) if cpus else 10**6
    return min(on_cpus, int(resources.get("GPU", 0) // gpus)) if gpus else on_cpus


def resolve_workers(cfg: TrainConfig) -> TrainConfig:
    """Fills in --use-gpu and --num-workers from the cluster and checks that they fit."""
    import ray

    total_gpus = ray.cluster_resources().get("GPU", 0)
    use_gpu = choose_use_gpu(cfg.use_gpu, total_gpus)
    num_workers = cfg.num_workers or (int(total_gpus // cfg.gpus_per_worker) if use_gpu else 1)
    # the config checks --min-workers against the workers decided here (TrainConfig.__post_init__)
    cfg = dataclasses.replace(cfg, use_gpu=use_gpu, num_workers=num_workers)
    fits = workers_that_fit(cfg.cpus_per_worker, cfg.gpus_in_use)
    need, flag = (cfg.min_workers, "--min-workers") if cfg.min_workers else (num_workers, "--num-workers")
    if need > fits:
        raise UsageError(f"{flag} {need} cannot fit: the cluster holds at most {fits} "
                         f"worker(s) of {worker_size(cfg)} each; lower "
                         f"{flag} or --cpus-per-worker, or add nodes")
    return cfg


def worker_size(cfg: TrainConfig) -> str:
    return f"{cfg.cpus_per_worker:g} CPU" + (f" + {cfg.gpus_in_use:g} GPU" if cfg.gpus_in_use else "")


def missing_resources(cfg: TrainConfig) -> str:
    """What the cluster lacks for this run's workers, in words (for the resource-wait error)."""
    import ray

    nodes = ray.nodes()
    alive = [n for n in nodes if n.get("Alive")]
    dead = [n.get("NodeManagerAddress", "?") for n in nodes if not n.get("Alive")]
    fits = workers_that_fit(cfg.cpus_per_worker, cfg.gpus_in_use, nodes)
    text = (f"the cluster holds {fits} of the {cfg.num_workers} workers of "
            f"{worker_size(cfg)} each ({len(alive)} node(s) alive")
    return text + (f"; lost: {', '.join(sorted(set(dead)))})" if dead else ")")


def build_trainer(cfg: TrainConfig, callbacks: Sequence[Any] = ()):
    """The TorchTrainer of this run; `callbacks`: Ray Train UserCallbacks for its RunConfig (Tune's
    report callback, experiment tracking), run on Ray Train's controller."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    from .notices import Quiet
    from .worker import train_loop_per_worker

    resources = {"CPU": cfg.cpus_per_worker, **({"GPU": cfg.gpus_in_use} if cfg.use_gpu else {})}
    # One filesystem for Ray's files too (its checkpoint snapshot, old checkpoints' deletion): built
    # here from the AWS variables, pickled to the controller and the workers (which so need no
    # copy of them), its calls retried for --retry-storage-s seconds.
    root = storage.at(cfg.storage_path)
    # Fixed size: a lost node is a failure, and the restart waits RAY_TRAIN_WORKER_GROUP_START_
    # TIMEOUT_S (= --resource-wait-s, set in connect) for the workers; then the controller gives
    # up at once (limit 0) and the driver exits 5. Elastic: Ray Train starts with whatever fits
    # between min and max and restarts the group (from the latest checkpoint) when nodes go or
    # come back; a start that times out (a size a dying node seemed to offer) is decided again.
    # Below --min-workers for --resource-wait-s the driver gives up too (BelowMinimum).
    workers = (cfg.min_workers, cfg.num_workers) if cfg.min_workers else cfg.num_workers
    # Ray's backend (NCCL on GPUs, gloo on CPUs), but gloo for workers that share a GPU (NCCL refuses
    # two ranks on one GPU)
    backend = "gloo" if cfg.use_gpu and cfg.gpus_per_worker < 1 else None
    return raypriv.trainer_class()(  # TorchTrainer, without an actor our runs do not use
        train_loop_per_worker,
        train_loop_config=cfg.to_dict(),
        # timeout_s: a stuck collective fails the step (gloo; NCCL's watchdog) instead of hanging
        torch_config=TorchConfig(backend=backend, timeout_s=int(cfg.collective_timeout_s)),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=bool(cfg.use_gpu),
                                     resources_per_worker=resources,
                                     elastic_resize_monitor_interval_s=cfg.grow_check_s),
        run_config=RunConfig(
            name=cfg.name,
            storage_path=root.path,
            storage_filesystem=storage.for_ray(root, cfg.retry_storage_s),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints,  # the best, and the latest
                                               checkpoint_score_attribute=SCORE_METRIC,
                                               checkpoint_score_order=SCORE_ORDER),
            failure_config=FailureConfig(max_failures=cfg.max_failures,
                                         controller_failure_limit=-1 if cfg.min_workers else 0),
            callbacks=[Quiet(), *callbacks],
        ),
    )


class BelowMinimum:
    """Elastic runs: Ray Train waits without a time limit while fewer than --min-workers fit. Asked
    every few seconds during fit(), this says so once that lasted --resource-wait-s (and the driver
    gives up: exit 5, as a fixed-size run does)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg, self.since = cfg, None

    def __call__(self) -> Optional[str]:
        if workers_that_fit(self.cfg.cpus_per_worker, self.cfg.gpus_in_use) >= self.cfg.min_workers:
            self.since = None
            return None
        self.since = self.since or time.monotonic()
        if time.monotonic() - self.since < self.cfg.resource_wait_s:
            return None
        return f"below --min-workers {self.cfg.min_workers} for {self.cfg.resource_wait_s:g} s"


def finished_summary(cfg: TrainConfig) -> Optional[dict]:
    try:
        summary = storage.read_json(storage.at(cfg.run_dir()).join(SUMMARY_JSON))
    except FileNotFoundError:
        return None
    except StorageError as e:
        raise UsageError(f"cannot read the run's summary: {e}") from None
    done = summary.get("finished") and summary.get("epochs_completed", 0) >= cfg.epochs
    return summary if done else None


def announce_finished(cfg: TrainConfig) -> bool:
    """Says so when this run already finished its epochs (the same command run again)."""
    done = finished_summary(cfg)
    if done is not None:
        best = done.get("best_test_acc")
        print(f"run {cfg.name!r} already finished {done['epochs_completed']} epochs (best test "
              f"accuracy {'-' if best is None else f'{best:.4f}'}); results in {cfg.run_dir()}. Use "
              f"a new --name, or more --epochs to continue it.")
    return done is not None


def latest_checkpoint(cfg: TrainConfig) -> Optional[str]:
    run_dir = storage.at(cfg.run_dir())
    name = max(saved_checkpoints(run_dir), default=None)  # names sort by time
    return run_dir.join(name).uri if name else None


def write_summary(cfg: TrainConfig, started: float, finished: bool, **extra) -> dict:
    run_dir = storage.at(cfg.run_dir())
    rows = read_metrics(run_dir.join(METRICS_JSONL))
    events = storage.read_jsonl(run_dir.join(EVENTS_JSONL))
    first = [e["time"] for e in events if e["event"] == Event.FIRST_STEP and e["time"] >= started]
    last = rows[-1] if rows else None
    summary = dict(name=cfg.name, run_dir=cfg.run_dir(), finished=finished,
                   epochs_completed=last.epoch if last else 0, epochs=cfg.epochs,
                   best_test_acc=max((r.test_acc for r in rows), default=None),
                   final=last.to_dict() if last else None, wall_s=time.time() - started,
                   time_to_first_step_s=(first[0] - started) if first else None,
                   # first training step to the last evaluation, as in time-to-accuracy benchmarks
                   train_wall_s=(last.time - first[0]) if first and last else None,
                   num_workers=cfg.num_workers, use_gpu=cfg.use_gpu, **extra)
    storage.write_json(run_dir.join(SUMMARY_JSON), summary)
    return summary


def aborted(cfg: TrainConfig, started: float, signals: stop.Signals) -> int:
    """A second Ctrl-C or SIGTERM: no waiting for the checkpoint at the current step; the workers
    end with this driver, and the last complete checkpoint stays the one to continue from."""
    import ray

    latest = latest_checkpoint(cfg)
    with contextlib.suppress(StorageError):
        write_summary(cfg, started, finished=False, stopped=f"{signals.reason}, aborted", latest_checkpoint=latest)
    ray.shutdown()
    saved = f"the last complete checkpoint is {latest}" if latest else "no checkpoint was complete yet"
    print(f"error: aborted by a second {signals.reason} without a new checkpoint; {saved}. Run the same "
          f"command again to continue from it.", file=sys.stderr)
    return signals.exit_code


def resources_lost(cfg: TrainConfig, started: float) -> int:
    """The workers did not fit for --resource-wait-s (a node lost, or the cluster busy): say what
    is missing and exit NO_RESOURCES (5); the checkpoints saved so far stay, nothing new is."""
    missing = missing_resources(cfg)
    latest = latest_checkpoint(cfg)
    with contextlib.suppress(StorageError):
        write_summary(cfg, started, finished=False, latest_checkpoint=latest,
                      error=f"no resources for {cfg.resource_wait_s:g} s: {missing}")
    saved = f"last checkpoint: {latest}" if latest else "no checkpoint yet"
    print(f"error: waited {cfg.resource_wait_s:g} s (--resource-wait-s) for the workers: {missing}. "
          f"Nothing new was saved ({saved}); run the same command when the nodes are back (under "
          f"SLURM the job is requeued), or use --min-workers to go on with fewer", file=sys.stderr)
    return ExitCode.NO_RESOURCES


def storage_failed(cfg: TrainConfig, started: float, error: str, latest: Optional[str]) -> int:
    """The storage failed at the end (after --retry-storage-s): say what was saved, exit 1."""
    with contextlib.suppress(StorageError):
        write_summary(cfg, started, finished=False, error=error, latest_checkpoint=latest)
    saved = f"Last checkpoint saved: {latest}" if latest else "Ray keeps the last checkpoint it recorded"
    print(f"error: storage failed: {error}. {saved}; once the storage works again, run the same "
          f"command: it continues from there", file=sys.stderr)
    return ExitCode.FAILED
