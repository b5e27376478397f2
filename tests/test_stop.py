"""The stop request (ray_job/train/stop.py) and step control (control.py): every rank gets STOP
at the same step, a few steps after the request, and the all-reduce that carries it is read later
than it is started; timed checkpoints fall due at the same step on every rank."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ray_job.train import stop
from ray_job.train.control import Action, StepControl
from ray_job.cluster.ports import free_port


def _ranks(rank: int, world: int, port: int, run_dir: str, request_at: int, out, steps: int = 40) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    poller = StepControl(run_dir, is_rank0=rank == 0, device=torch.device("cpu"), every=5, lag=2)
    stopped_at = None
    for step in range(1, steps + 1):
        if rank == 0 and step == request_at:
            stop.request(run_dir)
        if poller.after_step(step, steps) is Action.STOP:
            stopped_at = step
            break
        dist.barrier()  # stands in for the step's own collectives (DDP's all-reduce)
    out.put((rank, stopped_at, poller.at_epoch_end()))
    dist.destroy_process_group()


def _run_ranks(run_dir: str, request_at: int, steps: int) -> list:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_ranks, args=(r, 2, port, run_dir, request_at, out, steps))
             for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    return results


def test_every_rank_stops_at_the_same_step_soon_after_the_request(tmp_path):
    results = _run_ranks(str(tmp_path), request_at=12, steps=40)
    # requested before step 12's look: polls start at 15 and are read 2 steps later, at 17
    assert [r[1] for r in results] == [17, 17]
    assert [r[2] for r in results] == [True, True]  # the request is still there at the epoch's end


def test_an_epoch_shorter_than_the_poll_interval_still_sees_the_request(tmp_path):
    asked, quiet = tmp_path / "asked", tmp_path / "quiet"
    asked.mkdir()
    quiet.mkdir()
    # 3 steps per epoch, polls every 5: only the epoch-end look can see it, and every rank agrees
    assert _run_ranks(str(asked), request_at=1, steps=3) == [(0, None, True), (1, None, True)]
    assert _run_ranks(str(quiet), request_at=99, steps=3) == [(0, None, False), (1, None, False)]


def test_single_process_poll_and_clear(tmp_path):
    poller = StepControl(str(tmp_path), is_rank0=True, device=torch.device("cpu"), every=5)
    assert all(poller.after_step(s, 100) is Action.CONTINUE for s in range(1, 11))
    stop.request(str(tmp_path))
    assert [s for s in range(11, 21) if poller.after_step(s, 100) is Action.STOP] == [15, 20]
    assert poller.at_epoch_end()
    stop.clear(str(tmp_path))
    stop.clear(str(tmp_path))  # clearing twice is fine (a requeued job with no request left)
    assert not stop.requested(str(tmp_path))


def test_usr1_writes_the_request_and_forward_passes_it_on(tmp_path):
    sweep, point = tmp_path / "sweep", tmp_path / "sweep" / "w2"
    point.mkdir(parents=True)
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        stop.stop_on_usr1(str(sweep))
        with stop.forward(str(sweep), str(point), every_s=0.05):
            os.kill(os.getpid(), signal.SIGUSR1)
            deadline = time.time() + 10
            while not stop.requested(str(point)) and time.time() < deadline:
                time.sleep(0.05)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert stop.requested(str(sweep)) and stop.requested(str(point))


def _timed_ranks(rank: int, port: int, run_dir: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    poller = StepControl(run_dir, is_rank0=rank == 0, device=torch.device("cpu"), every=5, lag=2,
                         checkpoint_every_s=0.5)
    checkpoints = []
    for step in range(1, 61):
        if rank == 0:
            time.sleep(0.05)  # rank 0's clock is the one that decides
        action = poller.after_step(step, 100)
        assert action is not Action.STOP
        if action is Action.CHECKPOINT:
            checkpoints.append(step)
            poller.checkpointed()
        dist.barrier()
    out.put((rank, checkpoints))
    dist.destroy_process_group()


def test_timed_checkpoints_fall_due_at_the_same_step_on_every_rank(tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_timed_ranks, args=(r, port, str(tmp_path), out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert results[0] == results[1], results
    # 60 steps of >= 50 ms with a 0.5 s interval: due every ~10 steps, always at a poll's answer
    # (2 steps after a multiple of 5), never two in a row without the interval between them
    assert 3 <= len(results[0]) <= 6, results
    assert all(s % 5 == 2 for s in results[0]), results
    assert all(b - a >= 10 for a, b in zip(results[0], results[0][1:])), results
