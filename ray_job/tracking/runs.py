"""One MLflow run of ours, opened on the driver: new, or continued from the id that the run folder
keeps (`state`: a small JSON file written through ray_job.storage, so it works on s3:// too), so
that a rerun or a requeued job adds its epochs to the same run and never makes a duplicate."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from .. import storage
from ..core.errors import UsageError
from ..storage import Location, StorageError
from .epochs import EPOCH_KEY, metric_values
from .settings import Settings, experiment_id, make_client, set_env

log = logging.getLogger("ray_job.tracking")
BATCH = 100  # MLflow takes at most 100 params (and 1000 metrics) per call


@dataclass
class TrackedRun:
    """An MLflow run that the driver logs to; `state` is its record in the run (or sweep) folder."""

    settings: Settings
    run_id: str
    state: Location
    continued: bool = False
    client: Any = field(default=None, repr=False)

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Params are write-once in MLflow: a continued run logs the new ones; one whose value
        changed (more --epochs) gets the new value as the tag `param.<name>`."""
        from mlflow.entities import Param, RunTag

        old = self.client.get_run(self.run_id).data.params
        new = [Param(k, str(v)) for k, v in params.items() if k not in old]
        changed = [RunTag(f"param.{k}", str(v)) for k, v in params.items() if k in old and old[k] != str(v)]
        for i in range(0, len(new), BATCH):
            self.client.log_batch(self.run_id, params=new[i:i + BATCH])
        if changed:
            self.client.log_batch(self.run_id, tags=changed)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def logged_epochs(self) -> int:
        """The last epoch the store has (0: none)."""
        history = self.client.get_metric_history(self.run_id, EPOCH_KEY)
        return max((m.step for m in history), default=0)

    def log_epochs(self, rows: Iterable[dict]) -> int:
        """The epochs of `rows` the store lacks; how many were logged."""
        from mlflow.entities import Metric

        values = metric_values(rows, after=self.logged_epochs())
        for i in range(0, len(values), 1000):
            self.client.log_batch(self.run_id, metrics=[Metric(*v) for v in values[i:i + 1000]])
        return len({step for *_, step in values})

    def log_files(self, files: Mapping[str, bytes], artifact_path: Optional[str] = None) -> None:
        with tempfile.TemporaryDirectory(prefix="rj_mlflow_") as tmp:
            for name, data in files.items():
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(data)
            self.client.log_artifacts(self.run_id, tmp, artifact_path)

    def log_model(self, module, image_size: int, classes: int, pip: list[str]) -> str:
        """`module` (float32 NCHW images in [0, 1] -> logits) as an MLflow PyTorch model of this
        run, registered when --mlflow-register names a model; its URI."""
        import mlflow
        import mlflow.pytorch
        import numpy as np
        from mlflow.models import ModelSignature
        from mlflow.types import Schema, TensorSpec

        signature = ModelSignature(Schema([TensorSpec(np.dtype(np.float32), (-1, 3, image_size, image_size))]),
                                   Schema([TensorSpec(np.dtype(np.float32), (-1, classes))]))
        quiet = logging.getLogger("mlflow.pytorch")  # its pickle warning: our own model, loaded by you
        level, quiet.level = quiet.level, logging.ERROR
        # mlflow's fluent API takes the store from process-wide settings, which it also puts into
        # this process's environment: both go back afterwards, so that nothing started later (a
        # sweep's next point, a child process) inherits this run's store.
        saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
        mlflow.set_tracking_uri(self.settings.uri)
        mlflow.set_registry_uri(self.settings.uri)
        try:
            with mlflow.start_run(run_id=self.run_id):
                info = mlflow.pytorch.log_model(module, name="model", signature=signature, pip_requirements=pip,
                                                serialization_format="pickle",
                                                registered_model_name=self.settings.register or None)
        finally:
            quiet.setLevel(level)
            mlflow.set_tracking_uri(saved["MLFLOW_TRACKING_URI"] or "")
            mlflow.set_registry_uri(saved["MLFLOW_REGISTRY_URI"] or "")
            set_env(saved)
        return info.model_uri

    def finish(self, status: str, **record: Any) -> None:
        """The run's status (FINISHED, KILLED: stopped, to be continued; FAILED) and its record."""
        self.client.set_terminated(self.run_id, status)
        storage.write_json(self.state, {**read_state(self.state), "status": status, **record})


def open_run(settings: Settings, state: Location, name: str, parent_id: Optional[str] = None,
             tags: Optional[Mapping[str, Any]] = None) -> TrackedRun:
    """The run recorded in `state` when it is on this store and not deleted, else a new one
    (a child of `parent_id` when given)."""
    client = make_client(settings)
    exp = experiment_id(settings)
    run = continued_run(client, settings, read_state(state))
    was_continued = run is not None
    if run is None:
        parent = {"mlflow.parentRunId": parent_id} if parent_id else {}
        run = client.create_run(exp, run_name=name, tags={"mlflow.runName": name, **parent})
    else:
        client.update_run(run.info.run_id, status="RUNNING")
    storage.write_json(state, dict(tracking_uri=settings.uri, experiment=settings.experiment,
                                   experiment_id=exp, run_id=run.info.run_id, run_name=name, status="RUNNING"))
    tracked = TrackedRun(settings, run.info.run_id, state, was_continued, client)
    if tags:
        tracked.set_tags(tags)
    return tracked


def continued_run(client, settings: Settings, record: dict):
    """The MLflow run `record` names, if this store has it (alive); None for a new one."""
    if not record.get("run_id"):
        return None
    if record.get("tracking_uri") != settings.uri:
        log.warning("tracking: this run was tracked at %s; starting a new MLflow run at %s",
                    record.get("tracking_uri"), settings.uri)
        return None
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(record["run_id"])
    except MlflowException:
        run = None
    if run is None or run.info.lifecycle_stage == "deleted":
        log.warning("tracking: MLflow run %s is gone from %s; starting a new one", record["run_id"],
                    settings.uri)
        return None
    return run


def read_state(state: Location) -> dict:
    try:
        return storage.read_json(state)
    except FileNotFoundError:
        return {}
    except (StorageError, ValueError) as e:
        raise UsageError(f"cannot read {state.uri}: {e}") from None
