"""Every checkpoint of a run: saving it, finding the newest complete one, resuming from it.

Saving (rank 0 writes, every rank reports: Ray's report is a barrier): the state is written into its
folder and verified there, manifest last (checkpoint.py), recorded as `checkpoint_saved` in
events.jsonl, and only then reported to Ray -- so a partial checkpoint is never the latest. One that
cannot be saved (storage unreachable, disk full) is logged as `checkpoint_failed` and skipped, and
training goes on; the `final` one (end of the run, a stop request) is retried for --retry-storage-s.

Asynchronously, the step waits only for a `Snapshot` in host memory (pinned for a GPU's tensors,
copied without blocking the stream; the upload thread waits on an event), so the GPU's queue never
drains and the next optimizer step cannot change what is saved. The copy reuses the previous
snapshot's tensors where they match: allocating and faulting in a model-sized buffer per checkpoint
cost ~10x the copy itself (0.28 s vs 0.03 s for ResNet-50 with its momentum on the CPU), pinning
more still. At most one upload is in flight, and one snapshot held besides the live state.

A sharded model (fully_shard) is saved by every rank: each writes its own shards (DCP, shards.py)
from its own host copy, in its own thread, and rank 0 writes checkpoint.pt and the manifest once
every rank has sent the figures of its files; rank 0's upload is over only then, so the protocol
(busy, upload_over, report_saved at the same step on every rank) holds as it is.

Resuming: rank 0 takes the newest of this run's complete checkpoints (their `checkpoint_saved` event,
or Ray's record) that verifies, passing over damaged ones (`checkpoint_skipped`); every rank loads
that one. Without any, `--resume-from`; without that, a fresh start. Every checkpoint damaged is bad
input (exit 2), never a silent restart from scratch. Retention is Ray's (by SCORE_METRIC).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import storage
from ..model.sharding import is_sharded
from ..storage import Location, StorageError
from .checkpoint import (CHECKPOINT_FILE, CheckpointError, load_checkpoint, sharded_state, training_state,
                         write_checkpoint, write_sharded_checkpoint)
from .runfiles import CHECKPOINT_PREFIX, EVENTS_JSONL, Event
from .runlog import RunLog

log = logging.getLogger("ray_job")

# What ranks checkpoints for retention (Ray's CheckpointConfig) and for the best one: each epoch's
# test accuracy, highest first. A checkpoint taken mid-epoch has none: it reports UNSCORED, below
# any accuracy, so it is kept only as the latest, never as the best.
SCORE_METRIC, SCORE_ORDER = "test_acc", "max"
UNSCORED = -1.0


@dataclass
class Resume:
    epoch: int = 0           # finished epochs
    step: int = 0            # steps already done in the next epoch
    state: Optional[dict] = None


@dataclass(frozen=True)
class RayLink:
    """The two things the checkpointer needs from Ray Train (injected, so tests need no Ray):
    a new checkpoint folder name, and `report(metrics, path or None)` -- every rank, same count."""

    new_dir_name: Callable[[], str]
    report: Callable[[dict, Optional[str]], None]


_NAMES = itertools.count(1)  # in time order within a process, even within one second


class LocalReports:
    """A RayLink without Ray (`bench checkpoints`, tests): folder names as Ray makes them, in time
    order, and every report kept in `calls` as (metrics, path or None)."""

    def __init__(self):
        self.calls: list[tuple[dict, Optional[str]]] = []

    def link(self) -> RayLink:
        def new_dir_name() -> str:
            return time.strftime(f"{CHECKPOINT_PREFIX}%Y-%m-%d_%H-%M-%S.") + f"{next(_NAMES):06d}"

        return RayLink(new_dir_name, lambda metrics, path: self.calls.append((metrics, path)))


def where(epoch: int, step: int) -> str:
    """A checkpoint's position in words (`epoch` counts finished epochs)."""
    return f"epoch {epoch + 1} step {step}" if step else f"the end of epoch {epoch}"


def saved_checkpoints(store: Location) -> list[str]:
    """This run's checkpoint folders that rank 0 finished writing (their checkpoint_saved event
    follows the verified upload) and that are still there, oldest first."""
    try:
        names = [e["checkpoint"] for e in storage.read_jsonl(store.join(EVENTS_JSONL))
                 if e.get("event") == Event.CHECKPOINT_SAVED]
        return [n for n in dict.fromkeys(names) if store.join(n, CHECKPOINT_FILE).exists()]
    except (ValueError, StorageError):  # a torn last line, storage away: Ray's record only
        return []


