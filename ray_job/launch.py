"""The driver: checks inputs, connects to Ray, builds the TorchTrainer, runs it, summarises.

Every check that can fail fast runs before any worker starts, so bad input costs seconds. The run
folder (local or object storage) is reached through storage.py only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
from typing import Optional

from . import metrics, stop, storage
from .checkpoint import load_checkpoint, newest_saved_checkpoint
from .config import TrainConfig, UsageError, _flag, choose_use_gpu, is_uri
from .data import check_data
from .ports import free_port
from .runlog import (CONFIG_JSON, EVENTS_JSONL, METRICS_JSONL, SUMMARY_JSON, read_json, read_jsonl,
                     read_metrics, write_json)
from .storage import StorageError

log = logging.getLogger("ray_job.driver")
EXIT_PREEMPTED = 3
EXIT_NO_RESOURCES = 5  # the cluster could not hold the workers for --resource-wait-s
# An elastic run may try a size that a lost node still seems to offer (the GCS takes a few
# heartbeats to mark it dead); each try waits this long before Ray Train decides again.
ELASTIC_START_TIMEOUT_S = 60.0


# --- checks before Ray ------------------------------------------------------------------------

def with_default_name(cfg: TrainConfig) -> TrainConfig:
    if cfg.name:
        if os.sep in cfg.name or cfg.name in (".", ".."):
            raise UsageError(f"--name {cfg.name!r} must be a plain folder name, not a path")
        return cfg
    return dataclasses.replace(cfg, name=cfg.default_name())


def with_progress(cfg: TrainConfig) -> TrainConfig:
    """--progress auto: a live bar when the user watches a terminal, plain lines in log files."""
    if cfg.progress != "auto":
        return cfg
    return dataclasses.replace(cfg, progress="bar" if sys.stdout.isatty() else "lines")


def check_storage(cfg: TrainConfig) -> None:
    """--storage-path takes a write: a local folder, or object storage (endpoint reachable,
    credentials accepted, bucket there, writes allowed), checked in seconds."""
    try:
        storage.check_writable(cfg.storage_path)
    except StorageError as e:
        raise UsageError(str(e)) from None


def check_resume_from(cfg: TrainConfig) -> None:
    if cfg.resume_from:
        state = load_checkpoint(cfg.resume_from)  # raises a one-line CheckpointError
        saved = state.get("config", {})
        if saved.get("model") != cfg.model or saved.get("stem") != cfg.stem:
            raise UsageError(f"--resume-from holds a {saved.get('model')}/{saved.get('stem')} stem "
                             f"model; pass --model {saved.get('model')} --stem {saved.get('stem')}")


def check_sizes(cfg: TrainConfig, world: int) -> None:
    per_worker = cfg.per_worker_batch(world)
    if cfg.data == "synthetic" and cfg.synthetic_train_size < per_worker * world:
        raise UsageError(f"--synthetic-train-size {cfg.synthetic_train_size} is smaller than one "
                         f"global batch ({per_worker * world}); raise it or lower --batch-size")


def finished_summary(cfg: TrainConfig) -> Optional[dict]:
    try:
        summary = read_json(storage.at(cfg.run_dir()).join(SUMMARY_JSON))
    except FileNotFoundError:
        return None
    except StorageError as e:
        raise UsageError(f"cannot read the run's summary: {e}") from None
    done = summary.get("finished") and summary.get("epochs_completed", 0) >= cfg.epochs
    return summary if done else None


# --- Ray ---------------------------------------------------------------------------------------

def connect(cfg: TrainConfig) -> None:
    import ray

    if ray.is_initialized():  # e.g. the test suite's shared cluster
        return
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    # Read by Ray Train's controller: how long a worker group may wait for its resources.
    wait_s = min(cfg.resource_wait_s, ELASTIC_START_TIMEOUT_S) if cfg.min_workers else cfg.resource_wait_s
    runtime_env = {"env_vars": {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": f"{wait_s:g}"}}
    if address:
        log.info("joining the Ray cluster at %s", address)
        ray.init(address=address, log_to_driver=True, runtime_env=runtime_env)
    else:
        log.info("no --address / RAY_ADDRESS: starting a local Ray cluster in this process")
        # Ray Train's preemption watcher only logs a harmless error line on a local cluster.
        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
        # Ray Train's placement-group cleaner asks the state API; with other clusters on this
        # machine it cannot tell which one is ours unless told (the workers inherit this env).
        port = free_port()
        os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
        ray.init(address="local", dashboard_port=port, runtime_env=runtime_env)


def workers_that_fit(cpus: float, gpus: float, nodes: Optional[list] = None) -> int:
    """How many workers of this size the alive nodes (default: ray.nodes()) can ever hold (not
    just right now)."""
    import ray

    total = 0
    for node in ray.nodes() if nodes is None else nodes:
        if not node.get("Alive"):
            continue
        res = node.get("Resources", {})
        fit = int(res.get("CPU", 0) // cpus) if cpus else 10**6
        if gpus:
            fit = min(fit, int(res.get("GPU", 0) // gpus))
        total += fit
    return total


def resolve_workers(cfg: TrainConfig) -> TrainConfig:
    """Fills in --use-gpu and --num-workers from the cluster and checks that they fit."""
    import ray

    total_gpus = ray.cluster_resources().get("GPU", 0)
    use_gpu = choose_use_gpu(cfg.use_gpu, total_gpus)
    num_workers = cfg.num_workers or (int(total_gpus // cfg.gpus_per_worker) if use_gpu else 1)
    gpus = cfg.gpus_per_worker if use_gpu else 0
    if cfg.gpus_per_worker < 1 and use_gpu and cfg.backend != "gloo":
        raise UsageError("workers sharing a GPU (--gpus-per-worker < 1) need --backend gloo "
                         "(NCCL refuses two ranks on one GPU)")
    if cfg.min_workers > num_workers:
        raise UsageError(f"--min-workers {cfg.min_workers} is more than the {num_workers} workers "
                         f"of this run; give --min-workers <= --num-workers")
    fits = workers_that_fit(cfg.cpus_per_worker, gpus)
    need, flag = (cfg.min_workers, "--min-workers") if cfg.min_workers else (num_workers, "--num-workers")
    if need > fits:
        raise UsageError(f"{flag} {need} cannot fit: the cluster holds at most {fits} "
                         f"worker(s) of {worker_size(cfg.cpus_per_worker, gpus)} each; lower "
                         f"{flag} or --cpus-per-worker, or add nodes")
    return dataclasses.replace(cfg, use_gpu=use_gpu, num_workers=num_workers)


def worker_size(cpus: float, gpus: float) -> str:
    return f"{cpus:g} CPU" + (f" + {gpus:g} GPU" if gpus else "")


def missing_resources(cfg: TrainConfig) -> str:
    """What the cluster lacks for this run's workers, in words (for the resource-wait error)."""
    import ray

    gpus = cfg.gpus_per_worker if cfg.use_gpu else 0
    nodes = ray.nodes()
    alive = [n for n in nodes if n.get("Alive")]
    dead = [n.get("NodeManagerAddress", "?") for n in nodes if not n.get("Alive")]
    fits = workers_that_fit(cfg.cpus_per_worker, gpus, nodes)
    text = (f"the cluster holds {fits} of the {cfg.num_workers} workers of "
            f"{worker_size(cfg.cpus_per_worker, gpus)} each ({len(alive)} node(s) alive")
    return text + (f"; lost: {', '.join(sorted(set(dead)))})" if dead else ")")


