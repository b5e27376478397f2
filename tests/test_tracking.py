"""Experiment tracking with MLflow, against a real tracking server (`mlflow server` with basic auth,
tests/mlflow_server.py), everything read back with MlflowClient: what a 2-worker run logs; its
model loaded in a fresh Python without Ray; Ctrl-C + the same command continuing one MLflow run;
the server unreachable or refusing the credentials at start (exit 2 in seconds, no worker started)
and unreachable during training (training finishes, the epochs are caught up); no credentials in
files or logs; and that a run without --mlflow imports no MLflow. The local default (no server) and
a sweep's parent/child runs are in test_scale.py's sweep."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import (README_FILES, ROOT, TINY, Running, assert_refused_before_ray, events, one_error_line,
                      run_cli, strict_file, tiny_args, user_env)
from processes import Hold
from ray_job.config import parse_train_args
from ray_job.core.errors import UsageError

pytestmark = pytest.mark.timeout(900)  # the module's runs share the machine with other suites

EXPERIMENT, MODEL = "rj-tests", "rj-model"
# 1024 images: 16 steps per epoch; Ctrl-C while the run is held at epoch 2's first step (it stops a
# few steps later).
# Sharded (--strategy fsdp): the model logged and registered is read from the best checkpoint's
# shards on the driver, with no process group (the MLflow searches and sweeps train under ddp).
ARGS = ("train", *TINY, "--synthetic-train-size", "1024", "--num-workers", "2", "--epochs", "3", "--storage-path",
        "results", "--name", "tracked", "--strategy", "fsdp", "--mlflow", "--mlflow-experiment", EXPERIMENT,
        "--mlflow-register", MODEL)
NEW_RUN = re.compile(r"tracking: MLflow run (\w+) \(new\)")


def epochs(client, run_id: str, key: str = "train_loss") -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


@dataclass(frozen=True)
class Tracked:
    """One tracked run of a user, Ctrl-C'd after its first epoch and then run again to the end."""
    home: Path
    run_dir: Path
    run_id: str
    stopped_rc: int
    stopped: tuple        # (status, epochs in the store) after Ctrl-C
    out: str              # both commands' output


@pytest.fixture(scope="module")
def tracked(mlflow_server, ray_cluster, tmp_path_factory) -> Tracked:
    home = tmp_path_factory.mktemp("user")
    hold = Hold(tmp_path_factory.mktemp("hold")).at(2, 1)
    env = ray_cluster.user_env(**mlflow_server.env())
    client = mlflow_server.client()
    first = Running(*ARGS, cwd=home, env={**env, **hold.env})
    run_id = first.wait_for(lambda: NEW_RUN.search(first.out), timeout=300)[1]
    first.wait_for(lambda: hold.waits_at(2, 1), timeout=300)
    first.signal_group(signal.SIGINT)
    first.wait_for(lambda: "Ctrl-C: asked the workers to checkpoint and stop" in first.out, every=0.1)
    hold.release()
    rc = first.finish()
    stopped = client.get_run(run_id).info.status, epochs(client, run_id)
    again = run_cli(*ARGS, cwd=home, env=env)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    return Tracked(home, home / "results" / "tracked", run_id, rc, stopped, first.out + again.stdout + again.stderr)


