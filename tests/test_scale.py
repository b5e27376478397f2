"""The scaling sweep on a real local Ray cluster (1 and 2 CPU workers, gloo, tiny model); its stop
request, report and strict JSON without Ray; `scale predict` in a fresh interpreter that must not import
Ray; the package's import layers; and the communication model on paper."""

import contextlib
import csv
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, TINY
from ray_job.train import stop
from ray_job.core.errors import UsageError
from ray_job.core.exits import ExitCode
from ray_job.model.resnet import build_model, gradient_bytes
from ray_job.scale import COLUMNS, commmodel, main, measure_all, parse_args
from ray_job.scale.commmodel import Link, StepProfile, predict, ring_allreduce_s
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
    grads = gradient_bytes(build_model("resnet18", "imagenet", 10))
    for (mode, n), r in ok.items():
        assert r["steps"] == 6 and r["grad_bytes"] == grads
        assert r["wall_s"] > r["time_to_first_step_s"] > 0 and r["train_s"] > 0
        base = ok[mode, 1]["steady_images_per_s"]
        assert r["speedup"] == pytest.approx(r["steady_images_per_s"] / base)
        assert r["efficiency"] == pytest.approx(r["speedup"] / n)
        assert r["step_s"] == pytest.approx(r["global_batch"] / r["steady_images_per_s"])
        assert min(r["data_s_per_step"], r["compute_s_per_step"], r["optim_s_per_step"]) >= 0
        assert (r["comm_wait_s_per_step"] == 0) if n == 1 else (r["comm_wait_s_per_step"] >= 0)
        assert r["pred_step_s"] > 0 and 0 < r["pred_efficiency"] <= 1
        assert (out / r["run"] / "summary.json").exists()
    # The model is calibrated on the 1-worker run, so it reproduces that point exactly.
    assert ok["strong", 1]["pred_step_error_pct"] == pytest.approx(0, abs=1e-6)
    assert sweep["model"]["link"]["name"] == "loopback"  # auto: one node, gloo
    assert sweep["model"]["overlap"] is False  # auto: CPU workers compute and reduce on one core
    assert ok["weak", 2]["pred_comm_s"] > 0
    assert ok["weak", 2]["pred_exposed_comm_s"] == pytest.approx(ok["weak", 2]["pred_comm_s"])

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

    # The sweep on paper, from this sweep's single-worker measurement (no training).
    assert main(["predict", "--from", str(out / "scaling.json"), "--workers", "2,8",
                 "--link", "10gbe"]) == 0
    projected = capsys.readouterr().out
    assert "1-worker run w1" in projected and "10gbe" in projected
    assert [l.split()[:2] for l in projected.splitlines() if l.strip().startswith(("strong", "weak"))] \
        == [["strong", "1"], ["strong", "2"], ["strong", "8"], ["weak", "1"], ["weak", "2"], ["weak", "8"]]


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
    _, cfg, _ = parse_args([*SWEEP, "--storage-path", str(tmp_path), "--name", "sweep"], "sweep")
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
    assert saved["model"]["profile"] is None and saved["sweep_dir"] == str(tmp_path / "results" / "s")
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
            "speedup": 1.0, "efficiency": 1.0, "grad_bytes": 1000, "pred_step_s": 64 / 130,
            "pred_efficiency": 1.0, "pred_step_error_pct": 0.0}
    no_base = {**base, "mode": "weak", "workers": 2, "run": "weak_w2", "speedup": None,
               "efficiency": math.nan, "comm_wait_s_per_step": None, "pred_step_s": None,
               "pred_efficiency": None, "pred_step_error_pct": None}
    skipped = {**blank, "mode": "strong", "workers": 4, "status": "skipped", "run": "strong_w4",
               "reason": "--num-workers 4 cannot fit"}
    sweep = dict(sweep="s", sweep_dir=str(tmp_path), date="today", host="here", command="scale",
                 cluster=dict(nodes=1, cpus=2.0, gpus=0.0, driver_host_load_1min=[math.nan, 0.5]),
                 config={}, rows=[base, skipped, no_base],
                 model=dict(link=vars(commmodel.make_link("loopback")), overlap=False, profile=None))
    table = write_outputs(sweep)

    saved = strict_json((tmp_path / "scaling.json").read_text())
    assert saved["rows"][0]["time_to_first_step_s"] is None and saved["rows"][2]["efficiency"] is None
    assert saved["cluster"]["driver_host_load_1min"] == [None, 0.5]
    assert sorted(saved["columns"]) == sorted(COLUMNS) and all(saved["columns"].values())
    _assert_csv_matches_json(tmp_path / "scaling.csv", saved["rows"])
    assert "| strong | 1 | 64 | 6 | 3.0 | 12.0 |  | 130 | 492.3 |" in table  # no 1st step time
    assert "| weak | 2 | 64 | 6 | 3.0 | 12.0 |  | 130 | 492.3 | 10.0 | 400.0 |  | 20.0 |" \
           "  |  |  |  |  |  |" in table
    assert "| strong | 4 | skipped |" in table and "load ? at start, 0.5 at end" in table
    assert (tmp_path / "scaling.md").read_text() == table + "\n"
    _assert_valid_png(tmp_path / "scaling.png")


