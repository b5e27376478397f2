"""Experiment tracking of `train` runs (ray_job.tracking, MLflow), in the run lifecycle
(driver.run_in_folder) of `train`, the scaling sweep's points and Tune's trials alike:

    cfg = tracking.check(cfg)                      # preflight: exit 2 in seconds if the store fails
    t = tracked.start(cfg, parent_id=...)          # the MLflow run (new or continued); None w/o --mlflow
    rc = fit_and_summarise(cfg, started, [*t.callbacks()] if t else [], signals)
    t.finish(rc)                                   # catch-up, files, model, status; never raises

Everything the MLflow run gets at the end comes from the run folder, so a run folder on s3:// works
the same, and a run whose store was down at the end is completed by running the same command again.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from .. import storage
from ..config import TrainConfig
from ..core.errors import UsageError
from ..core.exits import ExitCode, is_stop
from ..tracking import Settings, problem
from .runfiles import CONFIG_JSON, METRICS_CSV, METRICS_JSONL, MLFLOW_JSON, SUMMARY_JSON
from .runlog import read_metrics

log = logging.getLogger("ray_job.tracking")
FILES = (CONFIG_JSON, SUMMARY_JSON, METRICS_CSV)


class Tracking:
    """One run's MLflow run, held by the driver (or a Tune trial's driver)."""

    def __init__(self, cfg: TrainConfig, run, logged: int, start_s: float):
        self.cfg, self.run, self.logged, self.start_s = cfg, run, logged, start_s

    @property
    def run_id(self) -> str:
        return self.run.run_id

    def callbacks(self) -> list:
        """The Ray Train callbacks that log each epoch (on the controller)."""
        from ..tracking.callback import EpochLogger

        return [EpochLogger(self.run.settings, self.run.run_id, self.logged)]

    def finish(self, exit_code: int, tags: Optional[dict] = None) -> None:
        """Completes the MLflow run from the run folder; a store that fails costs one warning,
        never the run (its folder is complete either way)."""
        started = time.monotonic()
        try:
            if tags:
                self.run.set_tags(tags)
            what = sync(self.cfg, self.run, exit_code)
        except Exception as e:  # the store is down or refuses: training is done all the same
            print(f"warning: tracking: {problem(self.run.settings, e, time.monotonic() - started)}. "
                  f"The run folder is complete; run the same command again to complete the MLflow "
                  f"run {self.run.run_id}", flush=True)
            return
        print(f"tracking: MLflow run {self.run.run_id}: {what} (start {self.start_s:.1f} s, end "
              f"{time.monotonic() - started:.1f} s in MLflow calls)", flush=True)


def start(cfg: TrainConfig, parent_id: Optional[str] = None, command: str = "train",
          settings: Optional[Settings] = None) -> Optional[Tracking]:
    """The run's MLflow run (a child of `parent_id`), params and tags logged; None without --mlflow.
    Before any worker starts: a failure is exit 2. `settings`: from this process's environment, or
    made on the user's driver and handed to a process that lacks it (a Tune trial's actor)."""
    if not cfg.mlflow:
        return None
    from ..tracking.facts import run_params

    run, logged, start_s = _open(cfg, cfg.run_dir(), command, run_params(cfg), parent_id, settings, epochs=True)
    print(f"tracking: MLflow run {run.run_id} ({'continued from epoch ' + str(logged) if run.continued else 'new'})"
          f" in experiment {run.settings.experiment!r} at {run.settings.uri}", flush=True)
    return Tracking(cfg, run, logged, start_s)


def _open(cfg: TrainConfig, folder: str, command: str, params: dict, parent_id: Optional[str] = None,
          settings: Optional[Settings] = None, epochs: bool = False) -> tuple[Any, int, float]:
    """The MLflow run kept in `folder` (a child of `parent_id`), tagged and `params` logged; the
    epochs it holds (with `epochs`) and the seconds it took. A store that fails is exit 2."""
    from ..tracking.facts import cluster_tags, code_tags
    from ..tracking.runs import open_run

    settings = settings or Settings.of(cfg)
    started = time.monotonic()
    try:
        run = open_run(settings, storage.at(folder).join(MLFLOW_JSON), cfg.name, parent_id,
                       tags={**code_tags(command), **cluster_tags(), "ray_job.run_dir": folder})
        run.log_params(params)
        logged = run.logged_epochs() if epochs else 0
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(problem(settings, e, time.monotonic() - started)) from None
    return run, logged, time.monotonic() - started


def complete_finished(cfg: TrainConfig) -> None:
    """A finished run, run again with --mlflow: its MLflow run completed (or made) from the run
    folder when the store lacks it (a store that was down at the end, or a run made untracked)."""
    if not cfg.mlflow:
        return
    from ..tracking.runs import read_state

    if read_state(storage.at(cfg.run_dir()).join(MLFLOW_JSON)).get("status") == "FINISHED":
        return
    start(cfg).finish(ExitCode.DONE)  # --mlflow: never None


def mlflow_status(exit_code: int) -> str:
    """An MLflow run's end status, from the exit code of what it tracked."""
    return "FINISHED" if exit_code == ExitCode.DONE else "KILLED" if is_stop(exit_code) else "FAILED"


