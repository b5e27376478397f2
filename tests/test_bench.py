"""`bench` at its smallest size: proves it runs end to end and reports what it claims (no timing
assertions: speed is measured by running the command, not by tests)."""

import json

import pytest

from conftest import run_cli


@pytest.mark.timeout(600)
def test_bench_smallest_size_writes_consistent_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli("bench", "--model", "resnet18", "--batch-size", "16", "--steps", "1",
                   "--warmup", "1", "--seed-steps", "1", "--matmul-size", "256", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    seed, entry = report["seed"], report["imagenet"]
    assert seed["batch"] == 128 and entry["fast"]["batch"] == 16
    for m in (seed, entry["fast"], entry["compute"], entry["ray"]):
        assert m["images_per_s"] > 0 and 0 <= m["data_share"] <= 1 and m["peak_host_mem_gib"] > 0
    assert entry["speedup_vs_seed"] == pytest.approx(entry["fast"]["images_per_s"] / seed["images_per_s"])
    assert entry["ray_vs_fast"] == pytest.approx(entry["ray"]["images_per_s"] / entry["fast"]["images_per_s"])
    assert "fast/seed" in proc.stdout and "ray/fast" in proc.stdout
    # the ceiling: the device's matmul peak, measured in the same run, and each row's share of it
    peak = report["ceiling"]["fp32"]
    assert peak > 0 and report["ceiling"]["matmul_n"] == 256
    for m in (seed, entry["fast"], entry["compute"], entry["ray"]):
        assert m["precision"] == "fp32" and m["flops_per_image"] > 0  # CPU: fp32
        assert m["achieved_flops"] == pytest.approx(m["images_per_s"] * m["flops_per_image"])
        assert m["flop_share"] == pytest.approx(m["achieved_flops"] / peak)
    assert seed["flops_per_image"] > entry["fast"]["flops_per_image"]  # the same net with a 1000-class head
    assert "device peak (dense 256x256 matmul" in proc.stdout and "of peak" in proc.stdout
