"""`bench` at its smallest size: proves it runs end to end and reports what it claims (no timing
assertions: speed is measured by running the command, not by tests)."""

import json

import pytest

from conftest import run_cli


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_bench_smallest_size_writes_consistent_json(ray_cluster, tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli("bench", "step", "--model", "resnet18", "--batch-size", "16", "--steps", "1",
                   "--warmup", "1", "--baseline-steps", "1", "--matmul-size", "256", "--out", str(out),
                   env=ray_cluster.user_env())  # its Ray run joins the session's head
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    baseline, entry = report["baseline"], report["imagenet"]
    assert baseline["batch"] == 128 and entry["fast"]["batch"] == 16
    for m in (baseline, entry["fast"], entry["compute"], entry["ray"]):
        assert m["images_per_s"] > 0 and 0 <= m["data_share"] <= 1 and m["peak_host_mem_gib"] > 0
    # what the table prints is what the report file holds
    for name, m in (("raw-DDP baseline (fp32, PIL)", baseline), ("imagenet stem: fast", entry["fast"]),
                    ("imagenet stem: compute", entry["compute"]), ("imagenet stem: ray", entry["ray"])):
        (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith(name)]
        batch, images_per_s = line[len(name):].split()[:2]
        assert int(batch) == m["batch"] and float(images_per_s) == pytest.approx(m["images_per_s"], abs=0.051), line
    # the ceiling: the device's matmul peak, measured in the same run, and each row's share of it
    peak = report["ceiling"]["fp32"]
    assert peak > 0 and report["ceiling"]["matmul_n"] == 256
    for m in (baseline, entry["fast"], entry["compute"], entry["ray"]):
        assert m["precision"] == "fp32" and m["flops_per_image"] > 0  # CPU: fp32
        assert m["achieved_flops"] > 0 and m["flop_share"] > 0
    assert baseline["flops_per_image"] > entry["fast"]["flops_per_image"]  # the same net with a 1000-class head
    assert "device peak (dense 256x256 matmul" in proc.stdout


@pytest.mark.timeout(600)
def test_bench_data_path_smallest_size_reports_every_path_and_the_memory_rows(tmp_path):
    out = tmp_path / "bench_data.json"
    proc = run_cli("bench", "data-path", "--generate", "300", "--images", "512",
                   "--batch-size", "64", "--image-size", "48", "--loader-workers", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    paths = report["paths"]
    assert set(paths) == {"in-memory uint8 (32 px)", "prepared raw, mmap (32 px)", "prepared JPEG -> 48 px"}
    for m in paths.values():
        assert m["images"] > 0 and m["images_per_s"] > 0 and m["anon_peak_mib"] > 0
    assert paths["prepared JPEG -> 48 px"]["loader_workers"] == 1
    assert paths["prepared JPEG -> 48 px"]["loader_workers_anon_mib"] > 0  # its worker was measured
    rows = {(r["kind"], r["dataset_x"], r["world"]): r for r in report["memory"]}
    assert set(rows) == {(k, x, w) for k, x in (("in-memory", 1), ("prepared", 1), ("prepared", 4))
                         for w in (1, 2)}
    assert rows["prepared", 4, 1]["dataset_mib"] == pytest.approx(4 * rows["prepared", 1, 1]["dataset_mib"])
    assert all(len(r["anon_mib"]) == r["world"] and min(r["anon_mib"]) > 0 for r in rows.values())
    assert "prepared / in-memory:" in proc.stdout and "a 4x dataset changes RssAnon by" in proc.stdout


@pytest.mark.timeout(600)
def test_bench_checkpoints_smallest_size_compares_the_three_modes_and_leaves_nothing(tmp_path):
    """From a user's folder with a relative --storage: the three modes, every checkpoint of sync and
    async saved and (async) reported, the table printed, and the storage folder empty afterwards."""
    proc = run_cli("bench", "checkpoints", "--model", "resnet18", "--stem", "cifar", "--batch-size", "8",
                   "--steps", "6", "--warmup", "1", "--every", "3", "--repeats", "1", "--storage", "ckpts",
                   "--out", "bench_checkpoints.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench_checkpoints.json").read_text())
    runs = {r["mode"]: r for r in report["runs"]}
    assert set(runs) == {"none", "sync", "async"} and {r["storage"] for r in runs.values()} == {"ckpts"}
    assert runs["none"]["checkpoints"] == 0 and runs["none"]["vs_none"] == 1
    for mode in ("sync", "async"):
        r = runs[mode]
        assert r["steps"] == 6 and r["checkpoints"] == 2 and r["checkpoint_mib"] > 10  # resnet18 + momentum
        assert r["cpu_s"] > 0  # the writer's own CPU time, from the checkpoint_saved events
    assert all(0 <= r["other_cpu_share"] <= 1 for r in runs.values())
    assert runs["async"]["reports"] == 2
    # A stall is the checkpoint steps' time over the median step's: on a loaded machine it can come
    # out at or below 0 (sync's was -0.12 s once), and then there is nothing to compare against.
    sync_stall = runs["sync"]["stall_s"]
    for mode in ("sync", "async"):
        if sync_stall > 0:
            assert runs[mode]["stall_vs_sync"] == pytest.approx(runs[mode]["stall_s"] / sync_stall)
        else:
            assert runs[mode]["stall_vs_sync"] is None
    # the table: one row per mode, showing the report's figures
    table = {cells[1]: cells for cells in map(str.split, proc.stdout.splitlines())
             if len(cells) == 11 and cells[0] == "ckpts"}
    assert set(table) == set(runs), proc.stdout
    for mode, cells in table.items():
        assert float(cells[2]) == pytest.approx(runs[mode]["images_per_s"], abs=0.051), cells
        assert int(cells[9]) == runs[mode]["checkpoints"], cells
    assert list((tmp_path / "ckpts").iterdir()) == []