def build_trainer(cfg: TrainConfig):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from .loop import train_loop_per_worker

    resources = {"CPU": cfg.cpus_per_worker}
    if cfg.use_gpu:
        resources["GPU"] = cfg.gpus_per_worker
    # One filesystem for Ray's files too (its checkpoint snapshot, old checkpoints' deletion): built
    # here from the AWS variables, pickled to the controller and the workers (which so need no
    # copy of them), its calls retried for --retry-storage-s seconds.
    root = storage.at(cfg.storage_path)
    # Fixed size: a lost node is a failure, and the restart waits RAY_TRAIN_WORKER_GROUP_START_
    # TIMEOUT_S (= --resource-wait-s, set in connect) for the workers; then the controller gives
    # up at once (limit 0) and the driver exits 5. Elastic: Ray Train starts with whatever fits
    # between min and max and restarts the group (from the latest checkpoint) when nodes go or
    # come back; a start that times out (a size a dying node seemed to offer) is decided again.
    workers = (cfg.min_workers, cfg.num_workers) if cfg.min_workers else cfg.num_workers
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=cfg.to_dict(),
        # timeout_s: a stuck collective fails the step (gloo; NCCL's watchdog) instead of hanging
        torch_config=TorchConfig(backend=None if cfg.backend == "auto" else cfg.backend,
                                 timeout_s=int(cfg.collective_timeout_s)),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=bool(cfg.use_gpu),
                                     resources_per_worker=resources),
        run_config=RunConfig(
            name=cfg.name,
            storage_path=root.path,
            storage_filesystem=storage.for_ray(root, cfg.retry_storage_s),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints,
                                               checkpoint_score_attribute="test_acc",
                                               checkpoint_score_order="max"),
            failure_config=FailureConfig(max_failures=cfg.max_failures,
                                         controller_failure_limit=-1 if cfg.min_workers else 0),
        ),
    )


