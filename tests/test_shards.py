"""Checkpoints of a sharded run (fully_shard on gloo ranks; DCP): every rank writes its own shards,
the manifest covers them all, and any world size gets the same full state back.

Two process groups are started for the whole module (each start costs seconds): two ranks train a
step of a small sharded CNN (`tiny`, a user's model as `--model test_shards:tiny` names it, with
odd sizes: uneven shards on 2 and 3 ranks) with AdamW, checkpoint it through the Checkpointer's asynchronous
protocol while training goes on, then synchronously; write to stores that fail; and load a DDP
checkpoint (the full state) into a sharded model. Three ranks load the two ranks' checkpoint. One
rank (a group of one, in this process) loads it too, and so does export, with no group at all.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsfaults
from ranks import run_ranks
from ray_job.config import TrainConfig
from ray_job.storage import Location, at, read_jsonl
from ray_job.train.checkpoint import (CHECKPOINT_FILE, MANIFEST_FILE, SHARDS_DIR, CheckpointError,
                                      load_checkpoint, restore_training_state, save_checkpoint)
from ray_job.train.checkpointer import Checkpointer, LocalReports
from ray_job.train.runlog import RunLog

CFG = dict(model="test_shards:tiny", code_dir=os.path.dirname(os.path.abspath(__file__)), data="synthetic")
CLASSES = [f"c{i}" for i in range(10)]
UNITS = 3


def tiny(num_classes: int) -> torch.nn.Module:
    """A small CNN: a stem, UNITS blocks (each one fully_shard unit), a head; BatchNorm buffers."""
    def block(c_in: int, c_out: int) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Conv2d(c_in, c_out, 3, padding=1), torch.nn.BatchNorm2d(c_out),
                                   torch.nn.ReLU())

    return torch.nn.Sequential(block(3, 7), *[block(7 + 6 * i, 13 + 6 * i) for i in range(UNITS)],
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(25, num_classes))


def model_and_optimizer(world: int, kind: str, sharded: bool = True):
    """`tiny`, built as the run builds it; each block and then the root fully_shard on a 1-D CPU
    mesh; the optimizer over two parameter groups, as the project builds it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ray_job.model import build_for
    from ray_job.model.parts import param_groups

    torch.manual_seed(0)
    model = build_for(TrainConfig(**CFG), len(CLASSES))
    if sharded:
        mesh = init_device_mesh("cpu", (world,))
        for unit in list(model)[1:1 + UNITS]:
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
    groups = param_groups(model, 0.05, decay_norm_bias=False)
    optimizer = (torch.optim.AdamW(groups, lr=1e-3) if kind == "adamw" else
                 torch.optim.SGD(groups, lr=0.1, momentum=0.9))
    return model, optimizer


def train_step(model, optimizer, seed: int = 1) -> None:
    """The same batch on every rank, so that the BatchNorm statistics (not sharded) agree."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def full_state(model, optimizer) -> dict:
    """The model's and the optimizer's full state, gathered onto rank 0's CPU (empty elsewhere); a
    copy (the CPU "offload" of a buffer is the live buffer itself)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return copy.deepcopy({"model": get_model_state_dict(model, options=options),
                          "optim": get_optimizer_state_dict(model, optimizer, options=options)})


