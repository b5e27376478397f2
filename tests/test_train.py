"""The training job end to end on a real local Ray cluster (gloo, CPU, tiny sizes)."""

import json
import os

import pytest
import torch

from ray_job.train.checkpoint import load_checkpoint
from ray_job.config import parse_train_args
from ray_job.core.errors import UsageError
from ray_job.data.arrays import ArrayDataset
from ray_job.data.augment import DeviceAugment
from ray_job.data.synthetic import make_synthetic
from ray_job.train.engine import evaluate
from ray_job.train.driver import run_training
from ray_job.model.resnet import build_model
from ray_job.storage import read_jsonl
from ray_job.train.runfiles import STOP_FILE

from conftest import tiny_args

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]


def _train(tmp_path, name, *extra):
    cfg = parse_train_args(tiny_args(tmp_path, name, *extra))
    return cfg, run_training(cfg)


def _rows(cfg):
    return read_jsonl(os.path.join(cfg.run_dir(), "metrics.jsonl"))


def test_two_workers_learn_then_resume_continues_the_epoch_count(ray_joined, tmp_path, capsys):
    cfg, rc = _train(tmp_path, "two", "--num-workers", "2", "--epochs", "2")
    assert rc == 0
    rows = _rows(cfg)
    assert [r["epoch"] for r in rows] == [1, 2] and rows[0]["world_size"] == 2
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert rows[-1]["test_acc"] > 0.3  # chance is 0.1
    assert rows[0]["test_images"] == 256 and rows[0]["train_images"] == 512  # every image once
    for key in ("data_s", "compute_s", "images_per_s", "lr", "epoch_s", "train_acc", "test_loss"):
        assert key in rows[0]
    run_dir = cfg.run_dir()
    topo = json.load(open(os.path.join(run_dir, "topology.json")))
    assert topo["world_size"] == 2 and topo["backend"] == "gloo"
    assert os.listdir(os.path.join(run_dir, "tensorboard"))
    assert "epoch" in open(os.path.join(run_dir, "metrics.csv")).readline()
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["finished"] and summary["best_checkpoint"]
    assert "best checkpoint" in capsys.readouterr().out

    # Same name and storage: already finished -> says so, exit 0, nothing retrained.
    assert run_training(cfg) == 0
    assert "already finished" in capsys.readouterr().out and len(_rows(cfg)) == 2

    # More epochs on the same name: continues at epoch 3 with the LR schedule's position kept.
    more, rc = _train(tmp_path, "two", "--num-workers", "2", "--epochs", "3")
    assert rc == 0
    rows = _rows(more)
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    starts = [e["epoch"] for e in read_jsonl(os.path.join(run_dir, "events.jsonl"))
              if e["event"] == "epoch_start"]
    assert starts == [1, 2, 3]  # epochs 1-2 were not retrained
    assert any(e["event"] == "resumed" and e["epoch"] == 2
               for e in read_jsonl(os.path.join(run_dir, "events.jsonl")))


def test_global_accuracy_equals_single_process_evaluation(ray_joined, tmp_path):
    cfg, rc = _train(tmp_path, "acc", "--num-workers", "2", "--epochs", "1",
                     "--synthetic-test-size", "203")  # odd size: padding would double-count
    assert rc == 0
    reported = _rows(cfg)[-1]
    summary = json.load(open(os.path.join(cfg.run_dir(), "summary.json")))
    state = load_checkpoint(summary["latest_checkpoint"])
    model = build_model(cfg.model, cfg.stem, 10)
    model.load_state_dict(state["model"])
    test = ArrayDataset(make_synthetic(203, cfg.seed, False))
    loader = torch.utils.data.DataLoader(test, batch_size=64, collate_fn=test.collate_fn)
    single = evaluate(model, loader, torch.nn.CrossEntropyLoss(), DeviceAugment(torch.device("cpu"), False),
                      torch.device("cpu"))
    assert reported["test_images"] == single.count == 203
    assert reported["test_acc"] == pytest.approx(single.correct / single.count, abs=1e-9)
    assert reported["test_loss"] == pytest.approx(single.loss_sum / single.count, rel=1e-4)


