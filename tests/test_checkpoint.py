"""Checkpoints are whole or refused: the manifest (size + SHA-256 of each file), written last and
only after the stored copy has its size, and verified on every load; and why loads never go through
Ray's shared download folder.

The cause of a stop checkpoint on S3 that could not be loaded (two workers on one node resuming):
Ray's `Checkpoint.as_directory()` downloads a remote checkpoint once per node into a folder named
after the checkpoint, and a process that comes after the first download has finished downloads it
again into the same folder -- truncating the file the first process is still reading.
`test_ray_shared_download_truncates_a_file_in_use` shows it with a slow store (no server needed);
the tests after it show that our own load path does not have it and names any damage.
"""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

import fsfaults
from ray_job.storage import Location, StorageError, at
from ray_job.train.checkpoint import (CHECKPOINT_FILE, MANIFEST_FILE, CheckpointError, load_checkpoint,
                                      save_checkpoint, training_state, write_checkpoint)


def state(epoch: int = 1, width: int = 1024) -> dict:
    """A small real training state (a width x width linear model: 4 MiB per 1024)."""
    model = torch.nn.Linear(width, width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return dict(model=model, optimizer=optimizer, epoch=epoch, step=0, config={}, metrics={})


def write(directory, epoch: int = 1, width: int = 1024) -> str:
    """A small real checkpoint in `directory`."""
    save_checkpoint(str(directory), **state(epoch, width))
    return str(directory)


def test_the_manifest_records_every_file(tmp_path):
    import hashlib
    import json

    write(tmp_path)
    manifest = json.loads((tmp_path / MANIFEST_FILE).read_text())
    data = (tmp_path / CHECKPOINT_FILE).read_bytes()
    assert manifest["files"] == {CHECKPOINT_FILE: {"bytes": len(data),
                                                   "sha256": hashlib.sha256(data).hexdigest()}}


def test_a_short_file_is_refused_naming_the_file_and_how_short(tmp_path):
    write(tmp_path)
    path = tmp_path / CHECKPOINT_FILE
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 3)  # a full disk, or a copy cut off
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(str(tmp_path))
    text = str(e.value)
    assert f"{CHECKPOINT_FILE} holds {size // 3} bytes, {size - size // 3} bytes short of the {size}" in text
    assert str(tmp_path) in text and "\n" not in text


def test_changed_bytes_of_the_right_size_fail_the_checksum(tmp_path):
    write(tmp_path)
    path = tmp_path / CHECKPOINT_FILE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="recorded size but not its recorded SHA-256"):
        load_checkpoint(str(tmp_path))


def test_a_checkpoint_written_before_manifests_still_loads(tmp_path):
    write(tmp_path, epoch=4)
    (tmp_path / MANIFEST_FILE).unlink()
    assert load_checkpoint(str(tmp_path))["epoch"] == 4


def test_a_store_that_keeps_a_short_copy_is_not_saved(tmp_path):
    """The store keeps fewer bytes than were sent (a cut-off multipart upload): the copy does not
    verify, it is removed, and nothing of it is left to be taken as a checkpoint."""
    dest = Location(fsfaults.short_writes(1000), str(tmp_path / "store" / "checkpoint_x"), "store://x")
    with pytest.raises(StorageError, match=r"does not verify: checkpoint.pt holds \d+ bytes, 1000 bytes short"):
        write_checkpoint(dest, training_state(**state()))
    assert not os.path.exists(tmp_path / "store" / "checkpoint_x")


def test_a_write_that_fails_midway_says_why_and_leaves_nothing(tmp_path):
    """The disk fills (or the connection drops) in the middle of the file: torch.save reports only
    "unexpected pos"; the store's own error is what the user reads, and the folder is removed."""
    dest = Location(fsfaults.full_after(2**20), str(tmp_path / "store" / "checkpoint_z"), "store://z")
    with pytest.raises(StorageError, match="No space left on device"):
        write_checkpoint(dest, training_state(**state()))
    assert not os.path.exists(tmp_path / "store" / "checkpoint_z")


def test_a_checkpoint_is_written_in_one_pass_and_the_manifest_comes_last(tmp_path):
    dest = at(str(tmp_path / "store" / "checkpoint_y"))
    order = fsfaults.write_order()
    nbytes = write_checkpoint(Location(order, dest.path, dest.uri), training_state(**state(epoch=2)))
    assert [os.path.basename(p) for p in order.handler.opened] == [CHECKPOINT_FILE, MANIFEST_FILE]
    assert sorted(os.listdir(dest.path)) == [CHECKPOINT_FILE, MANIFEST_FILE]
    assert nbytes == sum(os.path.getsize(os.path.join(dest.path, f)) for f in os.listdir(dest.path))
    assert load_checkpoint(dest)["epoch"] == 2


def _two_processes(target_a, args_a, target_b, args_b, results):
    a = multiprocessing.get_context("spawn").Process(target=target_a, args=args_a)
    b = multiprocessing.get_context("spawn").Process(target=target_b, args=args_b)
    a.start()
    b.start()
    try:
        return results.get(timeout=120)
    finally:
        a.join(60)
        b.join(60)


def test_ray_shared_download_truncates_a_file_in_use(tmp_path):
    """The cause (Ray 2.60): process A opens a remote checkpoint with as_directory(); process B
    opens the same checkpoint after A's download is done; while A still holds the folder, B's
    download rewrites the same file from zero. A reading then (torch.load) gets a short file."""
    from ray.train import Checkpoint

    write(tmp_path / "ckpt", width=1500)  # ~9 MiB: ~1 s to read from the slow store
    checkpoint = Checkpoint(path=str(tmp_path / "ckpt"), filesystem=fsfaults.slow(0.1))
    ctx = multiprocessing.get_context("spawn")
    got_it, done, results = ctx.Event(), ctx.Event(), ctx.Queue()
    first, smallest = _two_processes(fsfaults.watch_ray_download, (checkpoint, got_it, done, results),
                                     fsfaults.open_after, (checkpoint, got_it, done), results)
    print(f"\nfile of {first} bytes in A's download folder; smallest size A saw while B opened "
          f"the same checkpoint: {smallest}")
    assert smallest < first


def test_our_loads_in_two_processes_of_a_node_both_verify(tmp_path):
    """The same two processes and slow store through our load path: each reads its own bytes."""
    write(tmp_path / "ckpt", epoch=3, width=1500)
    where = Location(fsfaults.slow(0.05), str(tmp_path / "ckpt"), "slow://ckpt")
    results = multiprocessing.get_context("spawn").Queue()
    first = _two_processes(fsfaults.load_ours, (where, results), fsfaults.load_ours,
                           (where, results), results)
    assert first == 3 and results.get(timeout=120) == 3