def differences(a, b, where: str = "") -> list[str]:
    """Where two nested states differ (tensors exactly)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(set(a) ^ set(b), key=str)[:4]}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: {len(a)} vs {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    if torch.is_tensor(a) or torch.is_tensor(b):
        ok = torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b)
        return [] if ok else [where]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def state_fn(model, optimizer, world: int, epoch: int):
    return lambda: dict(model=model, optimizer=optimizer, epoch=epoch, step=0, config=TrainConfig(**CFG).to_dict(),
                        metrics={"test_acc": 0.5}, world_size=world, classes=CLASSES)


def two_ranks(rank: int, world: int, tmp: str) -> dict:
    """Checkpoints of a sharded model: asynchronous (training goes on meanwhile), then final; stores
    that fail; and a DDP checkpoint loaded into a sharded model. Rank 0 saves the full states."""
    torch.set_num_threads(1)
    master = rank == 0
    model, optimizer = model_and_optimizer(world, "adamw")
    train_step(model, optimizer)
    store = at(os.path.join(tmp, "run"))
    reports = LocalReports()
    ckpt = Checkpointer(store, reports.link(), master, RunLog(store) if master else None, 0.0, asynchronous=True)
    ckpt.save(state_fn(model, optimizer, world, epoch=1), {"epoch": 1})
    saved_first = full_state(model, optimizer)
    train_step(model, optimizer, seed=2)  # while the shards are written: the checkpoint keeps its copy
    ckpt.wait_for_upload()
    over, busy = ckpt.upload_over(), ckpt.busy()
    ckpt.report_saved()
    assert ckpt.save(state_fn(model, optimizer, world, epoch=2), {"epoch": 2}, final=True) is None
    failed = [failing_save(store, fs, model, optimizer, world, master) for fs in
              (fsfaults.short_writes(100), fsfaults.full_after(10_000))]
    ddp_differences = ddp_checkpoint_into_sharded(rank, world, os.path.join(tmp, "ddp"))
    if master:
        torch.save({"first": saved_first, "second": full_state(model, optimizer)}, os.path.join(tmp, "states.pt"))
    else:
        full_state(model, optimizer)  # a collective
    return dict(calls=reports.calls, over=over, busy=busy, failed=failed, ddp=ddp_differences)


def failing_save(store: Location, fs, model, optimizer, world: int, master: bool):
    """A final checkpoint to a store that keeps short copies or fills up: (its error, what is left)."""
    bad = Location(fs, store.path, "faulty://run")
    ckpt = Checkpointer(bad, LocalReports().link(), master, RunLog(store) if master else None, 0.0)
    error = ckpt.save(state_fn(model, optimizer, world, epoch=3), {"epoch": 3}, final=True)
    dist.barrier()
    return error, sorted(os.listdir(store.path))


def ddp_checkpoint_into_sharded(rank: int, world: int, folder: str) -> list[str]:
    """A DDP run's checkpoint (checkpoint.pt, the full state) continues under fully_shard."""
    plain, plain_optimizer = model_and_optimizer(world, "sgd", sharded=False)
    train_step(plain, plain_optimizer)
    if rank == 0:
        save_checkpoint(folder, model=plain, optimizer=plain_optimizer, epoch=1, step=0, config={}, metrics={})
    dist.barrier()
    model, optimizer = model_and_optimizer(world, "sgd")
    restore_training_state(load_checkpoint(folder), model=model, optimizer=optimizer)
    got, want = full_state(model, optimizer), full_state(plain, plain_optimizer)
    train_step(model, optimizer)  # and it trains on
    return differences(got, want)


def load_on(rank: int, world: int, folder: str, out: str) -> None:
    """A fresh sharded model on `world` ranks, restored from `folder`; rank 0 saves its full state."""
    torch.set_num_threads(1)
    model, optimizer = model_and_optimizer(world, "adamw")
    restore_training_state(load_checkpoint(folder), model=model, optimizer=optimizer)
    state = full_state(model, optimizer)
    if rank == 0:
        torch.save(state, out)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("shards")
    result = run_ranks(two_ranks, str(tmp), world=2)[0]
    states = torch.load(tmp / "states.pt", weights_only=False)
    run = tmp / "run"
    folders = sorted(d for d in os.listdir(run) if d.startswith("checkpoint_"))
    return dict(result, states=states, run=run, folders=folders, tmp=tmp)