def test_checkpoint_moves_across_world_sizes(ray_joined, tmp_path):
    cfg, rc = _train(tmp_path, "src", "--num-workers", "2", "--epochs", "1")
    assert rc == 0
    ckpt = json.load(open(os.path.join(cfg.run_dir(), "summary.json")))["latest_checkpoint"]
    new, rc = _train(tmp_path, "dst", "--num-workers", "1", "--epochs", "2", "--resume-from", ckpt,
                     "--loader", "torchvision")  # the classic PIL path trains too
    assert rc == 0
    rows = _rows(new)
    assert [r["epoch"] for r in rows] == [2] and rows[0]["world_size"] == 1
    back, rc = _train(tmp_path, "back", "--num-workers", "2", "--epochs", "3", "--resume-from",
                      json.load(open(os.path.join(new.run_dir(), "summary.json")))["latest_checkpoint"])
    assert rc == 0 and [r["epoch"] for r in _rows(back)] == [3]


def test_preemption_request_checkpoints_mid_epoch_and_resumes(ray_joined, tmp_path):
    name = "pre"
    run_dir = tmp_path / "results" / name
    run_dir.mkdir(parents=True)
    # The request exists before training starts but after the driver's stale-file cleanup,
    # so plant it from a thread once the first epoch starts.
    import threading
    import time

    def plant():
        deadline = time.time() + 300
        while time.time() < deadline and not (run_dir / "events.jsonl").exists():
            time.sleep(0.2)
        (run_dir / STOP_FILE).write_text("test")

    t = threading.Thread(target=plant, daemon=True)
    t.start()
    cfg, rc = _train(tmp_path, name, "--num-workers", "2", "--epochs", "2")
    t.join()
    assert rc == 3  # stopped on request
    state_dir = json.load(open(run_dir / "summary.json"))["latest_checkpoint"]
    state = load_checkpoint(state_dir)
    assert state["epoch"] == 0 and state["step"] > 0
    assert not json.load(open(run_dir / "summary.json"))["finished"]
    cfg, rc = _train(tmp_path, name, "--num-workers", "2", "--epochs", "2")
    assert rc == 0 and [r["epoch"] for r in _rows(cfg)] == [1, 2]
    resumed = [e for e in read_jsonl(str(run_dir / "events.jsonl")) if e["event"] == "resumed"]
    assert resumed and resumed[0]["step"] == state["step"]  # continued at the exact step


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
    cfg, rc = _train(tmp_path, "timed", "--num-workers", "4", "--min-workers", "1", "--epochs", "1",
                     "--checkpoint-every-min", "0.002", "--keep-checkpoints", "1")
    assert rc == 0
    assert [r["world_size"] for r in _rows(cfg)] == [2]
    saved = [e for e in read_jsonl(os.path.join(cfg.run_dir(), "events.jsonl"))
             if e["event"] == "checkpoint_saved"]
    timed = [e["step"] for e in saved if e["step"] > 0]
    assert timed and all(s % 5 == 2 for s in timed), saved  # at a poll's answer, mid-epoch
    assert (saved[-1]["epoch"], saved[-1]["step"]) == (1, 0)  # and the epoch's own at its end
    kept = [d for d in os.listdir(cfg.run_dir()) if d.startswith("checkpoint_")]
    assert 1 <= len(kept) <= 2, kept  # --keep-checkpoints 1 best, plus the latest
    with pytest.raises(UsageError, match="--min-workers 3 is more than --num-workers 2"):
        _train(tmp_path, "bad", "--num-workers", "2", "--min-workers", "3")


def test_a_checkpoint_ray_has_no_record_of_is_resumed_from(ray_joined, tmp_path):
    """The driver killed right after rank 0 saved a checkpoint: Ray's record (its snapshot) misses
    it, yet it is complete (its checkpoint_saved event follows the upload), so the rerun takes it.
    A newer folder without that event (an upload cut off) is not taken."""
    cfg, rc = _train(tmp_path, "norecord", "--num-workers", "2", "--epochs", "1")
    assert rc == 0
    run_dir = cfg.run_dir()
    os.remove(os.path.join(run_dir, "checkpoint_manager_snapshot.json"))
    os.makedirs(os.path.join(run_dir, "checkpoint_9999-12-31_23-59-59.000000"))  # partial, newest
    more, rc = _train(tmp_path, "norecord", "--num-workers", "2", "--epochs", "2")
    assert rc == 0
    resumed = [e for e in read_jsonl(os.path.join(run_dir, "events.jsonl")) if e["event"] == "resumed"]
    assert [(e["epoch"], e["step"]) for e in resumed] == [(1, 0)]
    assert [r["epoch"] for r in _rows(more)] == [1, 2]