def sync(cfg: TrainConfig, run, exit_code: int) -> str:
    """The epochs the store lacks, the run files, the model when finished, and the status."""
    run_dir = storage.at(cfg.run_dir())
    caught_up = run.log_epochs([r.to_dict() for r in read_metrics(run_dir.join(METRICS_JSONL))])
    files = {name: run_dir.join(name).read_bytes() for name in FILES if run_dir.join(name).exists()}
    run.log_files(files)
    status = mlflow_status(exit_code)
    model_uri = log_best_model(cfg, run) if status == "FINISHED" else None
    run.finish(status, model_uri=model_uri)
    done = [f"{caught_up} epoch(s) caught up" if caught_up else "", ", ".join(sorted(files)),
            f"model {model_uri}" if model_uri else "", status]
    return "; ".join(d for d in done if d)


def log_best_model(cfg: TrainConfig, run) -> Optional[str]:
    """The best checkpoint's model (trained.trained_model) as an MLflow PyTorch model, behind the
    normalisation the run used, taking float32 NCHW images in [0, 1] (ToTensor's convention)."""
    import torch
    import torchvision
    from torchvision.transforms import Normalize

    from ..data.augment import CIFAR10_MEAN, CIFAR10_STD
    from .trained import trained_model

    run_dir = storage.at(cfg.run_dir())
    summary = storage.read_json(run_dir.join(SUMMARY_JSON))
    best = summary.get("best_checkpoint")
    if not best:
        return None
    trained = trained_model(best, near=run_dir)
    module = torch.nn.Sequential(Normalize(CIFAR10_MEAN, CIFAR10_STD), trained.model).eval()
    pip = [f"torch=={torch.__version__.split('+')[0]}", f"torchvision=={torchvision.__version__.split('+')[0]}"]
    uri = run.log_model(module, cfg.image_size, len(trained.classes), pip)
    run.set_tags({"ray_job.model_uri": uri, "ray_job.model_checkpoint": best,
                  "ray_job.model_test_acc": summary.get("best_test_acc")})
    return uri


def open_parent(cfg: TrainConfig, folder: str, command: str, params: dict):
    """The MLflow run of a sweep or a search (None without --mlflow), parent of its points' or
    trials' runs; kept in `folder`, so a requeued sweep continues it. A failure is exit 2."""
    if not cfg.mlflow:
        return None
    parent = _open(cfg, folder, command, params)[0]
    print(f"tracking: MLflow run {parent.run_id} ({'continued' if parent.continued else 'new'}) for "
          f"{command} {cfg.name!r}: one child run per {'trial' if command == 'tune' else 'point'}", flush=True)
    return parent


def finish_parent(parent, folder: str, names: tuple, exit_code: int) -> None:
    """The sweep's (search's) files `names` in `folder` and its status; one warning if it fails."""
    if parent is None:
        return
    status = mlflow_status(exit_code)
    started = time.monotonic()
    try:
        where = storage.at(folder)
        parent.log_files({n: where.join(n).read_bytes() for n in names if where.join(n).exists()})
        parent.finish(status)
    except Exception as e:
        print(f"warning: tracking: {problem(parent.settings, e, time.monotonic() - started)}", flush=True)
        return
    print(f"tracking: MLflow run {parent.run_id}: {', '.join(names)}; {status}", flush=True)
