"""`bench` at its smallest size: proves it runs end to end and reports what it claims (no timing
assertions: speed is measured by running the command, not by tests)."""

import json

import pytest

from conftest import run_cli


@pytest.mark.timeout(600)
def test_bench_smallest_size_writes_consistent_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli("bench", "--model", "resnet18", "--batch-size", "16", "--steps", "1",
                   "--warmup", "1", "--seed-steps", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    seed, entry = report["seed"], report["imagenet"]
    assert seed["batch"] == 128 and entry["fast"]["batch"] == 16
    for m in (seed, entry["fast"], entry["compute"], entry["ray"]):
        assert m["images_per_s"] > 0 and 0 <= m["data_share"] <= 1 and m["peak_host_mem_gib"] > 0
    assert entry["speedup_vs_seed"] == pytest.approx(entry["fast"]["images_per_s"] / seed["images_per_s"])
    assert entry["ray_vs_fast"] == pytest.approx(entry["ray"]["images_per_s"] / entry["fast"]["images_per_s"])
    assert "fast/seed" in proc.stdout and "ray/fast" in proc.stdout
