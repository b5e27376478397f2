"""Chaos on the real two-node SLURM test cluster: a node, the driver, a job killed mid-run.

Each test says what it kills, when, and what it expects, and ends with no process of the job left
on any node (counted by PID through their SLURM_JOB_ID). The runs are tiny CPU ones (resnet18,
synthetic data, one worker of 2 CPUs per node), with epochs long enough to kill one mid-way.
Needs root and the SLURM packages (skipped otherwise).

    .venv/bin/python -m pytest -v -s tests/test_slurm_chaos.py   # -s prints the measured timings
"""

from __future__ import annotations

import json
import time

import pytest
from slurm_jobs import TINY, Job, assert_two_node_run, kill_job_processes

# 1536 images / global batch 64 = 24 steps per epoch: a few seconds each, time to kill mid-epoch.
CHAOS = [*TINY, "--synthetic-train-size", "1536", "--epochs", "3"]


def events(job: Job, name: str) -> list[dict]:
    return [e for e in job.events() if e["event"] == name]


def epoch_starts(job: Job) -> list[tuple[int, int]]:
    return [(e["epoch"], e["step"]) for e in events(job, "epoch_start")]


def report(case: str, **figures) -> None:
    print(f"\n[chaos] {case}: " + ", ".join(f"{k} {v:.1f} s" if isinstance(v, float) else f"{k} {v}"
                                            for k, v in figures.items()))


