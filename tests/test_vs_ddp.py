"""Side by side with the raw-DDP baseline, at tiny sizes: the peer (ray_job.peers.raw_ddp) under
torchrun, `bench vs-ddp`, the FLOP counter and the time-to-accuracy race (`bench race`). No timing assertions:
speed is measured by running the command (README), not by tests. The srun test of the peer is
tests/test_slurm_peer.py."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from torch import nn

from conftest import ROOT, run_cli
from ray_job.bench.common import flop_share, flops_per_image, matmul_flops, torchrun_cmd

TINY_PEER = ["--data", "synthetic", "--model", "resnet18", "--num-classes", "10", "--synthetic-train-size",
             "256", "--synthetic-test-size", "128", "--batch-size", "64", "--print-every", "2"]


def torchrun(workers: int, *args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(torchrun_cmd(workers, *args), cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


# --- the ceiling ---------------------------------------------------------------------------------

def test_flop_counter_gives_the_hand_count_of_a_tiny_model():
    # 3x8x8 image -> 3x3 conv to 4 channels (no bias) -> linear 256 -> 10 (no bias); FLOPs = 2 x MACs.
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.Flatten(), nn.Linear(256, 10, bias=False))
    conv, linear = 2 * (4 * 8 * 8) * (3 * 3 * 3), 2 * 256 * 10
    flops = flops_per_image(model, (3, 8, 8), batch=3)
    assert flops["forward"] == conv + linear
    # backward: the conv's weight gradient only (its input needs none), the linear's input and weight
    assert flops["train_step"] == (conv + linear) + conv + 2 * linear


def test_flop_share_is_achieved_over_the_measured_peak():
    peak = matmul_flops(torch.device("cpu"), torch.float32, 128, repeats=2)
    assert peak > 1e8  # any CPU does 0.1 GFLOP/s
    share = flop_share(100.0, 2e9, peak, devices=2)
    assert share["achieved_flops"] == 2e11 and share["flop_share"] == pytest.approx(2e11 / (2 * peak))
    assert flop_share(None, 2e9, peak) == {"achieved_flops": None, "flop_share": None}


# --- the peer --------------------------------------------------------------------------------

def test_peer_reads_torchrun_and_srun_variables_and_not_a_batch_script():
    from ray_job.peers.raw_ddp import dist_env, slurm_master

    torchrun_env = dist_env({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "SLURM_PROCID": "0",
                             "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0"})  # torchrun inside a SLURM job
    assert (torchrun_env.rank, torchrun_env.world, torchrun_env.local_rank, torchrun_env.launcher) == \
        (1, 4, 1, "torchrun")
    srun = dist_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0"})
    assert (srun.rank, srun.world, srun.local_rank, srun.launcher) == (3, 4, 1, "srun")
    # the batch script itself has SLURM_PROCID=0 and SLURM_NTASKS=N but is no task of a job step
    assert dist_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}).launcher == "single"
    assert slurm_master({"MASTER_ADDR": "10.0.0.5", "SLURM_JOB_ID": "1234"}) == ("10.0.0.5", "21234")


@pytest.mark.timeout(300)
def test_peer_under_torchrun_trains_checkpoints_and_resumes(tmp_path):
    first = torchrun(2, "ray_job.peers.raw_ddp", *TINY_PEER, "--epochs", "1", "--report-json", "first.json",
                     cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    report = json.loads((tmp_path / "first.json").read_text())
    assert (report["launcher"], report["world_size"]) == ("torchrun", 2)
    assert "raw_ddp: torchrun, world size 2, gloo" in first.stdout
    assert "Epoch [1/1], Step [2/4], Loss:" in first.stdout and " ms, train " in first.stdout
    checkpoint = tmp_path / "checkpoints" / "epoch_1"  # relative --checkpoint-dir: the caller's folder
    assert (checkpoint / "checkpoint.pt").exists()

    second = torchrun(2, "ray_job.peers.raw_ddp", *TINY_PEER, "--epochs", "2", "--checkpoint",
                      "checkpoints/epoch_1", "--report-json", "second.json", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {checkpoint}: 1 epoch(s) done" in second.stdout
    resumed = json.loads((tmp_path / "second.json").read_text())
    assert resumed["start_epoch"] == 1 and [e["epoch"] for e in resumed["epochs"]] == [2]
    saved = torch.load(tmp_path / "checkpoints" / "epoch_2" / "checkpoint.pt", weights_only=False)
    assert saved["epoch"] == 2 and not any(k.startswith("module.") for k in saved["model"])


# --- bench --vs-ddp --------------------------------------------------------------------------

@pytest.mark.ray
@pytest.mark.timeout(600)
def test_bench_vs_ddp_two_workers_reports_every_figure_and_ratio(ray_cluster, tmp_path):
    out = tmp_path / "vs.json"
    proc = run_cli("bench", "vs-ddp", "--workers", "2", "--model", "resnet18", "--batch-size", "16",
                   "--steps", "1", "--warmup", "1", "--matmul-size", "256", "--out", str(out),
                   env=ray_cluster.user_env())  # its Ray runs join the session's head
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["errors"] == {} and r["ceiling"]["fp32"] > 0 and r["flops_per_image"]["train_step"] > 0
    assert set(r["runs"]) == {"torchrun_baseline", "ray_baseline", "torchrun_ours", "ray_ours"}
    for key, run in r["runs"].items():
        assert (run["launcher"], run["loop"]) == tuple(key.split("_")), key
        assert run["world_size"] == 2 and run["global_batch"] == 16 and run["batch_per_process"] == 8
        assert run["images_per_s"] > 0 and 0 < run["launch_to_first_step_s"] < 300
        assert len(run["peak_host_mem_gib_per_process"]) == 2 and run["peak_host_mem_gib"] > 0.1
        assert run["achieved_flops"] == pytest.approx(run["images_per_s"] * r["flops_per_image"]["train_step"])
        assert run["flop_share"] == pytest.approx(run["achieved_flops"] / r["ceiling"]["fp32"])
        assert set(run["split_ms"]) == {"data", "fwd_bwd", "optim"} and 0 <= run["other_cpu_share"] <= 1
    runs, ratios = r["runs"], r["ratios"]
    for loop in ("baseline", "ours"):
        assert ratios["ray_vs_torchrun"][loop] == pytest.approx(
            runs[f"ray_{loop}"]["images_per_s"] / runs[f"torchrun_{loop}"]["images_per_s"])
    for launcher in ("torchrun", "ray"):
        assert ratios["ours_vs_baseline"][launcher] == pytest.approx(
            runs[f"{launcher}_ours"]["images_per_s"] / runs[f"{launcher}_baseline"]["images_per_s"])
    assert "ray/torchrun (same loop)" in proc.stdout and "ours/the baseline's loop" in proc.stdout
    assert "load average" in proc.stdout and "of peak" in proc.stdout and "other CPU" in proc.stdout


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_bench_to_accuracy_tiny_stops_both_recipes_at_a_reachable_accuracy(ray_cluster, tmp_path):
    out = tmp_path / "race.json"
    proc = run_cli("bench", "race", "--target", "0.3", "--budget-s", "150", "--workers", "2",
                   "--model", "resnet18", "--synthetic-train-size", "512", "--synthetic-test-size", "256",
                   "--ours-flags", "--epochs 2 --batch-size 128 --warmup-epochs 0.5", "--out", str(out),
                   env=ray_cluster.user_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    for key, launcher in (("baseline", "torchrun"), ("ours", "ray")):
        x = r[key]
        assert x["launcher"] == launcher and x["reached"] and x["stopped"] in ("target", "epochs"), x
        hit = next(h for h in x["history"] if h["test_acc"] >= 0.3)
        assert x["time_to_target_s"] == hit["t_s"] and 0 < x["time_to_target_s"] <= x["wall_s"]
        assert 0 < x["train_time_to_target_s"] < x["time_to_target_s"]
        assert all(h["test_acc"] < 0.3 for h in x["history"][:x["history"].index(hit)])
    assert r["baseline"]["stopped"] == "target" and r["baseline"]["final_acc"] >= 0.3  # the peer stopped itself
    c = r["comparison"]
    assert c["reference_acc"] == 0.3
    ours_s, baseline_s = r["ours"]["time_to_target_s"], r["baseline"]["time_to_target_s"]
    assert c["ours_vs_baseline_time"] == pytest.approx(ours_s / baseline_s)
    assert "ours/baseline" in proc.stdout and "to target s" in proc.stdout
    assert len(list((out.parent).glob("bench_to_accuracy_*/baseline_checkpoints/epoch_*"))) == 1


@pytest.mark.parametrize("argv, words", [
    (["race", "--target", "1.5"], "between 0 and 1"),
    (["race", "--budget-s", "0"], "--budget-s must be positive"),
    (["vs-ddp", "--repeats", "0"], "--repeats >= 1"),
    (["step", "--steps", "-1"], "must not be negative"),
    (["sprint"], "unknown bench command"),
    (["vs-ddp", "--to-accuracy", "0.5"], "unrecognized arguments"),
])
def test_bad_bench_flags_are_usage_errors(argv, words):
    from ray_job.bench import main
    from ray_job.core.errors import UsageError

    with pytest.raises(UsageError, match=words):
        main(argv)
