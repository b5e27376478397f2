"""The worker's training loop without Ray (ray_job/train/worker.py from `train_run` down): two gloo
ranks, the model and loaders placed by hand, Ray's two calls a LocalReports. Every rank reports at
the same step -- a background upload once it is over, the checkpoints of a stop and of an epoch's
end -- rank 0 alone writes, and a stop mid-epoch is where the same run continues."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from ranks import run_ranks
from ray_job.config import TrainConfig
from ray_job.data.datasets import load_datasets
from ray_job.model import zoo
from ray_job.storage import at, read_jsonl
from ray_job.train import stop
from ray_job.train.build import Placement, Worker, build_run
from ray_job.train.checkpointer import UNSCORED, Checkpointer, LocalReports, RayLink, Resume
from ray_job.train.engine import Step
from ray_job.train.progress import Progress, hms
from ray_job.train.runlog import RunLog
from ray_job.train.worker import train_run

pytestmark = pytest.mark.timeout(600)

STEPS = 10  # per epoch: 2 ranks x 32 images x 10 steps
# the suite's tiny ViT (conftest.TINY_MODEL): checkpoints of a few hundred KB; the loop is the same for any model
VIT = dict(model="VisionTransformer", stem="auto", model_arg=("patch_size=8", "num_layers=2", "num_heads=2",
                                                              "hidden_dim=32", "mlp_dim=64"))


def _by_hand(world: int) -> Placement:
    """What Ray's prepare_model / prepare_data_loader do, by hand: DDP, a DistributedSampler."""
    def loader(plain: DataLoader, shard: bool) -> DataLoader:
        if not shard:
            return plain
        return DataLoader(plain.dataset, batch_size=plain.batch_size, sampler=DistributedSampler(plain.dataset),
                          drop_last=True, collate_fn=plain.collate_fn)

    return Placement(lambda model, **ddp: torch.nn.parallel.DistributedDataParallel(model, **ddp), loader)


def _rank(rank: int, world: int, run_dir: str, extra: dict):
    """One rank of a run in `run_dir` (continued from its newest checkpoint): the outcome, and each
    report as (optimizer steps done when it was made, metrics, path)."""
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    cfg = TrainConfig(**{**dict(data="synthetic", **VIT, synthetic_test_size=64,
                                synthetic_train_size=2 * 32 * STEPS, batch_size=64, epochs=2, log_every=0,
                                progress="lines"), **extra})
    worker, store = Worker(rank, world), at(run_dir)
    files = RunLog(store) if worker.master_process else None
    calls, runs = [], []

    def report(metrics: dict, path) -> None:
        calls.append((runs[0].scheduler.last_epoch, metrics, path))

    link = RayLink(LocalReports().link().new_dir_name, report)
    checkpointer = Checkpointer(store, link, worker.master_process, files, 5.0, asynchronous=True)
    chosen = [checkpointer.choose(None)[0] if worker.master_process else None]
    dist.broadcast_object_list(chosen, src=0)  # what resume_state does, Ray's record aside
    resume = checkpointer.resume(chosen[0], None, "", cfg.global_batch, world) if chosen[0] else Resume()
    runs.append(build_run(cfg, load_datasets(cfg), resume, worker, store, files, _by_hand(world)))
    return train_run(runs[0], resume, checkpointer), calls


def _events(run_dir, name: str) -> list[dict]:
    return [e for e in read_jsonl(at(str(run_dir)).join("events.jsonl")) if e["event"] == name]


