"""A process group without Ray: `run_ranks(target, ...)` runs `target(rank, world, *args)` in
`world` spawned processes joined in one gloo group (loopback) and returns what each returned, by
rank. The target must be a module-level function (spawn pickles it by name)."""

from __future__ import annotations

import os
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

from ray_job.cluster.ports import free_port


def _rank_main(target, rank: int, world: int, port: int, args: tuple, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out.put((rank, True, target(rank, world, *args)))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_ranks(target, *args, world: int = 2, timeout: float = 300) -> list:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(target, r, world, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict = {}
    try:
        while len(results) < world:
            rank, ok, value = out.get(timeout=timeout)
            assert ok, f"rank {rank} failed:\n{value}"  # the others may wait in a collective: killed below
            results[rank] = value
    finally:
        for p in procs:
            p.join(30 if len(results) == world else 0)
            if p.is_alive():
                p.kill()
                p.join(10)
    return [results[r] for r in range(world)]
