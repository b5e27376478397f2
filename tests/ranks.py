"""A process group without Ray: `run_ranks(target, ...)` runs `target(rank, world, *args)` in
`world` processes joined in one gloo group (loopback) and returns what each returned, by
rank. The target must be a module-level function (it is pickled by name).

The ranks are forked from a forkserver that has imported torch and ray_job once (the first call's
target module too): a spawned rank imported them itself, ~6 CPU-seconds a process. The server has
run nothing, so a fork starts from a clean torch (no OpenMP threads). A rank gets the server's
environment and working folder, not the test's: pass what a rank needs as arguments."""

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


PRELOAD = ["torch", "torch.distributed", "ray_job.train.worker", "ray_job.train.checkpointer",
           "ray_job.model.sharding", __name__]


def run_ranks(target, *args, world: int = 2, timeout: float = 300) -> list:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, target.__module__])  # read when the server starts: the first call
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