@pytest.mark.timeout(600)
def test_lost_node_elastic_run_goes_on_with_one_worker(slurm_cluster, tmp_path):
    """Kills: every process of the job on node2 (its raylet and training worker), mid-epoch 2.
    Expects: with --min-workers 1 the run restarts on node1 alone from the end-of-epoch-1
    checkpoint, redoes epoch 2 from its start (the sampler re-shards for one worker), finishes all
    epochs in the same job, and logs the batch rule for the new world size."""
    job = Job(slurm_cluster, tmp_path, ["train", *CHAOS, "--min-workers", "1"])
    job.wait_for(lambda: "Epoch [2/3], Step [8/24]" in job.output, timeout=400,
                 what="epoch 2 under way")
    killed = kill_job_processes(job, "node2")
    fault = time.time()
    assert killed, "no process of the job on node2"

    info = job.wait_done(timeout=400)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", job.tail()
    changed = events(job, "world_size_changed")
    assert [(e["before"], e["after"]) for e in changed] == [(2, 1)], job.events()
    assert changed[0]["global_batch"] == 64  # --batch-mode global: the same global batch
    assert "world size changed 2 -> 1; --batch-mode global: global batch 64 -> 64" in job.output
    assert epoch_starts(job) == [(1, 0), (2, 0), (2, 0), (3, 0)]
    rows = [json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    assert [r["world_size"] for r in rows] == [2, 1, 1]
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert summary["finished"] and summary["epochs_completed"] == 3
    job.assert_cleaned_up()
    again = [e["time"] for e in events(job, "first_step") if e["time"] > fault]
    report("elastic, node2 killed mid-epoch 2", killed=len(killed),
           fault_to_training_again=(again[0] - fault) if again else "?",
           recomputed="epoch 2 steps done before the kill", orphans=0)


@pytest.mark.timeout(900)
def test_lost_node_fixed_size_gives_up_in_bounded_time_requeues_and_resumes(slurm_cluster, tmp_path):
    """Kills: every process of the job on node2, once a timed checkpoint (--checkpoint-every-min)
    inside epoch 2 exists. Expects: without elasticity the driver waits --resource-wait-s for two
    workers, then exits 5 saying what is missing; the script requeues the job; the requeued job
    (both nodes healthy again) resumes from that timed checkpoint, at its exact step."""
    wait_s = 20
    job = Job(slurm_cluster, tmp_path, ["train", *CHAOS, "--resource-wait-s", str(wait_s),
                                        "--checkpoint-every-min", "0.05"])

    def timed_in_epoch_2():
        return [e for e in events(job, "checkpoint_saved") if e["epoch"] == 1 and e["step"] > 0]

    job.wait_for(timed_in_epoch_2, timeout=400, what="a timed checkpoint inside epoch 2")
    saved = timed_in_epoch_2()[-1]
    time.sleep(1)  # its report to Ray (after the event) is done; later ones may be cut off
    killed = kill_job_processes(job, "node2")
    fault = time.time()
    assert killed, "no process of the job on node2"

    info = job.wait_for(lambda: (lambda i: i if i.get("JobState") == "PENDING" else None)(job.info()),
                        timeout=300, what="the job to be requeued")
    gave_up = time.time()
    assert info["Restarts"] == "1", info
    assert f"error: waited {wait_s} s (--resource-wait-s) for the workers: the cluster holds 1 of " \
           f"the 2 workers" in job.output, job.tail()
    assert "the cluster lost the resources for the workers; requeueing" in job.output
    # nothing new after the fault: the latest checkpoint is the one taken before it (or the same
    # checkpoint interval's next one, if it was saved in the moment of the kill)
    # Nothing lost beyond the last checkpoint the first run completed (rank 0 may complete one
    # after the kill, whose report to Ray never lands: the resume takes it all the same).
    first_run = [e for e in events(job, "checkpoint_saved") if e["time"] < gave_up]
    cluster = job.cluster
    cluster.run(["scontrol", "update", f"JobId={job.id}", "StartTime=now+2"])

    info = job.wait_done(timeout=500)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.tail()
    assert_two_node_run(job, epochs=3)
    resumed = [(e["epoch"], e["step"]) for e in events(job, "resumed")]
    latest = first_run[-1]
    assert resumed == [(latest["epoch"], latest["step"])], (resumed, first_run)
    assert resumed[0] >= (saved["epoch"], saved["step"]) and resumed[0][1] > 0  # a timed one
    job.assert_cleaned_up()
    again = [e["time"] for e in events(job, "first_step") if e["time"] > fault]
    report("fixed size, node2 killed after a timed checkpoint", killed=len(killed),
           fault_to_requeue=gave_up - fault,
           fault_to_training_again=(again[0] - fault) if again else "?",
           resumed_at=f"epoch {latest['epoch'] + 1} step {latest['step']}", orphans=0)


@pytest.mark.timeout(600)
def test_killed_driver_fails_clearly_and_the_same_run_name_resumes(slurm_cluster, tmp_path):
    """Kills: the driver process (`python -m ray_job train`) on the head node, mid-epoch 2.
    Expects: the job FAILS with the signal's status and a line saying how to continue; every Ray
    process of the job is gone; a new job with RJ_RUN_NAME=<the first run> resumes from the
    end-of-epoch-1 checkpoint and finishes."""
    job = Job(slurm_cluster, tmp_path / "first", ["train", *CHAOS])
    job.wait_for(lambda: any(e["epoch"] == 2 for e in events(job, "epoch_start")),
                 timeout=400, what="epoch 2 to start")
    killed = kill_job_processes(job, "node1", match="-m ray_job train")
    fault = time.time()
    assert len(killed) == 1, killed
    info = job.wait_done(timeout=200)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "137:0", (info, job.tail())
    run_name = job.run_dir.name
    assert "the driver was killed by signal 9 (KILL)" in job.output
    assert f"resubmit with RJ_RUN_NAME={run_name}" in job.output
    job.assert_cleaned_up()
    ended = job.ended

    again = Job(slurm_cluster, tmp_path / "first", ["train", *CHAOS], env={"RJ_RUN_NAME": run_name})
    again.run_dir = job.run_dir
    info = again.wait_done(timeout=400)
    assert info["JobState"] == "COMPLETED", again.tail()
    assert [(e["epoch"], e["step"]) for e in events(again, "resumed")] == [(1, 0)]
    assert [r["epoch"] for r in map(json.loads, (job.run_dir / "metrics.jsonl").read_text().splitlines())] \
        == [1, 2, 3]
    again.assert_cleaned_up()
    report("driver killed mid-epoch 2", fault_to_job_end=ended - fault,
           recomputed="epoch 2 steps done before the kill", orphans=0)