def test_every_rank_reports_each_checkpoint_at_the_same_step_once_its_upload_is_over(tmp_path):
    """Timed checkpoints as often as they can be (one only while no upload is in flight), written in
    the background: each is reported once, by every rank at the same step, with its own metrics."""
    (out0, calls0), (out1, calls1) = run_ranks(_rank, str(tmp_path), {"checkpoint_every_min": 1e-6})
    assert out0 == out1 == {"preempted": False, "epoch": 2}
    assert [c[0] for c in calls0] == [c[0] for c in calls1]  # the same optimizer step on every rank
    assert all(path is None for _, _, path in calls1)  # rank 0 alone writes
    saved = _events(tmp_path, "checkpoint_saved")
    reported = [(m["epoch"], m["step"] if "train_loss" not in m else 0, path) for _, m, path in calls0]
    assert [(e["epoch"], e["step"], e["checkpoint"]) for e in saved] == [
        (epoch, step, path.rsplit("/", 1)[-1]) for epoch, step, path in reported]
    timed = [m for _, m, _ in calls0 if "train_loss" not in m]
    assert timed and all(m["test_acc"] == UNSCORED and not m["preempted"] and m["step"] % 5 == 2 for m in timed)
    # each epoch's own, with its metrics: the first once its upload is over, the final one at the end
    assert [m["epoch"] for _, m, _ in calls0 if "train_loss" in m] == [1, 2] and calls0[-1][0] == 2 * STEPS
    assert [r["epoch"] for r in read_jsonl(at(str(tmp_path)).join("metrics.jsonl"))] == [1, 2]


def test_a_stop_checkpoints_at_the_same_step_on_every_rank_and_the_run_continues_there(tmp_path):
    stop.request(str(tmp_path))  # before the first step: the first poll (step 5) answers at step 7
    (out0, calls0), (out1, calls1) = run_ranks(_rank, str(tmp_path), {})
    assert out0 == out1 == {"preempted": True, "epoch": 0, "step": 7}
    assert [c[0] for c in calls0] == [c[0] for c in calls1] == [7]  # one report: the stop's checkpoint
    ((_, metrics, path),) = calls0
    assert metrics == {"epoch": 0, "step": 7, "preempted": True, "test_acc": UNSCORED} and path
    assert [(e["epoch"], e["step"]) for e in _events(tmp_path, "checkpoint_saved")] == [(0, 7)]
    stop.clear(str(tmp_path))
    (out0, calls0), (out1, _) = run_ranks(_rank, str(tmp_path), {})  # the same run again
    assert out0 == out1 == {"preempted": False, "epoch": 2}
    assert [(e["epoch"], e["step"]) for e in _events(tmp_path, "epoch_start")] == [(1, 0), (1, 7), (2, 0)]
    assert len(calls0) == 2 and calls0[-1][0] == 2 * STEPS  # 3 steps after step 7, then 10: the schedule went on
    assert [r["epoch"] for r in read_jsonl(at(str(tmp_path)).join("metrics.jsonl"))] == [1, 2]


def test_fsdp_stops_on_two_ranks_continues_on_one_at_the_same_step_and_then_under_ddp(tmp_path):
    """--strategy fsdp: every rank writes its shards of the stop's checkpoint; one rank continues at
    its step (the same global batch of 64) to the epoch's end, and a DDP run goes on from its shards."""
    run_dir = str(tmp_path)
    stop.request(run_dir)
    (out0, calls0), (out1, calls1) = run_ranks(_rank, run_dir, {"strategy": "fsdp", "epochs": 1})
    assert out0 == out1 == {"preempted": True, "epoch": 0, "step": 7}
    path = calls0[-1][2]
    assert calls1[-1][2] is None and path  # reported by rank 0, once every rank's shards are written
    files = json.loads(at(path).join("manifest.json").read_text())["files"]
    assert sorted(f for f in files if f.endswith(".distcp")) == ["shards/__0_0.distcp", "shards/__1_0.distcp"]
    [memory] = _events(tmp_path, "first_step_memory")
    whole = 4 * sum(p.numel() for p in zoo.build(TrainConfig(**VIT), 10).parameters())
    # rank 0's half of the ViT, and a little: its class token and position embedding (one row) are not split
    assert whole * 0.45 < memory["params_bytes"] < whole * 0.55, (memory, whole)
    stop.clear(run_dir)
    [(out, _)] = run_ranks(_rank, run_dir, {"strategy": "fsdp", "epochs": 1}, world=1)
    assert out == {"preempted": False, "epoch": 1}
    resumed = _events(tmp_path, "resumed")
    assert [(e["epoch"], e["step"], e["world_size"]) for e in resumed] == [(0, 7, 1)]
    (out0, _), _ = run_ranks(_rank, run_dir, {})  # ddp, from the shards of one rank
    assert out0 == {"preempted": False, "epoch": 2}
    assert [(e["epoch"], e["step"]) for e in _events(tmp_path, "epoch_start")] == [(1, 0), (1, 7), (2, 0)]
    assert [r["epoch"] for r in read_jsonl(at(run_dir).join("metrics.jsonl"))] == [1, 2]


