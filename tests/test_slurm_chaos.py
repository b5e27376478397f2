"""Chaos on the real two-node SLURM test cluster: a node's Ray and the driver killed mid-run.

Each test says what it kills, when, and what it expects, and ends with no process of the job left
on any node (counted by PID through their SLURM_JOB_ID). The runs are tiny CPU ones (a two-block
ViT, synthetic data, one worker of 2 CPUs per node), held at a step (RJ_HOLD_FILE) where a node or
the driver is killed: nothing races the run, on a machine of any speed.
Needs root and the SLURM packages (skipped otherwise).

    .venv/bin/python -m pytest -n 0 -v -s tests/test_slurm_chaos.py   # -s prints the measured timings
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from processes import Hold
from slurm_jobs import TINY, Job, assert_two_node_run, kill_job_processes

from ray_job.train.runfiles import Event

# 1024 images / global batch 64 = 16 steps per epoch
CHAOS = [*TINY, "--synthetic-train-size", "1024"]


def events(job: Job, name: str) -> list[dict]:
    return [e for e in job.events() if e["event"] == name]


def epoch_starts(job: Job) -> list[tuple[int, int]]:
    return [(e["epoch"], e["step"]) for e in events(job, Event.EPOCH_START)]


def report(case: str, **figures) -> None:
    print(f"\n[chaos] {case}: " + ", ".join(f"{k} {v:.1f} s" if isinstance(v, float) else f"{k} {v}"
                                            for k, v in figures.items()))


def temp_entries() -> set[str]:
    """Our temporary folders in /tmp (TensorBoard copies) whose process is gone: what a killed
    worker left (named <prefix><pid>_...; other tests' live ones are not)."""
    from ray_job.train.runlog import TB_PREFIX

    found = set()
    for name in os.listdir("/tmp"):
        pid = name[len(TB_PREFIX):].split("_", 1)[0] if name.startswith(TB_PREFIX) else ""
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            found.add(name)
    return found


def written(job: Job) -> bool:
    """Every checkpoint folder has its checkpoint_saved event: none is half-written."""
    saved = {e["checkpoint"] for e in events(job, Event.CHECKPOINT_SAVED)}
    return all(p.name in saved for p in job.run_dir.glob("checkpoint_*") if p.is_dir())


def metrics(job: Job) -> list[dict]:
    path = job.run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def world_sizes(job: Job) -> list[int]:
    return [m["world_size"] for m in metrics(job)]


@pytest.mark.timeout(1200)  # fixed waits (node2's restart after 45 s, the grow check) on top of training
def test_lost_node_elastic_shrinks_grows_back_and_a_killed_driver_resumes(slurm_cluster, tmp_path):
    """Under --strategy fsdp. Kills: every process of the job on node2 (its `ray start` step, raylet
    and training worker), mid-epoch 2; later the driver. Expects: with --min-workers 1 the run goes
    on with one worker (epoch 2 redone from its start, the batch rule logged), the script starts
    node2's Ray again (RJ_NODE_RESTART_S later) and the run grows back to two workers at Ray Train's
    next resize check (--grow-check-s); the killed driver fails the job with a line saying how to
    continue, and a job with RJ_RUN_NAME of the first finishes the run from its last checkpoint. No
    process and no temporary folder of ours is left."""
    before = temp_entries()
    epochs = 4
    # sharded (--strategy fsdp): every resize loads the other world size's shards
    args = ["train", *CHAOS, "--epochs", str(epochs), "--min-workers", "1", "--grow-check-s", "10",
            "--strategy", "fsdp"]
    hold = Hold(tmp_path / "hold").at(2, 8)
    job = Job(slurm_cluster, tmp_path, args, env={"RJ_NODE_RESTART_S": "45", **hold.env})
    job.wait_for(lambda: hold.waits_at(2, 8), timeout=400, what="epoch 2 under way")
    killed = kill_job_processes(job, "node2")
    fault = time.time()
    assert killed, "no process of the job on node2"

    def resized(before_after):
        return [e for e in events(job, Event.WORLD_SIZE_CHANGED) if (e["before"], e["after"]) == before_after]
    shrunk = job.wait_for(lambda: resized((2, 1)), timeout=300, what="the run to go on with one worker")
    assert shrunk[0]["global_batch"] == 64  # --batch-mode global: the same global batch
    # The one worker redoes epoch 2 up to the same step, where the hold keeps it until the group
    # grows back: however fast the machine, the run cannot finish before node2 returns. The resize
    # ends the held worker as it would a running one.
    # the driver's line reaches the job's output file a moment after the event reaches events.jsonl
    job.wait_for(lambda: "world size changed 2 -> 1; --batch-mode global: global batch 64 -> 64" in job.output,
                 timeout=60, what="the driver's line about the new world size")
    job.wait_for(lambda: "starting Ray on node2 again in 45 s (restart 1 of 3)" in job.output, timeout=60,
                 what="the script to say when it starts node2's Ray again")
    job.wait_for(lambda: "starting Ray on node2 again\n" in job.output, timeout=200,
                 what="the script to start node2's Ray again")
    # Grown: a group of two resumes from the 2-worker checkpoint of epoch 1 (the held one saved none).
    grown = job.wait_for(lambda: [e for e in events(job, Event.RESUMED) if e["time"] > shrunk[0]["time"]
                                  and e["world_size"] == 2], timeout=300,
                         what="the run to grow back to two workers")
    hold.at(3, 8)  # on, through epoch 2's checkpoint, to the middle of epoch 3
    job.wait_for(lambda: hold.waits_at(3, 8) and written(job), timeout=300, what="epoch 3 under way")
    assert any(e["time"] > grown[0]["time"] for e in events(job, Event.CHECKPOINT_SAVED)), job.events()
    report("elastic, node2 killed mid-epoch 2", killed=len(killed), fault_to_one_worker=shrunk[0]["time"] - fault,
           fault_to_two_workers=grown[0]["time"] - fault)

    driver = kill_job_processes(job, "node1", match="-m ray_job train")
    assert len(driver) == 1, driver
    driver_killed = time.time()
    info = job.wait_done(timeout=200)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "137:0", (info, job.tail())
    run_name = job.run_dir.name
    assert "the driver was killed by signal 9 (KILL)" in job.output
    assert f"resubmit with RJ_RUN_NAME={run_name}" in job.output
    job.assert_cleaned_up()
    last = [e for e in events(job, Event.CHECKPOINT_SAVED)][-1]

    hold.release()
    again = Job(slurm_cluster, tmp_path, args, env={"RJ_RUN_NAME": run_name})
    again.run_dir = job.run_dir
    info = again.wait_done(timeout=500)
    assert info["JobState"] == "COMPLETED", again.tail()
    assert [(e["epoch"], e["step"]) for e in events(again, Event.RESUMED)][-1] == (last["epoch"], last["step"])
    sizes = world_sizes(again)  # per epoch: the one worker was held until the group grew back
    assert sizes == [2] * epochs, sizes
    resumed_on = [e["world_size"] for e in events(job, Event.RESUMED)]
    assert resumed_on[0] == 1 and 2 in resumed_on, resumed_on  # shrunk, then grown
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert summary["finished"] and summary["epochs_completed"] == epochs
    manifest = json.loads((Path(summary["latest_checkpoint"]) / "manifest.json").read_text())
    assert len([f for f in manifest["files"] if f.endswith(".distcp")]) == sizes[-1]  # a rank's shards each
    again.assert_cleaned_up()
    assert temp_entries() <= before, temp_entries() - before
    report("driver killed", fault_to_job_end=job.ended - driver_killed, world_sizes=sizes, orphans=0)


@pytest.mark.timeout(1200)  # as the elastic one: held runs, fixed waits, a requeue
def test_lost_node_fixed_size_gets_its_workers_back_and_when_it_cannot_requeues(slurm_cluster, tmp_path):
    """Kills: every process of the job on node2, mid-epoch 2, then mid-epoch 3. Expects: the first
    time, the script starts node2's Ray again and the fixed-size run gets its two workers back within
    --resource-wait-s (no exit 5); the second time there is no restart left (RJ_NODE_RESTARTS=1):
    the driver waits --resource-wait-s, exits 5 saying what is missing, the job requeues, and the
    requeued job (both nodes healthy again) resumes from the last checkpoint (a timed one, at its
    exact step) and finishes."""
    before = temp_entries()
    wait_s = 40
    # A timed checkpoint falls due at every poll with no upload in flight (0.0001 min = 6 ms)
    hold = Hold(tmp_path / "hold").at(2, 8)
    job = Job(slurm_cluster, tmp_path, ["train", *CHAOS, "--epochs", "4", "--resource-wait-s", str(wait_s),
                                        "--checkpoint-every-min", "0.0001"],
              env={"RJ_NODE_RESTARTS": "1", "RJ_NODE_RESTART_S": "5", **hold.env})
    job.wait_for(lambda: hold.waits_at(2, 8), timeout=400, what="epoch 2 under way")
    first = kill_job_processes(job, "node2")
    fault = time.time()
    assert first, "no process of the job on node2"
    job.wait_for(lambda: "starting Ray on node2 again in 5 s (restart 1 of 1)" in job.output, timeout=120,
                 what="the script to start node2's Ray again")
    back = job.wait_for(lambda: [e for e in events(job, Event.RESUMED) if e["time"] > fault], timeout=wait_s + 120,
                        what="training again after the restart")
    assert "--resource-wait-s" not in job.output.split("(restart 1 of 1)")[-1]  # no giving up
    report("fixed size, node2 killed and started again", fault_to_training_again=back[0]["time"] - fault)

    # On to epoch 3's step 13, past the polls of steps 5 and 10 (each a timed checkpoint, two steps
    # later), and held there until every checkpoint begun is written.
    hold.at(3, 13)
    job.wait_for(lambda: hold.waits_at(3, 13) and written(job), timeout=300, what="epoch 3's step 13")
    newest = events(job, Event.CHECKPOINT_SAVED)[-1]
    assert (newest["epoch"], newest["step"] > 0) == (2, True), newest  # a timed one, in epoch 3
    second = kill_job_processes(job, "node2")
    fault = time.time()
    hold.release()  # a rank on node1 goes on to a lost peer; the requeued job is not held
    assert second, "no process of the job on node2 the second time"
    info = job.wait_for(lambda: (lambda i: i if i.get("JobState") == "PENDING" else None)(job.info()),
                        timeout=300, what="the job to be requeued")
    gave_up = time.time()
    assert info["Restarts"] == "1", info
    assert "not starting Ray on node2 again: it was restarted 1 times (RJ_NODE_RESTARTS)" in job.output
    assert f"error: waited {wait_s} s (--resource-wait-s) for the workers: the cluster holds 1 of " \
           f"the 2 workers" in job.output, job.tail()
    assert "the cluster lost the resources for the workers; requeueing" in job.output
    # Nothing lost beyond the last checkpoint the first run completed (rank 0 may complete one
    # after the kill, whose report to Ray never lands: the resume takes it all the same).
    first_run = [e for e in events(job, Event.CHECKPOINT_SAVED) if e["time"] < gave_up]
    job.cluster.run(["scontrol", "update", f"JobId={job.id}", "StartTime=now+2"])

    info = job.wait_done(timeout=500)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.tail()
    assert_two_node_run(job, epochs=4)
    resumed = [(e["epoch"], e["step"]) for e in events(job, Event.RESUMED)]
    latest = first_run[-1]
    assert resumed[-1] == (latest["epoch"], latest["step"]) and resumed[-1][1] > 0, (resumed, first_run)
    job.assert_cleaned_up()
    assert temp_entries() <= before, temp_entries() - before
    report("fixed size, node2 killed again (no restart left)", fault_to_requeue=gave_up - fault,
           resumed_at=f"epoch {latest['epoch'] + 1} step {latest['step']}", orphans=0)
