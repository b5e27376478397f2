"""The scaling sweep on a real local Ray cluster (1 and 2 CPU workers, gloo, tiny model), and the
communication model on paper."""

import csv
import json
import math
import subprocess
import sys
import time

import pytest

from conftest import ROOT, TINY
from ray_job import commmodel
from ray_job.commmodel import Link, StepProfile, predict, ring_allreduce_s
from ray_job.config import PREEMPT_FILE, UsageError
from ray_job.model import build_model, gradient_bytes
from ray_job.scale import COLUMNS, forward_preempt, main, measure_all, parse_args

pytestmark = pytest.mark.timeout(600)

# 1024 images so that weak scaling with 2 workers still has 6 steps of 64 per worker.
SWEEP = [*TINY, "--synthetic-train-size", "1024", "--steps-per-epoch", "6", "--no-gpu"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --- the sweep, for real -----------------------------------------------------------------------

def test_sweep_strong_and_weak_on_one_and_two_workers(ray_local, tmp_path, capsys):
    """One sweep (3 runs: the shared 1-worker run, strong 2, weak 2; 4 workers cannot fit)."""
    out = tmp_path / "results" / "sweep"
    argv = ["--workers", "1,2,4", "--mode", "both", *SWEEP, "--storage-path",
            str(tmp_path / "results"), "--name", "sweep"]
    assert main(argv) == 0
    printed = capsys.readouterr().out

    sweep = json.loads((out / "scaling.json").read_text())
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

    # The same command again (a requeued SLURM job): finished points are reused, nothing retrains.
    assert main(argv) == 0
    again = json.loads((out / "scaling.json").read_text())["rows"]
    assert [r["reason"].startswith("reused") for r in again if r["status"] == "ok"] == [True] * 4
    assert [r["step_s"] for r in again] == [r["step_s"] for r in rows]
    assert main([*argv, "--mode", "weak", "--workers", "1"]) == 0  # w1 serves either mode
    with pytest.raises(UsageError, match="other flags"):
        main([*argv, "--seed", "1"])
    capsys.readouterr()

    # The sweep on paper, from this sweep's single-worker measurement (no training).
    assert main(["--predict", "--from", str(out / "scaling.json"), "--workers", "2,8",
                 "--link", "10gbe"]) == 0
    projected = capsys.readouterr().out
    assert "1-worker run w1" in projected and "10gbe" in projected
    assert [l.split()[:2] for l in projected.splitlines() if l.strip().startswith(("strong", "weak"))] \
        == [["strong", "1"], ["strong", "2"], ["strong", "8"], ["weak", "1"], ["weak", "2"], ["weak", "8"]]


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


def test_preemption_request_stops_the_sweep_between_and_during_points(tmp_path):
    sweep_dir, point_dir = tmp_path / "sweep", tmp_path / "sweep" / "strong_w2"
    point_dir.mkdir(parents=True)
    (sweep_dir / PREEMPT_FILE).write_text("1")
    with forward_preempt(str(sweep_dir), str(point_dir)):  # the running point is told too
        deadline = time.time() + 10
        while not (point_dir / PREEMPT_FILE).exists() and time.time() < deadline:
            time.sleep(0.1)
    assert (point_dir / PREEMPT_FILE).exists()
    _, cfg, _ = parse_args([*SWEEP, "--storage-path", str(tmp_path), "--name", "sweep"])
    rows = measure_all(cfg, str(sweep_dir), ["strong", "weak"], [1, 2])
    assert [(r["mode"], r["workers"], r["status"]) for r in rows] == [
        ("strong", 1, "not run"), ("strong", 2, "not run"), ("weak", 1, "not run"),
        ("weak", 2, "not run")]


# --- the command line --------------------------------------------------------------------------

def test_predict_runs_on_paper_without_ray():
    code = ("import sys; from ray_job.scale import main; "
            "rc = main(['--predict', '--workers', '8,16,32,64', '--link', 'ib']); "
            "assert 'ray' not in sys.modules, 'imported ray'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [l.split() for l in proc.stdout.splitlines() if l.strip().startswith(("strong", "weak"))]
    assert [(l[0], int(l[1])) for l in lines] == [(m, n) for m in ("strong", "weak")
                                                 for n in (1, 8, 16, 32, 64)]
    assert "ib: 400 Gbit/s" in proc.stdout and "94.1 MB (resnet50 fp32)" in proc.stdout
    for l in lines:  # overlap never makes a step slower
        assert float(l[5]) <= float(l[4]) and float(l[7]) >= float(l[6])


@pytest.mark.parametrize("argv, words", [
    (["--workers", "0,2"], "positive"),
    (["--workers", "one"], "comma-separated"),
    (["--step-ms", "10"], "add --predict"),
    (["--predict", "--link", "carrier-pigeon"], "unknown link"),
    (["--predict", "--link", "custom", "--bandwidth-gbps", "5"], "--latency-us"),
    (["--predict", "--model", "resnet18"], "--step-ms"),
    (["--predict", "--from", "/nonexistent/scaling.json"], "cannot read"),
])
def test_bad_scale_flags_are_usage_errors(argv, words):
    with pytest.raises(UsageError, match=words):
        main(argv)


def test_scale_defaults_and_passthrough_flags():
    ns, cfg, _ = parse_args(["--address", "10.0.0.1:6379", "--batch-size", "256", "--workers", "4,1,2"])
    assert cfg.address == "10.0.0.1:6379" and cfg.batch_size == 256  # as the SLURM script passes it
    assert ns.workers == [1, 2, 4] and ns.mode == "both"
    assert (cfg.epochs, cfg.steps_per_epoch, cfg.sync_timing) == (1, 50, True)  # fixed work
    assert cfg.name.startswith("scale_")
    _, cfg, _ = parse_args(["--recipe", "fast", "--steps-per-epoch", "7"])
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
