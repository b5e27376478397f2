"""The raw-DDP baseline (ray_job.peers.raw_ddp) under `srun` on the real two-node SLURM test
cluster (tests/slurm_cluster.py): one task per node, env:// rendezvous from SLURM's variables
(SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, MASTER_ADDR from the first node's NodeAddr), gloo
between the nodes, a rank-0 checkpoint, and a second srun that resumes from it with --checkpoint.
Needs root and the SLURM packages; skipped otherwise.

    .venv/bin/python -m pytest -v tests/test_slurm_peer.py
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def peer_args(tmp_path: Path, *extra: str) -> str:
    args = [sys.executable, "-m", "ray_job.peers.raw_ddp", "--data", "synthetic", "--model", "resnet18",
            "--num-classes", "10", "--synthetic-train-size", "256", "--synthetic-test-size", "128",
            "--batch-size", "64", "--print-every", "2", "--checkpoint-dir", str(tmp_path / "ckpt"), *extra]
    return shlex.join(args)


@pytest.mark.timeout(300)
def test_raw_ddp_baseline_trains_across_two_nodes_under_srun_and_resumes(slurm_cluster, tmp_path):
    # Under netns each node has its own network namespace: the default MASTER_PORT (from the job
    # id) cannot meet anything else. On loopback the nodes share this host's ports: pick a free one.
    from ray_job.cluster.ports import free_port

    port = "" if slurm_cluster.network == "netns" else f"export MASTER_PORT={free_port()}\n"
    srun = "srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1"
    first_run = peer_args(tmp_path, "--epochs", "1", "--report-json", str(tmp_path / "first.json"))
    resumed = peer_args(tmp_path, "--epochs", "2", "--checkpoint", str(tmp_path / "ckpt" / "epoch_1"),
                        "--report-json", str(tmp_path / "second.json"))
    script = tmp_path / "peer.sh"
    script.write_text(f"#!/bin/bash\nset -euo pipefail\n{port}{srun} {first_run}\n{srun} {resumed}\n")
    env = {"PYTHONPATH": str(ROOT), **slurm_cluster.job_env()}  # job_env: gloo's interface in netns
    job = slurm_cluster.sbatch(["--nodes=2", "--ntasks=2", "--cpus-per-task=1", "--time=10",
                                f"--output={tmp_path}/job-%j.out", str(script)], cwd=tmp_path, env=env)
    info = slurm_cluster.wait_for_state(job, TERMINAL, timeout=240)
    output = (tmp_path / f"job-{job}.out").read_text(errors="replace")
    assert info["JobState"] == "COMPLETED", output[-3000:]
    assert info["NodeList"] == "node[1-2]"

    first = json.loads((tmp_path / "first.json").read_text())
    assert (first["launcher"], first["world_size"]) == ("srun", 2)
    assert [e["epoch"] for e in first["epochs"]] == [1]
    assert "raw_ddp: srun, world size 2, gloo" in output
    assert "Step [2/4]" in output and "data " in output and "train " in output  # the baseline's prints
    assert (tmp_path / "ckpt" / "epoch_1" / "checkpoint.pt").exists()

    second = json.loads((tmp_path / "second.json").read_text())
    assert second["start_epoch"] == 1 and [e["epoch"] for e in second["epochs"]] == [2]
    assert f"resumed from {tmp_path / 'ckpt' / 'epoch_1'}: 1 epoch(s) done" in output
    assert (tmp_path / "ckpt" / "epoch_2" / "checkpoint.pt").exists()
