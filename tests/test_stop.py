"""The stop request (ray_job/train/stop.py) and step control (control.py): every rank gets the same
Decision at the same step -- a stop a few steps after the request, a timed checkpoint, the report of
rank 0's finished upload -- and the all-reduce that carries it is read later than it is started."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from ranks import run_ranks
from ray_job.train import stop
from ray_job.train.control import GO_ON, StepControl

CPU = torch.device("cpu")


def _stopping_rank(rank: int, world: int, run_dir: str, request_at: int, steps: int):
    control = StepControl(run_dir, master_process=rank == 0, device=CPU, every=5, lag=2)
    stopped_at = None
    for step in range(1, steps + 1):
        if rank == 0 and step == request_at:
            stop.request(run_dir)
        if control.after_step(step, steps).stop:
            stopped_at = step
            break
        dist.barrier()  # stands in for the step's own collectives (DDP's all-reduce)
    return stopped_at, control.look_now().stop


def test_every_rank_stops_at_the_same_step_soon_after_the_request(tmp_path):
    results = run_ranks(_stopping_rank, str(tmp_path), 12, 40)
    # requested before step 12's look: polls start at 15 and are read 2 steps later, at 17
    assert [r[0] for r in results] == [17, 17]
    assert [r[1] for r in results] == [True, True]  # the request is still there at the epoch's end


def test_an_epoch_shorter_than_the_poll_interval_still_sees_the_request(tmp_path):
    asked, quiet = tmp_path / "asked", tmp_path / "quiet"
    asked.mkdir()
    quiet.mkdir()
    # 3 steps per epoch, polls every 5: only the epoch-end look can see it, and every rank agrees
    assert run_ranks(_stopping_rank, str(asked), 1, 3) == [(None, True), (None, True)]
    assert run_ranks(_stopping_rank, str(quiet), 99, 3) == [(None, False), (None, False)]


def test_single_process_poll_and_clear(tmp_path):
    control = StepControl(str(tmp_path), master_process=True, device=CPU, every=5)
    assert all(control.after_step(s, 100) is GO_ON for s in range(1, 11))
    stop.request(str(tmp_path))
    assert [s for s in range(11, 21) if control.after_step(s, 100).stop] == [15, 20]
    assert control.look_now().stop
    stop.clear(str(tmp_path))
    stop.clear(str(tmp_path))  # clearing twice is fine (a requeued job with no request left)
    assert not stop.requested(str(tmp_path))


def test_usr1_writes_the_request_and_forward_passes_it_on(tmp_path):
    sweep, point = tmp_path / "sweep", tmp_path / "sweep" / "w2"
    point.mkdir(parents=True)
    with stop.stop_on_signals(str(sweep), signums=(signal.SIGUSR1,)):
        with stop.forward(str(sweep), str(point), every_s=0.05):
            os.kill(os.getpid(), signal.SIGUSR1)
            deadline = time.time() + 10
            while not stop.requested(str(point)) and time.time() < deadline:
                time.sleep(0.05)
    assert stop.requested(str(sweep)) and stop.requested(str(point))


def _timed_rank(rank: int, world: int, run_dir: str):
    control = StepControl(run_dir, master_process=rank == 0, device=CPU, every=5, lag=2, checkpoint_every_s=0.5)
    checkpoints, times = [], []  # times: rank 0's clock when each checkpoint is taken
    for step in range(1, 61):
        if rank == 0:
            time.sleep(0.05)  # rank 0's clock is the one that decides
        decision = control.after_step(step, 100)
        assert not decision.stop
        if decision.checkpoint:
            checkpoints.append(step)
            times.append(time.monotonic())
            control.checkpointed()
        dist.barrier()
    return checkpoints, times if rank == 0 else None


def test_timed_checkpoints_fall_due_at_the_same_step_on_every_rank(tmp_path):
    (steps, times), (other_steps, _) = run_ranks(_timed_rank, str(tmp_path))
    assert steps == other_steps, (steps, other_steps)
    # 60 steps of >= 50 ms (>= 3 s) with a 0.5 s interval: several are due, each at a poll's answer
    # (2 steps after a multiple of 5), never two without the interval between them on rank 0's
    # clock -- however long a step takes on this machine
    assert len(steps) >= 2 and all(s % 5 == 2 for s in steps), steps
    assert all(b - a >= 0.5 for a, b in zip(times, times[1:])), times


def _uploading_rank(rank: int, world: int, run_dir: str):
    """Rank 0's upload is in flight from step 1 and over from step 11 (the other ranks know nothing
    of it); a timed checkpoint is due from the start. Every rank: the steps of its decisions."""
    upload = {"over": False, "busy": True}
    control = StepControl(run_dir, master_process=rank == 0, device=CPU, every=5, lag=2, checkpoint_every_s=1e-6,
                          busy=lambda: upload["busy"], upload_over=lambda: upload["over"])
    reported, checkpoints = [], []
    for step in range(1, 31):
        if rank == 0 and step == 11:
            upload["over"] = True
        decision = control.after_step(step, 100)
        if decision.report_saved:
            reported.append(step)
            upload.update(over=False, busy=False)  # reported: the checkpointer is free again
        if decision.checkpoint:
            checkpoints.append(step)
        dist.barrier()
    return reported, checkpoints


def test_a_finished_upload_is_reported_at_the_same_step_on_every_rank_and_no_checkpoint_starts_before(tmp_path):
    results = run_ranks(_uploading_rank, str(tmp_path))
    assert results[0] == results[1], results
    reported, checkpoints = results[0]
    # over at step 11: the poll started at 15 carries it, read at 17; while busy no timed checkpoint
    # fell due (polls read at 7, 12, 17), the first after the report is read at 22
    assert reported == [17], results
    assert checkpoints == [22, 27], results