# --- the whole run -----------------------------------------------------------------------------

def check_submitted_job_paths(cfg: TrainConfig) -> None:
    """Under `ray job submit` the driver runs in a temporary copy of --working-dir on the cluster:
    a relative path would put the results there, where nobody finds them again."""
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" not in os.environ:  # set by Ray's job supervisor
        return
    fields = ["storage_path", "resume_from"] + ([] if cfg.data == "synthetic" else ["data_dir"])
    for name in fields:
        value = getattr(cfg, name)
        if value and not os.path.isabs(os.path.expanduser(value)) and not is_uri(value):
            raise UsageError(f"--{_flag(name)} {value} is relative, but a submitted job runs "
                             f"in a temporary copy of --working-dir: give an absolute path on a file "
                             f"system that every node shares")


def preflight(cfg: TrainConfig) -> TrainConfig:
    """Decisions made once, on the driver, and checks that fail in seconds before Ray starts."""
    check_submitted_job_paths(cfg)
    cfg = with_progress(with_default_name(cfg.with_resolved_paths()))
    check_storage(cfg)
    check_data(cfg)
    check_resume_from(cfg)
    return cfg


def run_training(cfg: TrainConfig) -> int:
    started = time.time()
    cfg = preflight(cfg)
    done = finished_summary(cfg)
    if done is not None:
        best = done.get("best_test_acc")
        print(f"run {cfg.name!r} already finished {done['epochs_completed']} epochs (best test "
              f"accuracy {'-' if best is None else f'{best:.4f}'}); results in {cfg.run_dir()}. Use "
              f"a new --name, or more --epochs to continue it.")
        return 0
    run_dir = storage.at(cfg.run_dir())
    try:
        run_dir.makedirs()
        stop.clear(run_dir)  # a request left by the previous (requeued) run is done
    except StorageError as e:
        raise UsageError(str(e)) from None
    stop.stop_on_usr1(run_dir)  # before Ray starts: a USR1 from now on is a request
    connect(cfg)
    cfg = resolve_workers(cfg)
    for world in {cfg.min_workers or cfg.num_workers, cfg.num_workers}:  # every size it may run at
        check_sizes(cfg, world)
    try:
        write_json(run_dir.join(CONFIG_JSON), cfg.to_dict())
    except StorageError as e:
        raise UsageError(str(e)) from None
    print("config:\n" + cfg.to_json(), flush=True)
    return fit_and_summarise(cfg, started)


def fit_and_summarise(cfg: TrainConfig, started: float) -> int:
    from ray.train.v2.api.exceptions import TrainingFailedError

    try:
        result = build_trainer(cfg).fit()
    except TrainingFailedError as e:
        reason = " ".join(str(e).split())[:300]  # one line: the error's own text, whitespace folded
        if isinstance(getattr(e, "controller_failure", None), OSError):
            # Ray's controller could not write its record of checkpoints (after --retry-storage-s)
            reason = " ".join(str(e.controller_failure).split())[:300]
            return storage_failed(cfg, started, f"Ray could not record the checkpoints ({reason})",
                                  None)
        if is_resource_timeout(e):
            return resources_lost(cfg, started)
        with contextlib.suppress(StorageError):  # the failure may be the storage's own
            write_summary(cfg, started, finished=False, error=reason)
        print(f"error: training failed after {cfg.max_failures} restart(s): {reason} (worker logs "
              f"above; --max-failures allows more restarts)", file=sys.stderr)
        return 1
    outcome = result.return_value or {}
    if outcome.get("usage_error"):  # bad input that only the workers could see: exit 2, one line
        raise UsageError(outcome["usage_error"])
    root = storage.at(cfg.storage_path)
    best = result.get_best_checkpoint("test_acc", "max") if result.best_checkpoints else None
    best, latest = (root.at_path(c.path).uri if c else None for c in (best, result.checkpoint))
    if outcome.get("storage_error"):
        return storage_failed(cfg, started, outcome["storage_error"], latest)
    preempted = bool(outcome.get("preempted"))
    try:
        summary = write_summary(cfg, started, finished=not preempted, best_checkpoint=best,
                                latest_checkpoint=latest)
        print(summary_table(cfg))
    except StorageError as e:
        return storage_failed(cfg, started, str(e), latest)
    if preempted:
        print(f"stopped on request at epoch {outcome['epoch'] + 1} step {outcome['step']}; checkpoint "
              f"saved. Run the same command again to continue.")
        return EXIT_PREEMPTED
    best_acc = summary["best_test_acc"]
    print(f"results: {cfg.run_dir()}\nbest checkpoint: {summary['best_checkpoint']} (test accuracy "
          f"{'-' if best_acc is None else f'{best_acc:.4f}'})")
    return 0


