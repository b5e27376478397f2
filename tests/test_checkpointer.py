"""The checkpointer without Ray (its two Ray calls: LocalReports): asynchronous saves
that are reported only once complete, with their own metrics; snapshots copied into the last one's
memory; the last checkpoint written before save() returns; a failed background upload reported
without a checkpoint, the next one saved; a process killed during an upload leaving the previous
checkpoint the latest; resume falling back from a damaged newest checkpoint to the newest that
verifies."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch

import fsfaults
from ray_job.storage import Location, at, read_jsonl
from ray_job.train.checkpoint import CHECKPOINT_FILE, MANIFEST_FILE, CheckpointError, load_checkpoint
from ray_job.train.checkpointer import Checkpointer, LocalReports, Snapshot, saved_checkpoints
from ray_job.train.runlog import RunLog


def model_state(value: float = 1.0, width: int = 256):
    model = torch.nn.Linear(width, width)
    with torch.no_grad():
        model.weight.fill_(value)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer


def state_fn(model, optimizer, epoch: int, step: int = 0):
    return lambda: dict(model=model, optimizer=optimizer, epoch=epoch, step=step, config={}, metrics={},
                        world_size=1)


def make(store: Location, asynchronous: bool = True) -> tuple[Checkpointer, LocalReports]:
    reports = LocalReports()
    return Checkpointer(store, reports.link(), True, RunLog(store), 2.0, asynchronous), reports


def test_an_async_save_is_reported_once_complete_with_its_own_metrics(tmp_path):
    store = at(str(tmp_path / "run"))
    ckpt, reports = make(store)
    model, optimizer = model_state(1.0)
    assert ckpt.save(state_fn(model, optimizer, epoch=1), {"epoch": 1, "test_acc": 0.5}) is None
    with torch.no_grad():
        model.weight.fill_(7.0)  # the next steps change the live model: the snapshot does not
    assert reports.calls == [] and ckpt.busy()  # nothing reported while it uploads
    ckpt.wait_for_upload()
    assert ckpt.upload_over()
    ckpt.report_saved()
    ((metrics, path),) = reports.calls
    assert metrics == {"epoch": 1, "test_acc": 0.5} and not ckpt.busy() and not ckpt.upload_over()
    folder = Location(store.fs, path, path)
    assert sorted(os.listdir(path)) == [CHECKPOINT_FILE, MANIFEST_FILE]
    from ray_job.train.checkpoint import load_checkpoint

    assert torch.all(load_checkpoint(folder)["model"]["weight"] == 1.0)
    saved = [e for e in read_jsonl(store.join("events.jsonl")) if e["event"] == "checkpoint_saved"]
    assert [e["checkpoint"] for e in saved] == [os.path.basename(path)] and saved[0]["bytes"] > 0


def test_the_next_snapshot_is_copied_into_the_last_one_and_each_checkpoint_keeps_its_values(tmp_path):
    store = at(str(tmp_path / "run"))
    ckpt, reports = make(store)
    model, optimizer = model_state(1.0)
    for epoch, value in ((1, 1.0), (2, 3.0)):
        with torch.no_grad():
            model.weight.fill_(value)
        ckpt.save(state_fn(model, optimizer, epoch=epoch), {"epoch": epoch})
        ckpt.wait_for_upload()
        ckpt.report_saved()
    from ray_job.train.checkpoint import load_checkpoint

    paths = [path for _, path in reports.calls]
    assert [load_checkpoint(Location(store.fs, p, p))["model"]["weight"].unique().tolist() for p in paths] == \
        [[1.0], [3.0]]


def test_a_snapshot_reuses_the_tensors_that_match_and_allocates_the_rest():
    model, _ = model_state(1.0, width=8)
    first = Snapshot(model.state_dict()).wait()
    with torch.no_grad():
        model.weight.fill_(2.0)
    old = {"weight": first["weight"], "bias": torch.zeros(3)}  # bias: another shape
    second = Snapshot(model.state_dict(), into=old).wait()
    assert second["weight"].data_ptr() == first["weight"].data_ptr() and torch.all(second["weight"] == 2.0)
    assert second["bias"].shape == (8,) and torch.equal(second["bias"], model.bias.detach())
    assert second["weight"].data_ptr() != model.weight.data_ptr()  # a copy, never the live tensor


def test_the_last_checkpoint_is_written_before_save_returns(tmp_path):
    ckpt, reports = make(at(str(tmp_path / "run")))
    model, optimizer = model_state()
    assert ckpt.save(state_fn(model, optimizer, epoch=2), {"epoch": 2}, final=True) is None
    ((metrics, path),) = reports.calls
    assert not ckpt.busy() and os.path.exists(os.path.join(path, MANIFEST_FILE)) and metrics == {"epoch": 2}


def test_a_failed_background_upload_is_reported_without_a_checkpoint_and_the_next_saves(tmp_path):
    bad = Location(fsfaults.short_writes(100), str(tmp_path / "run"), "store://run")
    reports = LocalReports()  # checkpoints to a store that keeps short copies; the run log is fine
    ckpt = Checkpointer(bad, reports.link(), True, RunLog(at(str(tmp_path / "run"))), 2.0)
    model, optimizer = model_state()
    ckpt.save(state_fn(model, optimizer, epoch=1), {"epoch": 1})
    ckpt.wait_for_upload()
    assert ckpt.upload_over()  # over, though nothing was saved: it still waits for its report
    ckpt.report_saved()
    assert reports.calls == [({"epoch": 1}, None)]  # the metrics still count, no checkpoint
    events = read_jsonl(at(str(tmp_path / "run")).join("events.jsonl"))
    assert [e["event"] for e in events] == ["checkpoint_failed"] and "does not verify" in events[0]["error"]
    assert not [d for d in os.listdir(tmp_path / "run") if d.startswith("checkpoint_")]  # nothing half left
    good = Checkpointer(at(str(tmp_path / "run")), reports.link(), True, RunLog(at(str(tmp_path / "run"))), 2.0)
    good.save(state_fn(model, optimizer, epoch=2), {"epoch": 2})
    good.wait_for_upload()
    good.report_saved()
    assert reports.calls[-1][1] is not None


def test_synchronous_mode_reports_at_once(tmp_path):
    ckpt, reports = make(at(str(tmp_path / "run")), asynchronous=False)
    model, optimizer = model_state()
    ckpt.save(state_fn(model, optimizer, epoch=1), {"epoch": 1})
    assert len(reports.calls) == 1 and reports.calls[0][1] is not None and not ckpt.busy()


def _save_slowly_then_wait(run_dir: str, ready) -> None:
    """A rank 0 whose second upload is slow (the storage under load) and who is killed during it."""
    local = at(run_dir)
    ckpt = Checkpointer(local, LocalReports().link(), True, RunLog(local), 0.0)
    model, optimizer = model_state(width=1024)
    ckpt.save(state_fn(model, optimizer, epoch=1), {"epoch": 1})
    ckpt.wait_for_upload()
    ckpt.report_saved()
    slow = Location(fsfaults.slow_writes(2.0), run_dir, run_dir)
    ckpt.store = slow
    ckpt.save(state_fn(model, optimizer, epoch=2), {"epoch": 2})
    ready.set()
    time.sleep(60)


def test_a_kill_during_an_upload_leaves_the_previous_checkpoint_the_latest(tmp_path):
    run_dir = str(tmp_path / "run")
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_save_slowly_then_wait, args=(run_dir, ready))
    proc.start()
    assert ready.wait(120)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len([d for d in os.listdir(run_dir) if d.startswith("checkpoint_")]) < 2:
        time.sleep(0.05)  # the second folder exists: its upload is under way
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    folders = sorted(d for d in os.listdir(run_dir) if d.startswith("checkpoint_"))
    assert len(folders) == 2 and not os.path.exists(os.path.join(run_dir, folders[1], MANIFEST_FILE))
    assert saved_checkpoints(at(run_dir)) == [folders[0]]
    ckpt, _ = make(at(run_dir))
    name, state = ckpt.choose(recorded=None)
    assert name == folders[0] and state["epoch"] == 1


def _two_saved(tmp_path) -> tuple[Location, list[str]]:
    store = at(str(tmp_path / "run"))
    ckpt, reports = make(store, asynchronous=False)
    model, optimizer = model_state()
    for epoch in (1, 2):
        ckpt.save(state_fn(model, optimizer, epoch=epoch), {"epoch": epoch})
    return store, [os.path.basename(p) for _, p in reports.calls]


def test_resume_falls_back_from_a_damaged_newest_checkpoint(tmp_path):
    store, (older, newest) = _two_saved(tmp_path)
    path = os.path.join(store.path, newest, CHECKPOINT_FILE)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 3)
    ckpt, _ = make(store)
    name, state = ckpt.choose(recorded=newest)  # even when Ray's record names the damaged one
    assert name == older and state["epoch"] == 1
    skipped = [e for e in read_jsonl(store.join("events.jsonl")) if e["event"] == "checkpoint_skipped"]
    assert [e["checkpoint"] for e in skipped] == [newest] and "bytes short" in skipped[0]["error"]


def test_every_checkpoint_damaged_is_one_clear_error(tmp_path):
    store, names = _two_saved(tmp_path)
    for name in names:
        with open(os.path.join(store.path, name, CHECKPOINT_FILE), "r+b") as f:
            f.truncate(100)
    ckpt, _ = make(store)
    with pytest.raises(CheckpointError, match=r"none of this run's 2 checkpoint\(s\) verifies") as e:
        ckpt.choose(recorded=None)
    assert "\n" not in str(e.value) and "--resume-from" in str(e.value)


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    ckpt, _ = make(at(str(tmp_path / "run")))
    assert ckpt.choose(recorded=None) == (None, None)
    assert ckpt.resume(None, None, "", lambda world: 64, 1).state is None


def test_a_mid_epoch_position_holds_on_another_world_size_with_the_same_global_batch(tmp_path):
    """Step k of global batch B covers images k*B..(k+1)*B of the epoch's shuffle on any world size
    (DistributedSampler deals them out round-robin); with another global batch the epoch is redone."""
    from torch.utils.data import DistributedSampler

    shuffled = {world: [list(DistributedSampler(range(96), world, r, seed=3)) for r in range(world)]
                for world in (1, 2, 3)}
    for world, ranks in shuffled.items():  # 3 steps of a global batch of 12 (12 // world each)
        done = {i for r in ranks for i in r[:3 * (12 // world)]}
        assert done == set(shuffled[1][0][:36]), world
    store, names = _two_saved(tmp_path)
    ckpt, _ = make(store)
    state = {**load_checkpoint(store.join(names[-1])), "epoch": 1, "step": 3, "world_size": 2}
    assert (ckpt.resume(names[-1], state, "", lambda world: 12, 3).step) == 3  # global: 12 on 2 and on 3
    assert (ckpt.resume(names[-1], state, "", lambda world: 6 * world, 3).step) == 0  # per-worker: 12 -> 18