# --- the command line --------------------------------------------------------------------------

# Run in a fresh interpreter: every import of Ray, and of the parts that start it, is recorded.
NO_RAY = """
import sys
FORBIDDEN = ("ray_job.train.driver", "ray_job.train.worker", "ray_job.scale.sweep")
def forbidden(name):
    return name == "ray" or name.startswith("ray.") or name in FORBIDDEN
class Watch:
    tried = []
    def find_spec(self, name, path=None, target=None):
        if forbidden(name):
            self.tried.append(name)
        return None
sys.meta_path.insert(0, Watch())
from ray_job.commands import main
rc = main(["scale", *sys.argv[1:]])
loaded = [m for m in sys.modules if forbidden(m)]
assert not Watch.tried and not loaded, f"scale predict imported {Watch.tried or loaded}"
sys.exit(rc)
"""


def test_predict_runs_on_paper_without_ray():
    """`python -m ray_job scale predict` neither imports Ray nor tries to."""
    proc = subprocess.run([sys.executable, "-c", NO_RAY, "predict", "--workers", "8,16,32,64",
                           "--link", "ib"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [l.split() for l in proc.stdout.splitlines() if l.strip().startswith(("strong", "weak"))]
    assert [(l[0], int(l[1])) for l in lines] == [(m, n) for m in ("strong", "weak")
                                                 for n in (1, 8, 16, 32, 64)]
    assert "ib: 400 Gbit/s" in proc.stdout and "94.1 MB (resnet50 fp32)" in proc.stdout
    for l in lines:  # overlap never makes a step slower
        assert float(l[5]) <= float(l[4]) and float(l[7]) >= float(l[6])


def test_predict_from_a_saved_sweep_without_ray(tmp_path):
    """--from a scaling.json: the single-worker step and gradient bytes come from the sweep."""
    profile = StepProfile(batch=64, data_s=0.001, fwd_bwd_s=0.1, optim_s=0.01, grad_bytes=2_000_000,
                          source="1-worker run w1: steady step 111.0 ms at batch 64")
    (tmp_path / "scaling.json").write_text(json.dumps(
        dict(config=dict(batch_size=64, grad_compression="none"), model=dict(profile=profile.to_dict()))))
    proc = subprocess.run([sys.executable, "-c", NO_RAY, "predict", "--from", str(tmp_path),
                           "--workers", "2", "--link", "10gbe", "--mode", "weak"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "1-worker run w1" in proc.stdout and "2.0 MB (the sweep's model, fp32)" in proc.stdout
    weak2 = next(l.split() for l in proc.stdout.splitlines() if l.split()[:2] == ["weak", "2"])
    expected = predict(profile, commmodel.make_link("10gbe"), 2, "weak", 64, overlap=False)
    assert float(weak2[4]) == pytest.approx(expected.step_s * 1e3, abs=0.01)


@pytest.mark.parametrize("argv, words", [
    (["--workers", "0,2"], "positive"),
    (["--workers", "one"], "comma-separated"),
    (["--step-ms", "10"], "unrecognized arguments: --step-ms"),
    (["predict", "--link", "carrier-pigeon"], "unknown link"),
    (["predict", "--link", "custom", "--bandwidth-gbps", "5"], "--latency-us"),
    (["predict", "--model", "resnet18"], "--step-ms"),
    (["predict", "--from", "/nonexistent/scaling.json"], "cannot read"),
    (["sweep", "--from", "x.json"], "unrecognized arguments: --from"),
    (["predic", "--workers", "2"], "unknown scale command"),
])
def test_bad_scale_flags_are_usage_errors(argv, words):
    with pytest.raises(UsageError, match=words):
        main(argv)


def test_scale_defaults_and_passthrough_flags():
    ns, cfg, _ = parse_args(["--address", "10.0.0.1:6379", "--batch-size", "256", "--workers", "4,1,2"], "sweep")
    assert cfg.address == "10.0.0.1:6379" and cfg.batch_size == 256  # as the SLURM script passes it
    assert ns.workers == (1, 2, 4) and ns.counts == [1, 2, 4] and ns.modes == ["strong", "weak"]
    assert (cfg.epochs, cfg.steps_per_epoch, cfg.sync_timing) == (1, 50, True)  # fixed work
    assert cfg.name.startswith("scale_")
    _, cfg, _ = parse_args(["--recipe", "fast", "--steps-per-epoch", "7"], "sweep")
    assert (cfg.epochs, cfg.steps_per_epoch, cfg.batch_size) == (1, 7, 1024)


# --- the communication model -------------------------------------------------------------------

GIGABYTE_LINK = Link("test", bandwidth_gbps=8, latency_us=10)  # 1e9 bytes/s


def test_ring_allreduce_known_numbers():
    assert ring_allreduce_s(1e9, 1, GIGABYTE_LINK) == 0.0
    # 2(N-1)/N * S/B + buckets * 2(N-1) * latency
    assert ring_allreduce_s(1e9, 4, GIGABYTE_LINK) == pytest.approx(1.5 + 6 * 10e-6)
    assert ring_allreduce_s(1e9, 4, GIGABYTE_LINK, buckets=3) == pytest.approx(1.5 + 18 * 10e-6)
    assert ring_allreduce_s(1e9, 2, GIGABYTE_LINK) == pytest.approx(1.0 + 2 * 10e-6)


def test_prediction_known_numbers_with_and_without_overlap():
    profile = StepProfile(batch=100, data_s=0.0, fwd_bwd_s=0.3, optim_s=0.0, grad_bytes=10**9,
                          bucket_bytes=10**9)
    link = Link("test", 8, 0)
    plain = predict(profile, link, 2, "strong", 100, overlap=False)
    # Each worker does half the batch (0.15 s) and all-reduces 1 GB at 1 GB/s over 2 ranks (1 s).
    assert (plain.per_worker_batch, plain.global_batch) == (50, 100)
    assert plain.comm_s == pytest.approx(1.0) and plain.step_s == pytest.approx(1.15)
    assert plain.speedup == pytest.approx(0.3 / 1.15) and plain.efficiency == pytest.approx(0.3 / 2.3)
    over = predict(profile, link, 2, "strong", 100, overlap=True)
    hidden = commmodel.BACKWARD_FRACTION * 0.15
    assert over.exposed_comm_s == pytest.approx(1.0 - hidden)
    assert over.step_s == pytest.approx(1.15 - hidden)
    weak = predict(profile, link, 2, "weak", 100, overlap=False)
    assert weak.global_batch == 200 and weak.speedup == pytest.approx(2 * 0.3 / 1.3)
    one = predict(profile, link, 1, "strong", 100)
    assert (one.comm_s, one.speedup, one.efficiency) == (0.0, 1.0, 1.0)
    assert predict(profile, link, 128, "strong", 100) is None  # under one image per worker


def test_model_monotonic_and_overlap_never_worse():
    profile = StepProfile(batch=128, data_s=0.001, fwd_bwd_s=0.02, optim_s=0.002,
                          grad_bytes=94_000_000)
    counts = [1, 2, 4, 8, 16, 32, 64]
    for link in commmodel.LINKS.values():
        comm = [ring_allreduce_s(profile.grad_bytes, n, link) for n in counts]
        assert comm == sorted(comm)
        for mode in ("strong", "weak"):
            for overlap in (False, True):
                eff = [predict(profile, link, n, mode, 128, overlap).efficiency for n in counts]
                assert all(a >= b - 1e-12 for a, b in zip(eff, eff[1:])), (link.name, mode, overlap)
                assert eff[0] == pytest.approx(1.0) and all(0 < e <= 1 + 1e-12 for e in eff)
            for n in counts:
                a = predict(profile, link, n, mode, 128, overlap=False)
                b = predict(profile, link, n, mode, 128, overlap=True)
                assert b.step_s <= a.step_s and b.efficiency >= a.efficiency
    # Faster links never hurt; bf16 gradients (half the bytes) never hurt.
    slow, fast = commmodel.make_link("10gbe"), commmodel.make_link("ib")
    half = StepProfile(**{**profile.to_dict(), "grad_bytes": profile.grad_bytes // 2})
    for n in counts[1:]:
        assert predict(profile, fast, n, "weak", 128).step_s < predict(profile, slow, n, "weak", 128).step_s
        assert predict(half, slow, n, "weak", 128).step_s < predict(profile, slow, n, "weak", 128).step_s


def test_links_presets_and_overrides():
    for link in commmodel.LINKS.values():
        assert link.bandwidth_gbps > 0 and link.latency_us > 0 and link.note
    assert commmodel.make_link("ib").bytes_per_s == 50e9
    custom = commmodel.make_link("custom", 25, 7)
    assert (custom.bandwidth_gbps, custom.latency_us) == (25, 7)
    over = commmodel.make_link("100gbe", latency_us=2)
    assert (over.bandwidth_gbps, over.latency_us, over.name) == (100, 2, "100gbe*")
    with pytest.raises(ValueError):
        commmodel.make_link("custom", 25)
    assert math.isclose(commmodel.BACKWARD_FRACTION, 2 / 3)