def test_an_async_sharded_checkpoint_is_reported_once_every_rank_has_written(saved):
    assert saved["over"] and saved["busy"]  # over, and waiting for its report
    (first, _), (second, _) = [(m, p) for m, p in saved["calls"]]
    assert first == {"epoch": 1} and second == {"epoch": 2}
    paths = [p for _, p in saved["calls"]]
    assert [os.path.basename(p) for p in paths] == saved["folders"][:2]
    events = read_jsonl(at(str(saved["run"])).join("events.jsonl"))
    assert [(e["event"], e.get("epoch")) for e in events] == [
        ("checkpoint_saved", 1), ("checkpoint_saved", 2), ("checkpoint_failed", 3), ("checkpoint_failed", 3)]
    state = load_checkpoint(paths[0])
    assert (state["epoch"], state["world_size"], state["shards"]) == (1, 2, SHARDS_DIR)


def test_the_manifest_lists_every_shard_file_of_every_rank(saved):
    folder = saved["run"] / saved["folders"][0]
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    on_disk = {CHECKPOINT_FILE} | {f"{SHARDS_DIR}/{n}" for n in os.listdir(folder / SHARDS_DIR)}
    assert set(manifest["files"]) == on_disk == {CHECKPOINT_FILE, f"{SHARDS_DIR}/.metadata",
                                                 f"{SHARDS_DIR}/__0_0.distcp", f"{SHARDS_DIR}/__1_0.distcp"}
    for name, recorded in manifest["files"].items():
        data = (folder / name).read_bytes()
        assert recorded == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert not (folder / "model").exists() and torch.load(folder / CHECKPOINT_FILE).get("model") is None


def test_a_failed_shard_write_is_every_ranks_error_and_leaves_nothing(saved):
    short, full = saved["failed"]
    assert "__0_0.distcp holds" in short[0] or "__1_0.distcp holds" in short[0]
    assert "rank" in full[0] and "No space left on device" in full[0]
    for _, left in (short, full):
        assert [d for d in left if d.startswith("checkpoint_")] == saved["folders"]  # the two good ones only


def test_two_ranks_checkpoint_loads_on_three_ranks_and_on_one_to_the_same_state(saved, tmp_path):
    folder = str(saved["run"] / saved["folders"][0])
    run_ranks(load_on, folder, str(tmp_path / "three.pt"), world=3)
    assert differences(torch.load(tmp_path / "three.pt", weights_only=False), saved["states"]["first"]) == []
    in_a_group_of_one(load_on, folder, str(tmp_path / "one.pt"))
    assert differences(torch.load(tmp_path / "one.pt", weights_only=False), saved["states"]["first"]) == []
    assert differences(saved["states"]["first"], saved["states"]["second"])  # the steps after it changed it


def in_a_group_of_one(target, *args) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        target(0, 1, *args)
    finally:
        dist.destroy_process_group()


def test_a_ddp_checkpoint_continues_under_fully_shard(saved):
    assert saved["ddp"] == []


def test_export_loads_a_sharded_checkpoint_without_a_process_group(saved):
    from ray_job.train.trained import trained_model

    assert not dist.is_initialized()
    trained = trained_model(str(saved["run"] / saved["folders"][1]))
    assert trained.classes == tuple(CLASSES) and trained.epoch == 2 and not trained.model.training
    assert differences(trained.model.state_dict(), saved["states"]["second"]["model"]) == []


def damaged_copy(saved, tmp_path, name: str, damage) -> tuple[Location, list[str]]:
    run = tmp_path / "run"
    shutil.copytree(saved["run"], run)
    path = run / saved["folders"][1] / name
    damage(path)
    return at(str(run)), saved["folders"][:2]


def cut(path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1000)