def is_resource_timeout(e: Exception) -> bool:
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

    return isinstance(getattr(e, "controller_failure", None), WorkerGroupStartupTimeoutError)


def resources_lost(cfg: TrainConfig, started: float) -> int:
    """The workers did not fit for --resource-wait-s (a node lost, or the cluster busy): say what
    is missing and exit EXIT_NO_RESOURCES; the checkpoints saved so far stay, nothing new is."""
    missing = missing_resources(cfg)
    latest = latest_checkpoint(cfg)
    with contextlib.suppress(StorageError):
        write_summary(cfg, started, finished=False, latest_checkpoint=latest,
                      error=f"no resources for {cfg.resource_wait_s:g} s: {missing}")
    saved = f"last checkpoint: {latest}" if latest else "no checkpoint yet"
    print(f"error: waited {cfg.resource_wait_s:g} s (--resource-wait-s) for the workers: {missing}. "
          f"Nothing new was saved ({saved}); run the same command when the nodes are back (under "
          f"SLURM the job is requeued), or use --min-workers to go on with fewer", file=sys.stderr)
    return EXIT_NO_RESOURCES


def latest_checkpoint(cfg: TrainConfig) -> Optional[str]:
    run_dir = storage.at(cfg.run_dir())
    name = newest_saved_checkpoint(run_dir)
    return run_dir.join(name).uri if name else None


def storage_failed(cfg: TrainConfig, started: float, error: str, latest: Optional[str]) -> int:
    """The storage failed at the end (after --retry-storage-s): say what was saved, exit 1."""
    with contextlib.suppress(StorageError):
        write_summary(cfg, started, finished=False, error=error, latest_checkpoint=latest)
    saved = f"Last checkpoint saved: {latest}" if latest else "Ray keeps the last checkpoint it recorded"
    print(f"error: storage failed: {error}. {saved}; once the storage works again, run the same "
          f"command: it continues from there", file=sys.stderr)
    return 1


def write_summary(cfg: TrainConfig, started: float, finished: bool, **extra) -> dict:
    run_dir = storage.at(cfg.run_dir())
    rows = read_metrics(run_dir.join(METRICS_JSONL))
    events = read_jsonl(run_dir.join(EVENTS_JSONL))
    first = [e["time"] for e in events if e["event"] == "first_step" and e["time"] >= started]
    last = rows[-1] if rows else None
    summary = dict(name=cfg.name, run_dir=cfg.run_dir(), finished=finished,
                   epochs_completed=last.epoch if last else 0, epochs=cfg.epochs,
                   best_test_acc=max((r.test_acc for r in rows), default=None),
                   final=last.to_dict() if last else None, wall_s=time.time() - started,
                   time_to_first_step_s=(first[0] - started) if first else None,
                   # first training step to the last evaluation, as in time-to-accuracy benchmarks
                   train_wall_s=(last.time - first[0]) if first and last else None,
                   num_workers=cfg.num_workers, use_gpu=cfg.use_gpu, **extra)
    write_json(run_dir.join(SUMMARY_JSON), summary)
    return summary


def summary_table(cfg: TrainConfig) -> str:
    return metrics.table(read_metrics(storage.at(cfg.run_dir()).join(METRICS_JSONL)))
