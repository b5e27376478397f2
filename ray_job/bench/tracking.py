"""`python -m ray_job bench tracking`: what experiment tracking (--mlflow) costs, in seconds.

Times the calls a tracked run makes, with the code `train` runs, against a store: the driver's
preflight (the store reached, the experiment found) and start (the run opened, params and tags),
the controller's per-epoch call (`EpochLogger.after_report` with an epoch's real set of figures:
what each epoch costs), and the driver's end (files, the best checkpoint's model, the status). The
per-epoch call runs on Ray Train's controller, beside the training: the workers wait for it only
when it takes longer than an epoch. Default store: the local default (SQLite in a temporary folder).

    python -m ray_job bench tracking --epochs 30
    MLFLOW_TRACKING_USERNAME=... python -m ray_job bench tracking --mlflow-uri http://127.0.0.1:5000
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time

from ..config import RESNETS, TrainConfig
from ..core.errors import UsageError
from ..core.flags import option
from .common import machine, timed


@dataclasses.dataclass(frozen=True)
class TrackingBenchConfig:
    mlflow_uri: str = option("", "the store (http(s)://... or sqlite:///...); default: the local default in a "
                             "temporary folder")
    epochs: int = option(30, "epochs logged (one call each)")
    model: str = option("resnet50", "the model logged at the end", choices=RESNETS)
    out: str = option("results/bench_tracking.json", "where the JSON report goes")

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise UsageError("--epochs must be at least 1")


def epoch_row(epoch: int, epochs: int) -> dict:
    """An epoch's report as rank 0 sends it (EpochMetrics' fields, CPU run)."""
    from ..train.metrics import EpochMetrics

    return EpochMetrics(epoch=epoch, epochs=epochs, train_loss=1.0 / epoch, train_acc=0.5, test_loss=1.1,
                        test_acc=0.6, train_images=50000, test_images=10000, epoch_s=60.0, train_s=55.0,
                        eval_s=5.0, images_per_s=900.0, data_s=1.0, compute_s=54.0, fwd_bwd_s=50.0,
                        optim_s=4.0, steps=390, lr=0.1, world_size=2, time=time.time(),
                        peak_host_mem_gib=3.1, grad_bytes=94_000_000, steady_images_per_s=910.0).to_dict()


def main(cfg: TrackingBenchConfig) -> dict:
    from .. import tracking
    from ..tracking.callback import EpochLogger
    from ..train import tracked

    with tempfile.TemporaryDirectory(prefix="rj_bench_tracking_") as tmp:
        run = TrainConfig(data="synthetic", model=cfg.model, storage_path=tmp, name="bench", num_workers=2,
                          epochs=cfg.epochs, mlflow=True, mlflow_uri=cfg.mlflow_uri,
                          mlflow_experiment="ray_job-bench")
        preflight, run = timed(tracking.check, run)
        start, started = timed(tracked.start, run)
        logger = EpochLogger(started.run.settings, started.run_id)
        per_epoch = [timed(logger.after_report, None, [epoch_row(e, cfg.epochs)] * 2, None)[0]
                     for e in range(1, cfg.epochs + 1)]
        write_run_files(run)
        end, _ = timed(started.finish, 0)
    report = dict(kind="tracking", date=time.strftime("%Y-%m-%d %H:%M:%S %z"), device=machine(False),
                  store=run.mlflow_uri if cfg.mlflow_uri else "sqlite:///<tmp>/mlflow.db (local default)",
                  config=dataclasses.asdict(cfg), preflight_s=preflight, start_s=start,
                  first_epoch_s=per_epoch[0], epoch_median_s=statistics.median(per_epoch[1:] or per_epoch),
                  epoch_max_s=max(per_epoch), end_s=end, load_avg=list(os.getloadavg()))
    print(f"bench tracking {report['date']} on {report['device']}, store {report['store']}, load average "
          f"{report['load_avg'][0]:.2f}:\n  preflight {preflight:.2f} s, start {start:.2f} s; per epoch "
          f"{report['epoch_median_s'] * 1e3:.1f} ms median, {report['epoch_max_s'] * 1e3:.1f} ms max (the "
          f"first {per_epoch[0] * 1e3:.1f} ms); end {end:.2f} s (3 files + the {cfg.model} model)")
    return report


def write_run_files(cfg: TrainConfig) -> None:
    """What the driver finds at the end: a real checkpoint of the model and the run's files."""
    import torch

    from ..model.parts import build_model
    from ..storage import at, write_json
    from ..train.checkpoint import save_checkpoint
    from ..train.runfiles import CONFIG_JSON, METRICS_CSV, METRICS_JSONL, SUMMARY_JSON

    run_dir = at(cfg.run_dir())
    model = build_model(cfg.model, cfg.stem, 10)
    folder = os.path.join(cfg.run_dir(), "checkpoint_bench")
    save_checkpoint(folder, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), epoch=1, step=0,
                    config=cfg.to_dict(), metrics={})
    write_json(run_dir.join(CONFIG_JSON), cfg.to_dict())
    write_json(run_dir.join(SUMMARY_JSON), dict(best_checkpoint=folder, best_test_acc=0.6))
    run_dir.join(METRICS_JSONL).write_text("")
    run_dir.join(METRICS_CSV).write_text("epoch\n")