def flip(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_shard_cut_short_is_named_and_resume_falls_back_to_the_previous_checkpoint(saved, tmp_path):
    store, (older, newest) = damaged_copy(saved, tmp_path, f"{SHARDS_DIR}/__1_0.distcp", cut)
    size = os.path.getsize(os.path.join(store.path, newest, SHARDS_DIR, "__1_0.distcp"))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(store.join(newest))
    assert (f"checkpoint {store.join(newest).uri} is damaged: {SHARDS_DIR}/__1_0.distcp holds {size} bytes, "
            f"1000 bytes short of the {size + 1000} recorded") in str(e.value)
    ckpt = Checkpointer(store, LocalReports().link(), True, RunLog(store), 0.0)
    name, state = ckpt.choose(recorded=newest)
    assert (name, state["epoch"]) == (older, 1)
    skipped = [e for e in read_jsonl(store.join("events.jsonl")) if e["event"] == "checkpoint_skipped"]
    assert [e["checkpoint"] for e in skipped] == [newest] and "__1_0.distcp holds" in skipped[0]["error"]


def test_a_changed_byte_in_a_shard_or_its_metadata_is_named(saved, tmp_path):
    for name in (f"{SHARDS_DIR}/__0_0.distcp", f"{SHARDS_DIR}/.metadata"):
        store, (_, newest) = damaged_copy(saved, tmp_path / name.replace("/", "_"), name, flip)
        with pytest.raises(CheckpointError, match=f"{name} has its recorded size but not its recorded SHA-256"):
            load_checkpoint(store.join(newest))


def test_a_shard_file_the_manifest_does_not_list_is_refused(saved, tmp_path):
    store, (_, newest) = damaged_copy(saved, tmp_path, f"{SHARDS_DIR}/__2_0.distcp",
                                      lambda path: path.write_bytes(b"stray"))
    with pytest.raises(CheckpointError, match=f"{SHARDS_DIR}/__2_0.distcp is not in its {MANIFEST_FILE}"):
        load_checkpoint(store.join(newest))


def test_a_sharded_checkpoint_without_its_manifest_is_incomplete(saved, tmp_path):
    store, (_, newest) = damaged_copy(saved, tmp_path, MANIFEST_FILE, os.remove)
    with pytest.raises(CheckpointError, match="its save never finished"):
        load_checkpoint(store.join(newest))


def save_and_load_on_s3(rank: int, world: int, dest: Location) -> tuple:
    """A group of one: a sharded model checkpointed into the bucket, then loaded back from it."""
    model, optimizer = model_and_optimizer(world, "adamw")
    train_step(model, optimizer)
    reports = LocalReports()
    ckpt = Checkpointer(dest, reports.link(), True, RunLog(dest), 0.0)
    assert ckpt.save(state_fn(model, optimizer, world, epoch=1), {"epoch": 1}, final=True) is None
    name, state = ckpt.choose(recorded=None)  # every file of its manifest verified, from the bucket
    fresh, fresh_optimizer = model_and_optimizer(world, "adamw")
    restore_training_state(state, model=fresh, optimizer=fresh_optimizer)
    return name, differences(full_state(fresh, fresh_optimizer), full_state(model, optimizer))


def test_a_sharded_checkpoint_on_s3_is_written_verified_and_loaded(s3):
    dest = Location(s3.client(), f"{s3.bucket}/shards/run", s3.uri("shards/run"))
    dest.makedirs()
    name, different = None, None

    def keep(rank, world, where):
        nonlocal name, different
        name, different = save_and_load_on_s3(rank, world, where)

    in_a_group_of_one(keep, dest)
    assert different == []
    keys = s3.keys(f"shards/run/{name}")
    manifest = json.loads(s3.read(f"shards/run/{name}/{MANIFEST_FILE}"))
    assert sorted(manifest["files"]) == sorted(k for k in keys if k != MANIFEST_FILE) == [
        CHECKPOINT_FILE, f"{SHARDS_DIR}/.metadata", f"{SHARDS_DIR}/__0_0.distcp"]
    from ray_job.train.trained import trained_model

    assert trained_model(dest.join(name)).epoch == 1  # export's load, with no process group
