"""The scaling sweep on a real local Ray cluster (1 and 2 CPU workers, gloo, tiny model); its stop
request, report and strict JSON without Ray; its flags and default name."""

import contextlib
import csv
import json
import math
import os
import signal
import time

import pytest

from conftest import TINY
from ray_job.train import stop
from ray_job.config import parse_train_args
from ray_job.core.errors import UsageError
from ray_job.core.exits import ExitCode
from ray_job.model.parts import gradient_bytes
from ray_job.model import zoo
from ray_job.scale import COLUMNS, main, parse_args
from ray_job.scale.sweep import measure_all
from ray_job.scale.report import write_outputs

pytestmark = pytest.mark.timeout(600)

# 1024 images so that weak scaling with 2 workers still has 6 steps of 64 per worker.
SWEEP = [*TINY, "--synthetic-train-size", "1024", "--steps-per-epoch", "6", "--no-gpu"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --- the sweep, for real -----------------------------------------------------------------------

@pytest.mark.ray
def test_sweep_strong_and_weak_on_one_and_two_workers(ray_joined, tmp_path, capsys):
    """One sweep (3 runs: the shared 1-worker run, strong 2, weak 2; 4 workers cannot fit), tracked
    in MLflow's local default (no server): a parent run, one child per point."""
    out = tmp_path / "results" / "sweep"
    argv = ["--workers", "1,2,4", "--mode", "both", *SWEEP, "--storage-path",
            str(tmp_path / "results"), "--name", "sweep", "--mlflow"]
    assert main(argv) == 0
    printed = capsys.readouterr().out

    sweep = strict_json((out / "scaling.json").read_text())
    rows = sweep["rows"]
    assert [(r["mode"], r["workers"], r["status"]) for r in rows] == [
        ("strong", 1, "ok"), ("strong", 2, "ok"), ("strong", 4, "skipped"),
        ("weak", 1, "ok"), ("weak", 2, "ok"), ("weak", 4, "skipped")]
    for r in rows:
        if r["status"] == "skipped":
            assert "cannot fit" in r["reason"] and r["speedup"] is None
    ok = {(r["mode"], r["workers"]): r for r in rows if r["status"] == "ok"}
    assert ok["strong", 1]["run"] == ok["weak", 1]["run"] == "w1"  # the same job in both modes
    assert (ok["strong", 2]["global_batch"], ok["strong", 2]["per_worker_batch"]) == (64, 32)
    assert (ok["weak", 2]["global_batch"], ok["weak", 2]["per_worker_batch"]) == (128, 64)
    grads = gradient_bytes(zoo.build(parse_train_args(SWEEP), 10))
    for (mode, n), r in ok.items():
        assert r["steps"] == 6 and r["grad_bytes"] == grads
        assert r["wall_s"] > r["time_to_first_step_s"] > 0 and r["train_s"] > 0
        base = ok[mode, 1]["steady_images_per_s"]
        assert r["speedup"] == pytest.approx(r["steady_images_per_s"] / base)
        assert r["efficiency"] == pytest.approx(r["speedup"] / n)
        assert r["step_s"] == pytest.approx(r["global_batch"] / r["steady_images_per_s"])
        assert min(r["data_s_per_step"], r["compute_s_per_step"], r["optim_s_per_step"]) >= 0
        assert (r["comm_wait_s_per_step"] == 0) if n == 1 else (r["comm_wait_s_per_step"] >= 0)
        assert (out / r["run"] / "summary.json").exists()
        assert strict_json((out / r["run"] / "config.json").read_text())["measure_comm_wait"]  # the sweep asks

    _assert_csv_matches_json(out / "scaling.csv", rows)
    _assert_valid_png(out / "scaling.png")
    table = (out / "scaling.md").read_text()
    for mode in ("strong", "weak"):
        for n in (1, 2):
            assert f"| {mode} | {n} | " in table
        assert f"| {mode} | 4 | skipped |" in table
    assert "cannot fit" in table and table.strip() in printed
    assert sorted(sweep["columns"]) == sorted(COLUMNS)  # every column explained
    _assert_every_json_is_strict(out)
    tracked = _assert_tracked_as_parent_and_children(tmp_path / "results")

    # The same command again (a requeued SLURM job): finished points are reused, nothing retrains.
    assert main(argv) == 0
    again = strict_json((out / "scaling.json").read_text())["rows"]
    assert [r["reason"].startswith("reused") for r in again if r["status"] == "ok"] == [True] * 4
    assert [r["step_s"] for r in again] == [r["step_s"] for r in rows]
    assert _assert_tracked_as_parent_and_children(tmp_path / "results") == tracked  # the same runs, none new
    assert main([*argv, "--mode", "weak", "--workers", "1"]) == 0  # w1 serves either mode
    with pytest.raises(UsageError, match="other flags"):
        main([*argv, "--seed", "1"])
    capsys.readouterr()


def _assert_tracked_as_parent_and_children(storage_path) -> dict:
    """--mlflow without a URI: sqlite:///<storage-path>/mlflow.db; the sweep is a parent run with its
    scaling files, each point that ran a child with its epoch; the runs by name."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{storage_path}/mlflow.db")
    runs = {r.data.tags["mlflow.runName"]: r
            for r in client.search_runs([client.get_experiment_by_name("ray_job").experiment_id])}
    assert sorted(runs) == ["strong_w2", "sweep", "w1", "weak_w2"]  # 4 workers never ran: no run
    parent = runs["sweep"]
    assert parent.info.status == "FINISHED" and parent.data.params["workers"] == "(1, 2, 4)"
    assert sorted(a.path for a in client.list_artifacts(parent.info.run_id)) == [
        "scaling.csv", "scaling.json", "scaling.md", "scaling.png"]
    for name in ("w1", "strong_w2", "weak_w2"):
        child = runs[name]
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id and child.info.status == "FINISHED"
        assert [m.step for m in client.get_metric_history(child.info.run_id, "steady_images_per_s")] == [1]
    return {name: r.info.run_id for name, r in runs.items()}


def _reject_constant(name):
    raise AssertionError(f"not strict JSON: {name}")


def strict_json(text):
    """json.loads that refuses NaN and Infinity, as any JSON parser other than Python's does."""
    return json.loads(text, parse_constant=_reject_constant)


# Ray Train's own bookkeeping in a run folder: not ours to write, so not checked.
RAY_TRAIN_FILES = {"checkpoint_manager_snapshot.json"}


def _assert_every_json_is_strict(sweep_dir):
    """Every .json and every line of every .jsonl in the sweep folder and its point folders."""
    checked = set()
    for folder, _, files in os.walk(sweep_dir):
        for name in set(files) - RAY_TRAIN_FILES:
            path = os.path.join(folder, name)
            if name.endswith(".json"):
                strict_json(open(path).read())
            elif name.endswith(".jsonl"):
                for line in open(path):
                    if line.strip():
                        strict_json(line)
            else:
                continue
            checked.add(os.path.relpath(path, sweep_dir))
    for run in ("w1", "strong_w2", "weak_w2"):
        assert {f"{run}/config.json", f"{run}/summary.json", f"{run}/metrics.jsonl",
                f"{run}/events.jsonl"} <= checked
    assert "scaling.json" in checked


def _assert_csv_matches_json(path, rows):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        csv_rows = list(reader)
    assert len(csv_rows) == len(rows)
    for c, j in zip(csv_rows, rows):
        for key in COLUMNS:
            if j[key] is None:
                assert c[key] == "", key
            elif isinstance(j[key], (int, float)):
                assert float(c[key]) == j[key], key
            else:
                assert c[key] == j[key], key


def _assert_valid_png(path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_MAGIC
    height, width, _ = matplotlib.image.imread(str(path)).shape
    assert width > 800 and height > 300


def test_stop_request_stops_the_sweep_between_and_during_points(tmp_path):
    sweep_dir, point_dir = tmp_path / "sweep", tmp_path / "sweep" / "strong_w2"
    point_dir.mkdir(parents=True)
    stop.request(str(sweep_dir))
    with stop.forward(str(sweep_dir), str(point_dir)):  # the running point is told too
        deadline = time.time() + 10
        while not stop.requested(str(point_dir)) and time.time() < deadline:
            time.sleep(0.1)
    assert stop.requested(str(point_dir))
    _, cfg = parse_args([*SWEEP, "--storage-path", str(tmp_path), "--name", "sweep"])
    rows = measure_all(cfg, str(sweep_dir), ["strong", "weak"], [1, 2])
    assert [(r["mode"], r["workers"], r["status"]) for r in rows] == [
        ("strong", 1, "not run"), ("strong", 2, "not run"), ("weak", 1, "not run"),
        ("weak", 2, "not run")]


@pytest.mark.parametrize("train_takes_sigusr1", [False, True])
def test_sigusr1_to_the_driver_stops_the_sweep(tmp_path, monkeypatch, capsys, train_takes_sigusr1):
    """SLURM's pre-timeout signal, sent to the sweep's driver during the first point: that point
    checkpoints and stops, the others are not run, the report is still written, the exit code says
    "requeue me". `train` installs its own SIGUSR1 handler for its run (True) or not (False).

    Ray is not needed: `train` is replaced by a stand-in that waits for its stop request."""
    from ray_job.scale import sweep

    points = []

    def fake_training(point, parent_id=None):
        points.append(point)
        os.makedirs(point.run_dir(), exist_ok=True)
        with contextlib.ExitStack() as stack:
            if train_takes_sigusr1:  # as train.driver.run_training does, for its own run
                stack.enter_context(stop.stop_on_signals(point.run_dir()))
            os.kill(os.getpid(), signal.SIGUSR1)
            deadline = time.time() + 10
            while not stop.requested(point.run_dir()) and time.time() < deadline:
                time.sleep(0.05)
        return ExitCode.STOPPED if stop.requested(point.run_dir()) else 0

    monkeypatch.setattr(sweep, "connect", lambda cfg: None)
    monkeypatch.setattr(sweep, "cluster_info", lambda: dict(nodes=1, cpus=2, gpus=0))
    monkeypatch.setattr(sweep, "run_training", fake_training)
    monkeypatch.chdir(tmp_path)
    previous = signal.getsignal(signal.SIGUSR1)
    (tmp_path / "results" / "s").mkdir(parents=True)
    stop.request(str(tmp_path / "results" / "s"))  # left by the previous job: cleared at start
    rc = main(["--workers", "1,2", *TINY, "--storage-path", "results", "--name", "s"])
    # the sweep's request reached the point (forwarded, or the point's own handler wrote it)
    assert stop.requested(str(tmp_path / "results" / "s" / "w1"))
    assert signal.getsignal(signal.SIGUSR1) is previous  # the sweep gives the signal back
    capsys.readouterr()
    assert rc == ExitCode.STOPPED and len(points) == 1
    # Paths resolved once against the user's directory, the GPU decided once, before any point.
    assert points[0].storage_path == str(tmp_path / "results" / "s")
    assert points[0].data_dir == str(tmp_path / "data") and points[0].use_gpu is False
    saved = strict_json((tmp_path / "results" / "s" / "scaling.json").read_text())
    assert [(r["mode"], r["workers"], r["status"]) for r in saved["rows"]] == [
        ("strong", 1, "preempted"), ("strong", 2, "not run"), ("weak", 1, "preempted"),
        ("weak", 2, "not run")]
    assert saved["sweep_dir"] == str(tmp_path / "results" / "s")
    _assert_valid_png(tmp_path / "results" / "s" / "scaling.png")


def test_report_writes_strict_json_and_shows_missing_values_as_empty(tmp_path):
    """A NaN (or None) among the measurements is null in scaling.json, an empty cell in the CSV
    and the Markdown table, and no point in the plot."""
    blank = dict.fromkeys(COLUMNS)
    base = {**blank, "mode": "strong", "workers": 1, "status": "ok", "reason": "", "run": "w1",
            "global_batch": 64, "per_worker_batch": 64, "steps": 6, "wall_s": 12.0,
            "time_to_first_step_s": math.nan, "train_s": 3.0, "images_per_s": 128.0,
            "steady_images_per_s": 130.0, "step_s": 64 / 130, "data_s_per_step": 0.01,
            "compute_s_per_step": 0.4, "comm_wait_s_per_step": 0.0, "optim_s_per_step": 0.02,
            "speedup": 1.0, "efficiency": 1.0, "grad_bytes": 1000}
    no_base = {**base, "mode": "weak", "workers": 2, "run": "weak_w2", "speedup": None,
               "efficiency": math.nan, "comm_wait_s_per_step": None}
    skipped = {**blank, "mode": "strong", "workers": 4, "status": "skipped", "run": "strong_w4",
               "reason": "--num-workers 4 cannot fit"}
    sweep = dict(sweep="s", sweep_dir=str(tmp_path), date="today", host="here", command="scale",
                 cluster=dict(nodes=1, cpus=2.0, gpus=0.0, driver_host_load_1min=[math.nan, 0.5]),
                 config={}, rows=[base, skipped, no_base])
    table = write_outputs(sweep)

    saved = strict_json((tmp_path / "scaling.json").read_text())
    assert saved["rows"][0]["time_to_first_step_s"] is None and saved["rows"][2]["efficiency"] is None
    assert saved["cluster"]["driver_host_load_1min"] == [None, 0.5]
    assert sorted(saved["columns"]) == sorted(COLUMNS) and all(saved["columns"].values())
    _assert_csv_matches_json(tmp_path / "scaling.csv", saved["rows"])
    assert "| strong | 1 | 64 | 6 | 3.0 | 12.0 |  | 130 | 492.3 |" in table  # no 1st step time
    assert "| weak | 2 | 64 | 6 | 3.0 | 12.0 |  | 130 | 492.3 | 10.0 | 400.0 |  | 20.0 |  |  |" in table
    assert "| strong | 4 | skipped |" in table and "load ? at start, 0.5 at end" in table
    assert (tmp_path / "scaling.md").read_text() == table + "\n"
    _assert_valid_png(tmp_path / "scaling.png")


# --- the command line --------------------------------------------------------------------------

@pytest.mark.parametrize("argv, words", [
    (["--workers", "0,2"], "positive"),
    (["--workers", "one"], "comma-separated"),
    (["--step-ms", "10"], "unrecognized arguments: --step-ms"),
    (["sweep", "--from", "x.json"], "unrecognized arguments: --from"),
    (["predict", "--workers", "2"], "unknown scale command"),
])
def test_bad_scale_flags_are_usage_errors(argv, words):
    with pytest.raises(UsageError, match=words):
        main(argv)


def test_scale_defaults_and_passthrough_flags():
    ns, cfg = parse_args(["--address", "10.0.0.1:6379", "--batch-size", "256", "--workers", "4,1,2"])
    assert cfg.address == "10.0.0.1:6379" and cfg.batch_size == 256  # as the SLURM script passes it
    assert ns.workers == (1, 2, 4) and ns.counts == [1, 2, 4] and ns.modes == ["strong", "weak"]
    assert (cfg.epochs, cfg.steps_per_epoch, cfg.sync_timing) == (1, 50, True)  # fixed work
    # Named after what the points compute, as `train` names a run: the same command, the same sweep
    # (its finished points reused); other work, another sweep. Where it joins is not part of it.
    assert cfg.name.startswith("scale_cifar10_resnet50_")
    assert parse_args(["--batch-size", "256", "--workers", "1,2"])[1].name == cfg.name
    assert parse_args(["--batch-size", "256", "--seed", "1"])[1].name != cfg.name
    assert parse_args(["--batch-size", "256", "--steps-per-epoch", "7"])[1].name != cfg.name
    _, cfg = parse_args(["--recipe", "fast", "--steps-per-epoch", "7"])
    assert (cfg.epochs, cfg.steps_per_epoch, cfg.batch_size) == (1, 7, 1024)


def test_a_folder_is_reused_only_for_the_same_work(tmp_path):
    """One rule for a sweep's point and a search's trial (driver.make_way): a finished run is reused
    when only what changes no result differs (where Ray is, how often to checkpoint, the name, the
    storage path, what --data does not read); other flags are refused for a point and moved aside
    for a trial; an unfinished point is moved aside (its timings must cover the whole run)."""
    import dataclasses
    import json

    from ray_job.config import TrainConfig
    from ray_job.train.driver import make_way

    cfg = TrainConfig(data="synthetic", epochs=1, storage_path=str(tmp_path), name="p")
    run = tmp_path / "p"
    run.mkdir()
    saved = dataclasses.replace(cfg, address="10.0.0.1:6379", checkpoint_every_min=5.0, data_dir="/elsewhere",
                                storage_path="/old/place", name="q")
    (run / "config.json").write_text(json.dumps(saved.to_dict()))
    (run / "summary.json").write_text(json.dumps(dict(finished=True, epochs_completed=1)))
    assert make_way(cfg, resume=False, refuse_other=True) is True
    assert make_way(cfg, resume=True, refuse_other=False) is True
    other = dataclasses.replace(cfg, seed=1)
    with pytest.raises(UsageError, match="other flags"):
        make_way(other, resume=False, refuse_other=True)
    assert run.exists()
    assert make_way(other, resume=True, refuse_other=False) is False and not run.exists()
    assert [p.name.split("-")[0] for p in tmp_path.iterdir()] == ["p.other"]
    run.mkdir()
    (run / "events.jsonl").write_text("{}\n")  # stopped before its config: unfinished
    assert make_way(cfg, resume=True, refuse_other=False) is False and run.exists()  # a trial resumes
    assert make_way(cfg, resume=False, refuse_other=True) is False and not run.exists()  # a point reruns
    assert sorted(p.name.split("-")[0] for p in tmp_path.iterdir()) == ["p.interrupted", "p.other"]
