"""The tensors of a sharded model (`fully_shard`: its parameters are DTensors) with torch Distributed
Checkpoint (DCP): every rank saves its own shards, and any world size loads them.

Saving: `get_state_dict(model, optimizer)` gives each rank's shards (the full model is never
gathered); `ShardSaver.save` writes them with DCP into a checkpoint's `shards/` folder
(checkpoint.SHARDS_DIR), one file per rank, on a gloo group of the checkpoint's own (created once,
every rank at the same save) so that its collectives, run from a background thread, never
interleave with training's. `ShardSaver.stage` copies them to host memory with DCP's stager,
reusing the previous copy's memory: all that an asynchronous checkpoint makes the step wait for.

Loading (`load`): DCP reads what each rank's own sharding needs, for any world size, into a sharded
model, a plain one in a process group (DDP), or a plain one in a process without any (export).
`load_full` puts a full state (a DDP checkpoint's checkpoint.pt) into a sharded model.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict, set_state_dict)

from ..storage import Location, StorageError, reason
from .shardfs import LocationReader, LocationWriter

def state_of(model: torch.nn.Module, optimizer: Any) -> dict:
    """This rank's shards of the model's and the optimizer's state, keyed by parameter names (live
    tensors: `ShardSaver.stage` copies them)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def first_failure(e: CheckpointException, what: str) -> str:
    """DCP's error of every failed rank as one line: the first rank's own error."""
    rank, (error, _) = sorted(e.failures.items(), key=lambda item: item[0])[0]
    text = reason(error) if isinstance(error, OSError) else " ".join(str(error).split())[:240]
    return f"rank {rank} could not {what}: {text}"


class ShardSaver:
    """One run's sharded saves on every rank: the checkpoint's own process group and DCP's stager."""

    def __init__(self):
        self._group: Optional[dist.ProcessGroup] = None
        self._stager: Any = None

    @property
    def group(self) -> dist.ProcessGroup:
        """A gloo group of every rank, for the checkpoint's collectives only (created by every rank
        at the same save)."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    @property
    def rank(self) -> int:
        return dist.get_rank()

    def gather(self, obj: Any) -> Optional[list]:
        """`obj` of every rank, in rank order, on rank 0 (None elsewhere), on the checkpoint's group."""
        everyone = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(obj, everyone, dst=0, group=self.group)
        return everyone

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank, on the checkpoint's group."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def stage(self, tensors: dict) -> dict:
        """A host copy of `tensors` (DTensors stay DTensors), into the previous copy's memory: only
        one checkpoint is ever in flight, so the last one's writes are over."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=cuda))
        return self._stager.stage(tensors)

    def save(self, folder: Location, tensors: dict) -> dict[str, dict]:
        """Every rank: writes its own shards of `tensors` into `folder` (rank 0 also DCP's
        `.metadata`). The figures (bytes, sha256) of the files this rank wrote, named relative to
        the checkpoint folder (`shards/__0_0.distcp`), each checked against its stored size.
        StorageError when this rank's or (through DCP) any rank's write failed."""
        writer = LocationWriter(folder)
        try:
            dcp.save(tensors, storage_writer=writer, process_group=self.group)
        except CheckpointException as e:  # a BaseException: DCP raises it on every rank
            raise StorageError(first_failure(e, "write its shards")) from None
        base = folder.parent().path.rstrip("/") + "/"
        figures = {}
        for path, written in writer.fs.written.items():
            name = path[len(base):] if path.startswith(base) else path
            stored = folder.at_path(path).info().size
            if stored != written["bytes"]:
                raise StorageError(f"{name} holds {stored} bytes in the store, {written['bytes']} were written")
            figures[name] = written
        return figures


def load(folder: Location, model: torch.nn.Module, optimizer: Any = None, alone: bool = False) -> None:
    """Loads the shards in `folder` into `model` (and `optimizer`): sharded or plain, any world size.
    Every rank of the process group calls it, or one process with `alone` (no group needed)."""
    no_dist = alone or not (dist.is_available() and dist.is_initialized())
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        state = state_of(model, optimizer)
    try:
        with warnings.catch_warnings():
            if no_dist:  # what DCP warns of then (one process, no group) is what is meant
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, storage_reader=LocationReader(folder), no_dist=no_dist)
    except CheckpointException as e:  # a BaseException: DCP raises it on every rank
        raise StorageError(first_failure(e, f"read the shards in {folder.uri}")) from None
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def load_full(model: torch.nn.Module, optimizer: Any, model_state: dict, optim_state: Optional[dict]) -> None:
    """A full state (every rank holds all of it: a DDP checkpoint) into a sharded model: each rank
    keeps its own shards of it."""
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    if optim_state is not None:
        set_optimizer_state_dict(model, optimizer, by_name(model, optimizer, optim_state), options=options)


def by_name(model: torch.nn.Module, optimizer: Any, optim_state: dict) -> dict:
    """`optimizer.state_dict()` keys parameters by their position in the param groups; the state
    dict helpers want their names. The positions are the same in a model built the same way."""
    names = {p: n for n, p in model.named_parameters()}
    saved, live = optim_state["param_groups"], optimizer.param_groups
    if [len(g["params"]) for g in saved] != [len(g["params"]) for g in live]:
        raise ValueError(f"the checkpoint's optimizer has parameter groups of {[len(g['params']) for g in saved]} "
                         f"parameters, this model's {[len(g['params']) for g in live]}")
    name_of = {i: names[p] for s, g in zip(saved, live) for i, p in zip(s["params"], g["params"])}
    return {"state": {name_of[i]: v for i, v in optim_state["state"].items()},
            "param_groups": [{**g, "params": [name_of[i] for i in g["params"]]} for g in saved]}


def model_shapes(folder: Location) -> dict[str, tuple[int, ...]]:
    """The full shape of every tensor of the model in the shards' `.metadata`, by name."""
    metadata = LocationReader(folder).read_metadata()
    return {k.removeprefix("model."): tuple(md.size) for k, md in metadata.state_dict_metadata.items()
            if k.startswith("model.") and hasattr(md, "size")}