class Snapshot:
    """A copy of a checkpoint's state, complete once `wait()` returns; `into`: an earlier
    snapshot's state (no longer read by anyone) whose matching tensors are reused."""

    def __init__(self, state: Any, into: Any = None):
        self._event: Optional[torch.cuda.Event] = None
        self.state = self._copy(state, into)
        if self._event is not None:
            self._event.record()

    def _copy(self, obj: Any, old: Any) -> Any:
        if torch.is_tensor(obj):
            if obj.is_cuda and self._event is None:
                self._event = torch.cuda.Event()
            reusable = (torch.is_tensor(old) and old.shape == obj.shape and old.dtype == obj.dtype
                        and (not obj.is_cuda or old.is_pinned()))
            host = old if reusable else torch.empty(obj.shape, dtype=obj.dtype, pin_memory=obj.is_cuda)
            host.copy_(obj.detach(), non_blocking=obj.is_cuda)
            return host
        if isinstance(obj, dict):
            old = old if isinstance(old, dict) else {}
            return {k: self._copy(v, old.get(k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            old = old if isinstance(old, (list, tuple)) and len(old) == len(obj) else [None] * len(obj)
            return type(obj)(self._copy(v, o) for v, o in zip(obj, old))
        return obj  # numbers, strings, the config: never changed in place by training

    def wait(self) -> Any:
        """The copied state, once the device has finished copying it."""
        if self._event is not None:
            self._event.synchronize()
        return self.state


def in_thread(job: Callable[[], Any], name: str) -> Future:
    """`job()` on a daemon thread (an exit never waits for it): its result, or what it raised."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(job())
        except BaseException as e:  # handed to whoever asks for the result
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class Checkpointer:
    """One run's checkpoints, on every rank (`files`: rank 0's run log). Asynchronous by default:
    `save()` takes a snapshot and returns. Once rank 0's upload is over (`upload_over()`), every rank
    calls `report_saved()` at the same step, with the metrics it was saved with; until then it is
    `busy()` and no new checkpoint starts. A `final` checkpoint is written before save() returns."""

    def __init__(self, store: Location, ray: RayLink, master_process: bool, files: Optional[RunLog],
                 retry_storage_s: float, asynchronous: bool = True):
        self.store, self.ray, self.master_process = store, ray, master_process
        self.files, self.retry_storage_s, self.asynchronous = files, retry_storage_s, asynchronous
        self._upload: Optional[Future] = None   # rank 0: in flight, or done and not yet reported
        self._metrics: dict = {}
        self._last_snapshot = None  # rank 0: the next snapshot is copied into it (its upload was reported)
        self._shards: Any = None  # a sharded model's ShardSaver: the checkpoint's own group, the host copy

    def busy(self) -> bool:
        """An upload is in flight, or over and not yet reported."""
        return self._upload is not None

    def upload_over(self) -> bool:
        """An upload is over (saved or failed) and waits for its report."""
        return self._upload is not None and self._upload.done()

    def wait_for_upload(self) -> None:
        if self._upload is not None:
            self._upload.exception()  # waits; the error is for report_saved

    def save(self, state: Callable[[], dict], metrics: dict, final: bool = False) -> Optional[str]:
        """Every rank calls this at the same point, with nothing unreported. `state()` builds
        training_state()'s arguments. Returns the error of a `final` checkpoint that was not saved
        (after --retry-storage-s). A sharded model (fully_shard) is saved by every rank."""
        kwargs = state()
        if is_sharded(kwargs["model"]):
            return self._save_sharded(kwargs, metrics, final)
        if not final and self.asynchronous:
            if self.master_process:
                assert self._upload is None, "a checkpoint started before the previous one was reported"
                dest = self.store.join(self.ray.new_dir_name())
                snap = Snapshot(training_state(**kwargs), into=self._last_snapshot)
                self._last_snapshot, self._metrics = snap.state, metrics
                self._upload = in_thread(lambda: self._write(dest, snap.wait, 0.0), "checkpoint-upload")
            return None
        path, error = None, None
        if self.master_process:
            path, error = self._write(self.store.join(self.ray.new_dir_name()), lambda: training_state(**kwargs),
                                      self.retry_storage_s if final else 0.0)
        self.ray.report(metrics, path)
        return error if final else None

    def _save_sharded(self, kwargs: dict, metrics: dict, final: bool) -> Optional[str]:
        """Every rank writes its own shards (checkpoint.write_sharded_checkpoint), in the background
        unless `final`: the step waits only for their host copy. Every rank holds its own upload;
        rank 0's is over only once every rank's files and the manifest are written."""
        from .shards import ShardSaver

        assert self._upload is None, "a checkpoint started before the previous one was reported"
        self._shards = self._shards or ShardSaver()
        dest = self.store.join(self._shards.broadcast(self.ray.new_dir_name() if self.master_process else None))
        meta, tensors = sharded_state(**kwargs)
        if not final and self.asynchronous:
            staged, self._metrics = self._shards.stage(tensors), metrics
            self._upload = in_thread(lambda: self._write(dest, lambda: meta, 0.0, staged), "checkpoint-upload")
            return None
        path, error = self._write(dest, lambda: meta, self.retry_storage_s if final else 0.0, tensors)
        self.ray.report(metrics, path)
        return error if final else None

    def report_saved(self) -> None:
        """Every rank, at the same step: reports rank 0's finished upload (without a checkpoint if
        it failed: the metrics still count)."""
        path, metrics = None, {}
        if self._upload is not None:  # rank 0's; on another rank, its part of a sharded checkpoint
            saved, _ = self._upload.result()
            if self.master_process:
                path, metrics = saved, self._metrics
            self._upload = None
        self.ray.report(metrics, path)

    def _write(self, dest: Location, state: Callable[[], dict], wait_s: float,
               shards: Optional[dict] = None) -> tuple[Optional[str], Optional[str]]:
        """(the saved folder's path on the storage, None) or (None, why it was not saved). With
        `shards` (a sharded model's tensors) every rank calls it; only rank 0 gets the path."""
        state = state()
        position = where(state["epoch"], state["step"])
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            nbytes = (write_checkpoint(dest, state, wait_s) if shards is None else
                      write_sharded_checkpoint(dest, state, shards, self._shards, wait_s))
        except StorageError as e:
            if self.master_process:
                log.warning("checkpoint at %s NOT saved: %s%s", position, e,
                            "" if wait_s else "; training goes on, the next checkpoint tries again")
                self.files.event(Event.CHECKPOINT_FAILED, epoch=state["epoch"], step=state["step"], error=str(e))
            return None, f"the checkpoint at {position} was not saved: {e}"
        if not self.master_process:
            return None, None
        self.files.event(Event.CHECKPOINT_SAVED, checkpoint=dest.name, epoch=state["epoch"],
                         step=state["step"], bytes=nbytes, upload_s=time.perf_counter() - started,
                         cpu_s=time.thread_time() - cpu)
        return dest.path, None

    def choose(self, recorded: Optional[str]) -> tuple[Optional[str], Optional[dict]]:
        """Rank 0: the newest of this run's complete checkpoints (and `recorded`, the one Ray hands
        back) that verifies, and its state (None, None: there is none)."""
        names = sorted((n for n in {*saved_checkpoints(self.store), *([recorded] if recorded else [])}
                        if n.startswith(CHECKPOINT_PREFIX)), reverse=True)
        problems = []
        for name in names:
            try:
                state = load_checkpoint(self.store.join(name))
            except CheckpointError as e:
                problems.append(str(e))
                log.warning("skipping checkpoint %s: %s", name, e)
                self.files.event(Event.CHECKPOINT_SKIPPED, checkpoint=name, error=str(e))
                continue
            if name != recorded and (recorded is None or name > recorded):
                log.info("resuming from %s: saved completely, but Ray has no record of it (the driver "
                         "stopped right after it was written)", name)
            return name, state
        if names:
            raise CheckpointError(f"none of this run's {len(names)} checkpoint(s) verifies (newest: "
                                  f"{problems[0]}); pick one with --resume-from, or use a new --name")
        return None, None

    def resume(self, name: Optional[str], state: Optional[dict], resume_from: str,
               global_batch: Callable[[int], int], world_size: int) -> Resume:
        """The position to start at, from the chosen checkpoint (loaded here when `state` is
        None), else --resume-from, else the start. A mid-epoch position holds when the global batch
        (`global_batch(world size)`) is the checkpoint's: the shuffle of an epoch is the same at any
        world size, and step k of a global batch B covers its images k*B to (k+1)*B whatever the
        number of workers that share them; with another global batch that epoch is redone."""
        if name is not None and state is None:  # rank 0 chose it: it has verified every file
            state = load_checkpoint(self.store.join(name), verify_shards=False)
        elif name is None and resume_from:
            state = load_checkpoint(resume_from, near=self.store)
        if state is None:
            return Resume()
        before = state.get("world_size") or world_size
        same_steps = before == world_size or global_batch(before) == global_batch(world_size)
        return Resume(state["epoch"], state.get("step", 0) if same_steps else 0, state)
