"""Sharded training from the user's seat (docs/sharded.md): the memory plan refuses ddp where the model
states cannot fit a worker and names what would; `--strategy fsdp` on 2 workers, Ctrl-C, and the same
command on 1 worker continues at the saved step from the 2 ranks' shards; `export` reads the sharded
checkpoint with no cluster. On the session's Ray head; tiny runs."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

from conftest import Running, events, one_error_line, run_cli, strict_file

pytestmark = pytest.mark.timeout(900)

# resnet18 (ImageNet stem, 10 classes) holds 11,181,642 parameters: 42.7 MiB of them, as much again
# of gradients and of SGD's momentum. 0.1 GB a worker does not hold ddp's 128 MiB; fsdp over 2
# workers (64 MiB) fits.
RUN = ["train", "--data", "synthetic", "--synthetic-train-size", "512", "--synthetic-test-size", "128",
       "--model", "resnet18", "--stem", "imagenet", "--batch-size", "64", "--epochs", "2", "--log-every", "2",
       "--storage-path", "results", "--name", "big"]
SMALL = ["--memory-per-worker-gb", "0.1"]


def test_memory_plan_refuses_ddp_then_fsdp_stops_on_ctrl_c_and_continues_on_one_worker(user_dir, ray_cluster):
    """No step races the run: --epochs 2 leaves an epoch after the one interrupted, so a stop asked
    anywhere in epoch 1 (even after its last poll: then at its end) stops the run instead of
    finishing it."""
    env = ray_cluster.user_env()
    run_dir = user_dir / "results" / "big"
    refused = run_cli(*RUN, "--num-workers", "2", *SMALL, cwd=user_dir, env=env)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    line = one_error_line(refused.stderr)
    assert re.search(r"--strategy ddp needs [\d.]+ MiB .* per worker", line), line
    assert "--strategy fsdp over 2 workers needs" in line, line
    assert not run_dir.exists() and "Epoch [" not in refused.stdout  # nothing written, no worker started

    first = Running(*RUN, "--num-workers", "2", "--strategy", "fsdp", *SMALL, cwd=user_dir, env=env)
    first.wait_for(lambda: "Epoch [1/2], Step [" in first.out, timeout=400)
    first.signal_group(signal.SIGINT)
    assert first.finish() == 130, first.out[-4000:]
    assert re.search(r"memory plan \(fsdp, 2 workers\): .* per worker", first.out), first.out[-4000:]
    assert "first step on rank 0: peak" in first.out
    stopped = re.search(r"stopped at epoch (\d+) step (\d+) \(Ctrl-C\)", first.out)
    assert stopped, first.out[-3000:]
    position = (int(stopped[1]) - 1, int(stopped[2]))
    memory = events(run_dir, "first_step_memory")[0]
    assert memory["params_bytes"] < 11_181_642 * 4 * 0.55  # this rank's half (and a little)

    latest = strict_file(run_dir / "summary.json")["latest_checkpoint"]
    manifest = json.loads((Path(latest) / "manifest.json").read_text())
    shards = [f for f in manifest["files"] if f.endswith(".distcp")]
    assert len(shards) == 2, manifest  # one per rank, each with its size and SHA-256

    again = run_cli(*RUN, "--num-workers", "1", "--strategy", "fsdp", cwd=user_dir, env=env)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    resumed = events(run_dir, "resumed")
    assert (resumed[0]["epoch"], resumed[0]["step"], resumed[0]["world_size"]) == (*position, 1), resumed
    assert [r["epoch"] for r in strict_file(run_dir / "metrics.jsonl")] == [1, 2]

    exported = run_cli("export", "results/big", "--out", "model", cwd=user_dir)  # no cluster
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert (user_dir / "model" / "model.pt2").stat().st_size > 11_181_642 * 4


@pytest.mark.slurm
def test_hsdp_on_two_slurm_nodes_with_two_workers_each(slurm_cluster, tmp_path):
    """`sbatch slurm_ray_start.sh --strategy hsdp` on the two-node SLURM test cluster, two CPU workers
    per node: sharded within a node (each rank holds half the model), replicated across the nodes;
    every rank's shards in the checkpoint's manifest; the job completes."""
    from slurm_jobs import SLOW, Job

    # resnet18 (SLOW): its parameter count is what the shards are checked against
    job = Job(slurm_cluster, tmp_path, ["train", *SLOW, "--num-workers", "4", "--cpus-per-worker", "1",
                                        "--strategy", "hsdp", "--epochs", "1"])
    info = job.wait_done(timeout=600)
    assert info["JobState"] == "COMPLETED", job.tail()
    assert "memory plan (hsdp, 4 workers)" in job.output, job.tail()
    topology = strict_file(job.run_dir / "topology.json")
    assert (topology["world_size"], topology["num_nodes"]) == (4, 2)
    [memory] = events(job.run_dir, "first_step_memory")
    assert 11_181_642 * 4 * 0.45 < memory["params_bytes"] < 11_181_642 * 4 * 0.55  # half: shards of a node's 2
    latest = strict_file(job.run_dir / "summary.json")["latest_checkpoint"]
    files = json.loads((Path(latest) / "manifest.json").read_text())["files"]
    assert len([f for f in files if f.endswith(".distcp")]) == 4, files
    job.assert_cleaned_up()