@pytest.mark.parametrize("model", [
    dict(model="VisionTransformer", model_arg=("patch_size=4", "num_layers=2", "num_heads=2", "hidden_dim=32",
                                               "mlp_dim=64")),
    dict(model="convnext_tiny"),
    dict(model="./my_model.py:small_cnn", model_arg=("width=8",)),  # the user's own (docs/models.md)
])
def test_a_vit_a_convnext_and_the_users_own_model_go_through_the_same_loop(tmp_path, model):
    """Any model trains in the worker loop as a ResNet does: DDP over two ranks, its optimizer,
    evaluation, a checkpoint that names its classes; the run goes on from it."""
    from test_models import user_model_file

    user_model_file(tmp_path)
    extra = dict(stem="auto", epochs=1, steps_per_epoch=3, code_dir=str(tmp_path), **model)
    (out0, calls0), (out1, _) = run_ranks(_rank, str(tmp_path / "run"), extra)
    assert out0 == out1 == {"preempted": False, "epoch": 1}
    [row] = read_jsonl(at(str(tmp_path / "run")).join("metrics.jsonl"))
    assert row["steps"] == 3 and 0 < row["train_loss"] < 10 and 0 <= row["test_acc"] <= 1
    state = torch.load(calls0[-1][2] + "/checkpoint.pt", map_location="cpu", weights_only=True)
    assert state["config"]["model"] == model["model"] and len(state["classes"]) == 10
    optimizer = "adamw" if model["model"] == "VisionTransformer" else "sgd"
    assert ("betas" in state["optimizer"]["param_groups"][0]) == (optimizer == "adamw")


def test_progress_lines_every_n_steps_with_speed_and_eta(caplog):
    logger = logging.getLogger("ray_job")
    logger.propagate, logger.level = True, logging.INFO
    p = Progress("lines", epochs=3, steps=10, global_batch=64, log_every=4, every_s=3600)
    p.start_epoch(0, 0, None)
    with caplog.at_level(logging.INFO, logger="ray_job"):
        for step in range(1, 11):
            p.on_step(Step(step, torch.tensor(2.0 - step / 10), 0.001, 0.01))
    lines = [r.getMessage() for r in caplog.records if "Step [" in r.getMessage()]
    assert [line.split("Step [")[1].split("]")[0] for line in lines] == ["1/10", "4/10", "8/10", "10/10"]
    assert all("Epoch [1/3]" in line and "img/s" in line and "ETA epoch" in line and ", run " in line
               for line in lines)
    assert "Loss: 1.9000" in lines[0] and "data 1.0 ms, train 10.0 ms" in lines[0]
    assert hms(3725) == "1:02:05" and hms(65) == "1:05"
    quiet = Progress("lines", 1, 10, 64, log_every=0)
    quiet.start_epoch(0, 0, None)
    with caplog.at_level(logging.INFO, logger="ray_job"):
        caplog.clear()
        quiet.on_step(Step(1, torch.tensor(1.0), 0.0, 0.0))
    assert not caplog.records  # --log-every 0: epoch lines only
