"""The training job end to end on the session's Ray head (gloo, CPU, tiny sizes). Tests that only
need a finished run start from the session's `trained_run` (the README's road, 2 workers, 2
epochs), copied; the driver runs in-process, joined to the head."""

import json
import os
import shutil
import time

import pytest
import torch

from processes import Hold

from conftest import Running, events, one_error_line, run_cli, strict_file, tiny_args, assert_refused_before_ray
from ray_job.config import parse_train_args
from ray_job.core.errors import UsageError
from ray_job.data.arrays import ArrayDataset
from ray_job.data.augment import DeviceAugment
from ray_job.data.synthetic import make_synthetic
from ray_job.model import zoo
from ray_job.storage import read_jsonl
from ray_job.train.checkpoint import CHECKPOINT_FILE, load_checkpoint
from ray_job.train.driver import run_training
from ray_job.train.engine import evaluate

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]


def _train(tmp_path, name, *extra):
    cfg = parse_train_args(tiny_args(tmp_path, name, *extra))
    return cfg, run_training(cfg)


def _rows(cfg):
    return read_jsonl(os.path.join(cfg.run_dir(), "metrics.jsonl"))


def _copy(trained_run, tmp_path, *extra: str):
    """The trained run copied under tmp_path, and the config that continues it there."""
    home = trained_run.copy_to(tmp_path)
    cfg = parse_train_args([*trained_run.args, *extra]).with_resolved_paths(str(home))
    return cfg, home / "results" / "trained"


def _checkpoints(run_dir) -> list[str]:
    return sorted(d for d in os.listdir(run_dir)
                  if d.startswith("checkpoint_") and os.path.isdir(os.path.join(run_dir, d)))


