"""Per-epoch metrics, logged by Ray Train's controller: a `ray.train.UserCallback`, whose
`after_report` runs in the controller's process on the driver's node. The workers never talk to
MLflow, so on SLURM only the node of the driver needs to reach the tracking server.

Rank 0's report carries the epoch's global figures (EpochMetrics); each epoch is logged once (a
restarted worker group reports again the epochs after its checkpoint, an upload's report repeats
its epoch). The call is synchronous and short (no retries, 5 s timeout): when it returns, what it
logged is in the store, so the driver's catch-up at the end never logs an epoch twice.

A store that goes away never stops training: the first failure is one warning, the epochs wait here
and go with the next report that reaches the store ("catching up": every missed epoch is logged at
its own step and time); whatever is still missing when training ends, the driver logs from
metrics.jsonl.
"""

from __future__ import annotations

import logging
import time

from ray.train import UserCallback

from .epochs import is_epoch, metric_values
from .settings import QUICK, Settings, http_settings, make_client

log = logging.getLogger("ray_job.tracking")


class EpochLogger(UserCallback):
    """Logs each epoch result once to the MLflow run `run_id` (epochs up to `logged` are there)."""

    def __init__(self, settings: Settings, run_id: str, logged: int = 0):
        self.settings, self.run_id, self.logged = settings, run_id, logged
        self.pending: list[dict] = []
        self.failing = False
        self.spent_s = 0.0
        self._client = None

    def after_report(self, run_context, metrics, checkpoint) -> None:
        row = metrics[0] if metrics else {}  # rank 0's: the global figures
        if not is_epoch(row) or row["epoch"] <= self.logged:
            return
        if all(p["epoch"] != row["epoch"] for p in self.pending):
            self.pending.append(dict(row))
        self.flush()

    def flush(self) -> None:
        started = time.perf_counter()
        values = metric_values(self.pending, after=self.logged)
        try:
            if values:
                self.log(values)
        except Exception as e:  # any failure of the store: training goes on
            if not self.failing:
                log.warning("tracking: MLflow at %s failed (%s); training goes on, the epochs are kept and "
                            "logged once it answers again", self.settings.uri, " ".join(str(e).split())[:160])
            self.failing = True
            return
        finally:
            self.spent_s += time.perf_counter() - started
        if self.failing:
            log.warning("tracking: MLflow at %s answers again; logged the %d epoch(s) it missed",
                        self.settings.uri, len(self.pending))
        self.failing = False
        self.logged = max((step for *_, step in values), default=self.logged)
        self.pending.clear()
        log.info("tracking: epoch %d logged (%.3f s in MLflow calls so far)", self.logged, self.spent_s)

    def log(self, values: list) -> None:
        with http_settings(QUICK):
            if self._client is None:
                self._client = make_client(self.settings)  # the driver's credentials, in the controller
            from mlflow.entities import Metric

            self._client.log_batch(self.run_id, metrics=[Metric(*v) for v in values])

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_client": None}
