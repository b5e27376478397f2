"""Experiment tracking with MLflow: every run, sweep point and trial in a tracking store
(docs/tracking.md). Owns where runs are tracked, what is logged and from where; imports MLflow only
when --mlflow is given (`python -m ray_job train` without it imports neither mlflow nor this
package's callback).

Where: --mlflow-uri, else $MLFLOW_TRACKING_URI, else `sqlite:///<storage-path>/mlflow.db` (no
server; artifacts in <storage-path>/mlartifacts). Credentials only through MLflow's variables.
From where: the driver (run, params, tags at start; catch-up, files, model, status at the end) and
Ray Train's controller (each epoch's metrics, `callback.EpochLogger`); never the workers.

The parts, each importing only those before it:
  settings  the URI (bare) and credentials, the client's HTTP limits, telemetry off; the preflight
            (`check`): the store reached, the experiment found or made, or one UsageError
  epochs    which reports are epoch results; an epoch's figures as metrics (step = epoch)
  facts     tags (code, versions, nodes, GPUs, SLURM job) and params (config, world size, batch rule)
  runs      TrackedRun: a run opened or continued from the id kept in the run folder; params,
            tags, epochs, files, the model, the status
  callback  EpochLogger: the Ray Train UserCallback that logs each epoch once, from the controller

The API, for `train`, `scale sweep` and `tune` (what train/tracked.py wraps for a training run):
  cfg = check(cfg)                                 resolve the URI into cfg, reach the store (exit 2)
  parent = runs.open_run(Settings.of(cfg), STATE, NAME, tags=...)  a parent run for a sweep or a
      search; STATE is a Location of a JSON file in its folder (its id survives a requeue)
  child:  train.tracked.start(point_cfg, parent_id=parent.run_id) -> Tracking; its
      `.callbacks()` go into the trainer's RunConfig(callbacks=...) (beside Tune's report
      callback), `.finish(exit_code, tags=...)` completes it (e.g. tags={"ray_job.early_stopped":
      True}). In a process without the user's environment (a Tune trial's actor) pass
      `settings=Settings.of(cfg)` made on the user's driver: it carries the credentials.
  train.tracked.open_parent / finish_parent wrap the parent's side for a command like `scale sweep`
  parent.log_files({name: bytes}); parent.finish("FINISHED" | "KILLED" | "FAILED")
"""

from .settings import Settings, check, problem

__all__ = ["Settings", "check", "problem"]