def test_two_workers_learn_and_leave_every_run_file(trained_run):
    run_dir = trained_run.run_dir
    rows = strict_file(run_dir / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [1, 2] and rows[0]["world_size"] == 2
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert rows[-1]["test_acc"] > 0.3  # chance is 0.1
    assert rows[0]["test_images"] == 203 and rows[0]["train_images"] == 512  # every image once
    for key in ("data_s", "compute_s", "images_per_s", "lr", "epoch_s", "train_acc", "test_loss"):
        assert key in rows[0]
    topo = strict_file(run_dir / "topology.json")
    assert topo["world_size"] == 2 and topo["backend"] == "gloo"
    assert os.listdir(run_dir / "tensorboard")  # written in place: the folder is local
    assert "epoch" in open(run_dir / "metrics.csv").readline()
    summary = strict_file(run_dir / "summary.json")
    assert summary["finished"] and summary["best_checkpoint"] and "best checkpoint" in trained_run.stdout
    saved = events(run_dir, "checkpoint_saved")  # asynchronous, each complete before it counts
    assert [(e["epoch"], e["step"]) for e in saved] == [(1, 0), (2, 0)]
    assert {e["checkpoint"] for e in saved} == set(_checkpoints(run_dir))
    assert not (run_dir / ".lease.json").exists()  # given back at the end


def test_finished_then_more_epochs_continue_the_count(ray_joined, trained_run, tmp_path, capsys):
    cfg, run_dir = _copy(trained_run, tmp_path)
    assert run_training(cfg) == 0  # the same command: finished, says so, trains nothing
    assert "already finished" in capsys.readouterr().out and len(_rows(cfg)) == 2
    more, _ = _copy(trained_run, tmp_path / "more", "--epochs", "3")
    assert run_training(more) == 0  # more epochs on the same name: continues at epoch 3
    assert [r["epoch"] for r in _rows(more)] == [1, 2, 3]
    more_dir = os.path.dirname(more.run_dir()) + "/trained"
    assert [e["epoch"] for e in events(more_dir, "epoch_start")] == [1, 2, 3]  # 1-2 not retrained
    assert [e["epoch"] for e in events(more_dir, "resumed")] == [2]


def test_global_accuracy_equals_single_process_evaluation(trained_run):
    """The test accuracy the 2 workers reported for the last epoch is the one a single process
    computes from that epoch's checkpoint, over the 203 test images (odd: padding would double-count)."""
    cfg = parse_train_args(list(trained_run.args))
    reported = strict_file(trained_run.run_dir / "metrics.jsonl")[-1]
    state = load_checkpoint(strict_file(trained_run.run_dir / "summary.json")["latest_checkpoint"])
    assert (state["epoch"], state["step"]) == (reported["epoch"], 0)  # the checkpoint of that epoch's end
    model = zoo.build(cfg, 10)
    model.load_state_dict(state["model"])
    test = ArrayDataset(make_synthetic(cfg.synthetic_test_size, cfg.seed, False))  # the run's test split
    loader = torch.utils.data.DataLoader(test, batch_size=64, collate_fn=test.collate_fn)
    single = evaluate(model, loader, torch.nn.CrossEntropyLoss(), DeviceAugment(torch.device("cpu"), False),
                      torch.device("cpu"))
    assert reported["test_images"] == single.count == 203
    assert reported["test_acc"] == pytest.approx(single.correct / single.count, abs=1e-9)
    assert reported["test_loss"] == pytest.approx(single.loss_sum / single.count, rel=1e-4)


def test_checkpoint_moves_across_world_sizes(ray_joined, trained_run, tmp_path):
    ckpt = strict_file(trained_run.run_dir / "summary.json")["latest_checkpoint"]
    new, rc = _train(tmp_path, "dst", "--num-workers", "1", "--epochs", "3", "--resume-from", ckpt,
                     "--loader", "torchvision")  # the classic PIL path trains too
    assert rc == 0
    rows = _rows(new)
    assert [r["epoch"] for r in rows] == [3] and rows[0]["world_size"] == 1
    back, rc = _train(tmp_path, "back", "--num-workers", "2", "--epochs", "4", "--resume-from",
                      json.load(open(os.path.join(new.run_dir(), "summary.json")))["latest_checkpoint"])
    assert rc == 0 and [r["epoch"] for r in _rows(back)] == [4]
    for cfg, before, after in ((new, 2, 1), (back, 1, 2)):  # each resume says on how many workers
        assert [e["world_size"] for e in events(cfg.run_dir(), "resumed")] == [after]
        assert [(e["before"], e["after"]) for e in events(cfg.run_dir(), "world_size_changed")] == [(before, after)]


def test_more_workers_than_the_cluster_holds_fails_at_once(ray_joined, tmp_path):
    with pytest.raises(UsageError, match="cannot fit: the cluster holds at most 2"):
        _train(tmp_path, "big", "--num-workers", "3")
    with pytest.raises(UsageError, match="no GPUs"):
        _train(tmp_path, "gpu", "--use-gpu")
    assert not os.path.exists(tmp_path / "results" / "big" / "config.json")


def test_timed_checkpoints_mid_epoch_and_elastic_start_with_what_fits(ray_joined, tmp_path):
    # --num-workers 4 on a 2-CPU cluster: refused as a fixed size, started with 2 when elastic
    with pytest.raises(UsageError, match="--num-workers 4 cannot fit"):
        _train(tmp_path, "fixed", "--num-workers", "4")
    # a timed checkpoint due at every poll with no upload in flight (0.0001 min = 6 ms): the first
    # at step 5's (5 steps take longer on any machine), answered at step 7
    cfg, rc = _train(tmp_path, "timed", "--num-workers", "4", "--min-workers", "1", "--epochs", "1",
                     "--checkpoint-every-min", "0.0001", "--keep-checkpoints", "1")
    assert rc == 0
    assert [r["world_size"] for r in _rows(cfg)] == [2]
    saved = events(cfg.run_dir(), "checkpoint_saved")
    timed = [e["step"] for e in saved if e["step"] > 0]
    assert timed and all(s % 5 == 2 for s in timed), saved  # at a poll's answer, mid-epoch
    assert (saved[-1]["epoch"], saved[-1]["step"]) == (1, 0)  # and the epoch's own at its end
    kept = _checkpoints(cfg.run_dir())
    assert 1 <= len(kept) <= 2, kept  # --keep-checkpoints 1 best, plus the latest
    with pytest.raises(UsageError, match="--min-workers 3 is more than --num-workers 2"):
        _train(tmp_path, "bad", "--num-workers", "2", "--min-workers", "3")


def test_resume_takes_the_newest_checkpoint_that_is_complete_and_verifies(ray_joined, trained_run, tmp_path):
    """Three ways the newest folder is not the one to take: Ray has no record of a complete one
    (the driver was killed right after rank 0 saved it): taken; a folder without its
    checkpoint_saved event (an upload cut off): never taken; the newest recorded one truncated (a
    full disk): passed over with a line, for the older one that verifies."""
    cfg, run_dir = _copy(trained_run, tmp_path, "--epochs", "3")
    older, newest = _checkpoints(run_dir)
    os.remove(run_dir / "checkpoint_manager_snapshot.json")  # Ray knows neither now
    os.makedirs(run_dir / "checkpoint_9999-12-31_23-59-59.000000")  # partial, newest by name
    shutil.copy(run_dir / newest / CHECKPOINT_FILE, tmp_path / "whole.pt")
    with open(run_dir / newest / CHECKPOINT_FILE, "r+b") as f:
        f.truncate(os.path.getsize(run_dir / newest / CHECKPOINT_FILE) // 3)
    assert run_training(cfg) == 0
    assert [(e["epoch"], e["step"]) for e in events(run_dir, "resumed")] == [(1, 0)]
    assert [e["checkpoint"] for e in events(run_dir, "checkpoint_skipped")] == [newest]
    assert "bytes short" in events(run_dir, "checkpoint_skipped")[0]["error"]
    assert [r["epoch"] for r in _rows(cfg)] == [1, 2, 3]  # epoch 2 trained again, epoch 3 new


def test_every_checkpoint_damaged_is_one_error_and_exit_2(ray_cluster, trained_run, tmp_path):
    home = trained_run.copy_to(tmp_path)
    run_dir = home / "results" / "trained"
    for name in _checkpoints(run_dir):
        with open(run_dir / name / CHECKPOINT_FILE, "r+b") as f:
            f.truncate(1000)
    proc = run_cli("train", *trained_run.args, "--epochs", "3", cwd=home, env=ray_cluster.user_env())
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    line = one_error_line(proc.stderr)
    assert "none of this run's 2 checkpoint(s) verifies" in line and "--resume-from" in line
    assert len(strict_file(run_dir / "metrics.jsonl")) == 2  # nothing overwritten


def test_the_same_run_started_twice_is_refused_and_the_first_finishes(ray_cluster, tmp_path):
    """One writer per run folder: a second start of the same name while the first trains is
    refused in seconds, naming the first; the first finishes with each epoch once."""
    args = ["train", *tiny_args(tmp_path, "twice", "--num-workers", "1", "--epochs", "2")]
    hold = Hold(tmp_path).at(1, 1)  # the first held at its first step while the second starts
    first = Running(*args, env=ray_cluster.user_env(**hold.env))
    run_dir = tmp_path / "results" / "twice"
    first.wait_for(lambda: hold.waits_at(1, 1))
    second = run_cli(*args, env=ray_cluster.user_env(), timeout=120)
    hold.release()
    assert second.returncode == 2, (second.stdout + second.stderr)[-3000:]
    line = one_error_line(second.stderr)
    assert "is in use by another run" in line and f"pid {first.proc.pid}" in line
    print(f"\nsecond start refused: {line}")
    assert_refused_before_ray(second)
    assert first.finish() == 0, first.out[-3000:]
    assert [r["epoch"] for r in strict_file(run_dir / "metrics.jsonl")] == [1, 2]
    assert [e["epoch"] for e in events(run_dir, "epoch_start")] == [1, 2]


def test_a_stale_lease_is_taken_over_with_a_line(tmp_path, caplog):
    """A lease whose owner is gone (a killed driver on this host; a heartbeat older than the bound)
    does not block the run folder; a live one does."""
    import logging
    import subprocess

    from ray_job.storage import at
    from ray_job.storage.lease import STALE_S, Lease, Owner

    run_dir = at(str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    old = Owner("x", os.uname().nodename, dead.pid, "", time.time() - 5, time.time() - 5)
    far = Owner("y", "elsewhere", 1, "", time.time() - 2 * STALE_S, time.time() - 2 * STALE_S)
    for owner, why in ((old, "its process is gone"), (far, "its last heartbeat was")):
        run_dir.join(".lease.json").write_text(json.dumps(owner.__dict__))
        with caplog.at_level(logging.WARNING, logger="ray_job.lease"):
            lease = Lease(run_dir)
            lease.take()
        assert why in caplog.text and lease.current().id == lease.me.id
        lease.give_back()
        assert lease.current() is None
    live = Owner("z", "elsewhere", 1, "", time.time(), time.time())
    run_dir.join(".lease.json").write_text(json.dumps(live.__dict__))
    with pytest.raises(UsageError, match="in use by another run \\(pid 1 on elsewhere"):
        Lease(run_dir).take()

