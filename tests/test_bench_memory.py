"""`python -m ray_job bench memory` as a user runs it: the report has a row per strategy and rank,
fsdp holds half of ddp's model states per worker (as the memory plan says), the table is printed
and written beside the JSON, and bad input is one line with exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "ray_job", "bench", "memory", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


def test_fsdp_holds_half_of_ddps_model_states_on_every_rank(tmp_path):
    done = bench(tmp_path, "--model", "resnet18", "--workers", "2", "--steps", "2", "--batch-size", "4",
                 "--strategies", "ddp,fsdp", "--out", "out/mem.json")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "mem.json").read_text())
    rows = {(r["strategy"], r["rank"]): r for r in report["rows"]}
    assert sorted(rows) == [("ddp", 0), ("ddp", 1), ("fsdp", 0), ("fsdp", 1)]
    for rank in (0, 1):
        ddp, fsdp = rows["ddp", rank], rows["fsdp", rank]
        assert ddp["model_states"] == ddp["planned_states"]  # resnet18, sgd: 3 x 42.6 MiB
        assert fsdp["model_states"] <= ddp["model_states"] * 0.55
        assert fsdp["model_states_vs_ddp"] == pytest.approx(fsdp["model_states"] / ddp["model_states"])
        assert fsdp["peak_bytes"] > 0 and fsdp["images_per_s"] > 0
    table = (tmp_path / "out" / "mem.md").read_text()
    assert "| fsdp | 1 |" in table and table.strip() in done.stdout


@pytest.mark.parametrize("args, says", [
    (["--strategies", "ddp,zero"], "use a comma list of ddp, fsdp, hsdp"),
    (["--strategies", "hsdp", "--workers", "2"], "hsdp needs two or more whole nodes"),
    (["--steps", "1"], "--steps must be at least 2"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, says):
    done = bench(tmp_path, *args)
    assert done.returncode == 2 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1