def test_a_run_logs_params_epoch_metrics_tags_and_its_files(tracked, mlflow_server):
    client = mlflow_server.client()
    run = client.get_run(tracked.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["mlflow.runName"] == "tracked"
    p = run.data.params
    assert (p["world_size"], p["per_worker_batch"], p["global_batch"]) == ("2", "32", "64")
    assert p["model"] == "VisionTransformer"
    assert "64 split across 2 worker(s) = 32 per worker" in p["batch_rule"]
    assert p["mlflow_uri"] == mlflow_server.uri  # bare, as config.json has it
    # per epoch, step = epoch, each once, the values of metrics.jsonl
    rows = strict_file(tracked.run_dir / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    for key in ("train_loss", "train_acc", "test_loss", "test_acc", "images_per_s", "data_s", "compute_s",
                "lr", "peak_host_mem_gib", "world_size"):
        history = sorted(client.get_metric_history(tracked.run_id, key), key=lambda m: m.step)
        assert [(m.step, m.value) for m in history] == [(r["epoch"], pytest.approx(r[key])) for r in rows], key
        assert [m.timestamp for m in history] == [int(r["time"] * 1000) for r in rows]  # the epoch's own time
    tags = run.data.tags
    import ray
    import torch
    assert (tags["ray.version"], tags["torch.version"]) == (ray.__version__, torch.__version__)
    assert (tags["ray_job.nodes"], tags["ray_job.cluster_gpus"]) == ("1", "0")
    assert tags["ray_job.run_dir"] == str(tracked.run_dir) and "slurm.job_id" not in tags
    if os.path.isdir(os.path.join(ROOT, ".git")) or os.path.isfile(os.path.join(ROOT, ".git")):
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        assert tags["mlflow.source.git.commit"] == head.strip()
    assert sorted(a.path for a in client.list_artifacts(tracked.run_id)) == ["config.json", "metrics.csv",
                                                                             "summary.json"]
    local = client.download_artifacts(tracked.run_id, "summary.json", str(tracked.home / "dl"))
    assert json.load(open(local)) == strict_file(tracked.run_dir / "summary.json")
    record = strict_file(tracked.run_dir / "mlflow.json")
    assert (record["run_id"], record["status"], record["tracking_uri"]) == (tracked.run_id, "FINISHED",
                                                                           mlflow_server.uri)


def test_ctrl_c_and_the_same_command_continue_one_mlflow_run(tracked, mlflow_server):
    """Stopped after epoch 1: the MLflow run is KILLED with the epochs so far; the same command
    continues that run (not a new one) and adds the missing epochs, each once."""
    status, so_far = tracked.stopped
    assert tracked.stopped_rc == 130 and status == "KILLED" and so_far and so_far == list(range(1, len(so_far) + 1))
    assert len(so_far) < 3
    assert f"tracking: MLflow run {tracked.run_id} (continued from epoch {len(so_far)})" in tracked.out
    client = mlflow_server.client()
    assert epochs(client, tracked.run_id) == [1, 2, 3]
    exp = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([exp.experiment_id], "tags.mlflow.runName = 'tracked'")
    assert [r.info.run_id for r in runs] == [tracked.run_id]


# A fresh Python that imports neither Ray nor ray_job: the model as a user loads it elsewhere.
LOAD_AND_SCORE = """
import sys, numpy as np, mlflow.pytorch, torch
uri, data = sys.argv[1], np.load(sys.argv[2])
model = mlflow.pytorch.load_model(uri)
x = torch.from_numpy(data["images"]).permute(0, 3, 1, 2).float() / 255  # NHWC uint8 -> NCHW [0, 1]
with torch.no_grad():
    acc = (model(x).argmax(1) == torch.from_numpy(data["labels"])).float().mean().item()
assert not [m for m in sys.modules if m.split(".")[0] in ("ray", "ray_job")]
print(acc)
"""


def test_the_logged_model_loads_without_ray_and_scores_the_runs_test_accuracy(tracked, mlflow_server, tmp_path):
    import numpy as np

    from ray_job.data.synthetic import make_synthetic

    tags = mlflow_server.client().get_run(tracked.run_id).data.tags
    summary = strict_file(tracked.run_dir / "summary.json")
    assert tags["ray_job.model_checkpoint"] == summary["best_checkpoint"]
    test = make_synthetic(256, 0, train=False)  # the run's test split: --synthetic-test-size 256, --seed 0
    np.savez(tmp_path / "test.npz", images=test.images.numpy(), labels=test.labels.numpy())
    env = {**user_env(**mlflow_server.env(uri=mlflow_server.reader_uri)), "PYTHONPATH": ""}
    for uri in (tags["ray_job.model_uri"], f"models:/{MODEL}/1"):  # as logged, and as registered
        proc = subprocess.run([sys.executable, "-c", LOAD_AND_SCORE, uri, str(tmp_path / "test.npz")],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        acc = float(proc.stdout.split()[-1])
        assert acc == pytest.approx(summary["best_test_acc"], abs=1.01 / 256), uri  # one image at most
        assert acc > 0.3  # it learned: 10 classes


def test_no_credentials_in_files_or_output(tracked, mlflow_server):
    secret = mlflow_server.password.encode()
    assert secret not in tracked.out.encode()
    for folder, _, files in os.walk(tracked.home):
        for name in files:
            assert secret not in Path(folder, name).read_bytes(), os.path.join(folder, name)
    assert strict_file(tracked.run_dir / "config.json")["mlflow_uri"] == mlflow_server.uri


def test_an_unreachable_or_refusing_server_at_start_is_exit_2_before_ray(mlflow_server, tmp_path):
    """Nothing listening on the port, then a wrong password: one error line each, exit 2, before
    Ray starts (the config is not even printed), nothing written."""
    from mlflow_server import free_port

    nowhere = f"http://127.0.0.1:{free_port(2)}"
    cases = [(user_env(**mlflow_server.env(uri=nowhere)), f"cannot reach the MLflow tracking server at {nowhere}"),
             (user_env(**mlflow_server.env(MLFLOW_TRACKING_PASSWORD="not-the-password-42")),
              "refused the credentials")]
    for env, expected in cases:
        proc = run_cli("train", *tiny_args(tmp_path, "nope", "--mlflow"), env=env, timeout=120)
        assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
        line = one_error_line(proc.stderr)
        print(f"\n{line}")
        assert expected in line and "MLFLOW_TRACKING" in line
        assert "not-the-password-42" not in proc.stdout + proc.stderr
        assert_refused_before_ray(proc)
        assert not (tmp_path / "results" / "nope").exists()


def test_a_server_unreachable_during_training_costs_one_warning_and_the_epochs_catch_up(
        mlflow_server, ray_cluster, tmp_path):
    """The server goes away after epoch 1 and comes back a moment later: training never stops,
    the run folder is complete, one warning, and every epoch reaches the store once."""
    from mlflow_server import Gate

    gate = Gate(mlflow_server.port)
    client = mlflow_server.client()
    env = ray_cluster.user_env(**mlflow_server.env(uri=gate.uri))
    args = tiny_args(tmp_path, "outage", "--num-workers", "1", "--epochs", "3", "--mlflow",
                     "--mlflow-experiment", EXPERIMENT)
    run_dir = tmp_path / "results" / "outage"
    hold = Hold(tmp_path).at(2, 1)  # epochs 2 and 3 still to come when the server goes away
    run = Running("train", *args, env={**env, **hold.env})
    try:
        run_id = run.wait_for(lambda: NEW_RUN.search(run.out), timeout=300)[1]
        run.wait_for(lambda: hold.waits_at(2, 1) and events(run_dir, "checkpoint_saved"), timeout=300)
        # epoch 1's checkpoint, written, is reported with its metrics (to MLflow) at the next poll (step 5)
        hold.at(2, 6)
        run.wait_for(lambda: hold.waits_at(2, 6) and epochs(client, run_id), timeout=300, every=0.5)
        gate.close()
        hold.release()
        run.wait_for(lambda: "training goes on" in run.out, timeout=300)
        gate.open()
        assert run.finish() == 0, run.out[-4000:]
    finally:
        gate.close()
    failed = [line for line in run.out.splitlines() if "tracking: MLflow at" in line and "failed" in line]
    assert len(failed) == 1, run.out[-4000:]
    assert "answers again" in run.out or "caught up" in run.out, run.out[-4000:]
    print("\n" + "\n".join(line for line in run.out.splitlines() if "tracking:" in line))
    assert all((run_dir / name).exists() for name in README_FILES)
    assert [r["epoch"] for r in strict_file(run_dir / "metrics.jsonl")] == [1, 2, 3]
    assert epochs(client, run_id) == [1, 2, 3]
    assert client.get_run(run_id).info.status == "FINISHED"


# --- without a server -------------------------------------------------------------------------

NO_MLFLOW = """
import sys
from ray_job.commands import main  # noqa: F401 (the dispatcher and everything it imports)
from ray_job.config import parse_train_args
from ray_job.scale import sweep  # noqa: F401
from ray_job.train import driver, tracked, worker  # noqa: F401
cfg = driver.preflight(parse_train_args(["--data", "synthetic", "--storage-path", sys.argv[1]]))
assert tracked.start(cfg) is None and tracked.open_parent(cfg, sys.argv[1], "x", {}) is None
tracked.complete_finished(cfg)
loaded = [m for m in sys.modules if m.split(".")[0] == "mlflow" or m.startswith("ray_job.tracking.")
          and m.split(".")[2] not in ("check", "settings")]
assert not loaded, loaded
"""


def test_training_without_mlflow_imports_no_mlflow(tmp_path):
    proc = subprocess.run([sys.executable, "-c", NO_MLFLOW, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=user_env())
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_credentials_never_go_into_the_flag_or_the_config(monkeypatch):
    with pytest.raises(UsageError) as e:
        parse_train_args(["--mlflow", "--mlflow-uri", "https://bob:hunter22@mlflow.example:5000"])
    assert "hunter22" not in str(e.value) and "bob" not in str(e.value)
    assert "https://mlflow.example:5000" in str(e.value) and "MLFLOW_TRACKING_PASSWORD" in str(e.value)
    named = parse_train_args(["--mlflow-uri", "http://h:5000"])  # a store named: tracking on
    assert named.mlflow and named.mlflow_uri == "http://h:5000"
    with pytest.raises(UsageError, match="--mlflow-register needs --mlflow"):
        parse_train_args(["--mlflow-register", "m"])
    # MLflow's own variable may carry them: moved into MLflow's credential variables, the URI bare
    from ray_job.tracking.settings import Settings, resolve_uri
    env = {"MLFLOW_TRACKING_URI": "http://bob:hunter22@h:5000"}
    cfg = resolve_uri(parse_train_args(["--mlflow"]), env)
    assert cfg.mlflow_uri == "http://h:5000" and "hunter22" not in cfg.to_json()
    assert (env["MLFLOW_TRACKING_USERNAME"], env["MLFLOW_TRACKING_PASSWORD"]) == ("bob", "hunter22")
    settings = Settings.of(cfg, env)
    assert "hunter22" not in repr(settings) and settings.credentials["MLFLOW_TRACKING_PASSWORD"] == "hunter22"


def test_the_local_default_and_object_storage(tmp_path):
    from ray_job.tracking.settings import Settings, resolve_uri

    cfg = resolve_uri(parse_train_args(["--mlflow", "--storage-path", str(tmp_path)]), {})
    assert cfg.mlflow_uri == f"sqlite:///{tmp_path}/mlflow.db"
    assert Settings.of(cfg, {}).artifact_location == f"{tmp_path}/mlartifacts"
    with pytest.raises(UsageError, match="needs a tracking server: give --mlflow-uri"):
        resolve_uri(parse_train_args(["--mlflow", "--storage-path", "s3://b/runs"]), {})
    s3 = resolve_uri(parse_train_args(["--mlflow", "--storage-path", "s3://b/runs"]), {"MLFLOW_TRACKING_URI": "http://h"})
    assert s3.mlflow_uri == "http://h"


def test_each_epoch_result_becomes_metrics_once_at_its_step():
    from ray_job.tracking.epochs import metric_values

    epoch = dict(epoch=2, epochs=3, train_loss=0.5, test_acc=0.75, lr=0.1, time=100.0, world_size=2,
                 train_images=512, peak_gpu_mem_gib=None, steady_images_per_s=float("nan"))
    rows = [dict(epoch=1, step=3, preempted=True, test_acc=-1.0),  # a timed checkpoint's report
            epoch, dict(epoch), dict(epoch, epoch=3, train_loss=0.4)]
    values = metric_values(rows, after=0)
    assert sorted(v for v in values if v[3] == 2) == [("lr", 0.1, 100000, 2), ("test_acc", 0.75, 100000, 2),
                                                      ("train_loss", 0.5, 100000, 2), ("world_size", 2.0, 100000, 2)]
    assert {v[3] for v in values} == {2, 3} and not metric_values(rows, after=3)


def test_the_slurm_plan_passes_the_tracking_flags_through():
    from ray_job.cluster.slurm import Allocation
    from ray_job.commands.slurm_plan import plan_driver

    alloc = Allocation.from_env({"SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": "/tmp"})
    plan = plan_driver(["--mlflow", "--mlflow-uri", "http://mlflow.site:5000", "--mlflow-experiment", "e"], alloc)
    assert plan.args[-5:] == ("--mlflow", "--mlflow-uri", "http://mlflow.site:5000", "--mlflow-experiment", "e")
    with pytest.raises(UsageError):  # refused before the script logs the driver's flags
        plan_driver(["--mlflow", "--mlflow-uri", "http://u:pw@mlflow.site:5000"], alloc)
