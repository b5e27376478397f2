"""`python -m ray_job bench memory`: what --strategy ddp|fsdp|hsdp holds per worker, and what it costs.

Trains --steps steps of each strategy on --workers processes of this machine (no Ray: spawned
processes in one gloo (CPU) or NCCL (GPU) group on loopback, the model as `train` builds it --
`zoo`, 10 classes, the ResNet CIFAR stem -- and synthetic images), each strategy in fresh processes.
Per strategy and rank it reports the bytes of parameters, gradients and optimizer state that rank
holds (`sharding.local_state_bytes`) beside the memory plan's figure for them, the peak memory
(GPU: torch.cuda.max_memory_allocated; CPU: the process's peak resident memory above its resident
memory just before the model was built, VmHWM reset through /proc/self/clear_refs; glibc returns
freed blocks over 1 MiB at once, so it is the memory in use, not malloc's cache), images/s over
the steps after the first, and each as a ratio to ddp's same rank. With --activation-checkpointing
every strategy also runs with it, as rows `ddp+ac`, `fsdp+ac`, ... (their ratios are to plain ddp,
so they show what checkpointing saves and costs too).

    python -m ray_job bench memory --model resnet50 --workers 2 --strategies ddp,fsdp --activation-checkpointing
    python -m ray_job bench memory --model vit_b_16 --image-size 224 --workers 4 --per-node 2 --strategies ddp,hsdp
"""

from __future__ import annotations

import dataclasses
import os
import queue
import time
import traceback

import torch

from ..config import TrainConfig
from ..config.run import STRATEGIES
from ..core.errors import UsageError
from ..core.flags import option
from .common import check_workers, fmt, machine


@dataclasses.dataclass(frozen=True)
class MemoryBenchConfig:
    model: str = option("resnet50", "any model --model takes (torchvision's classifiers, pkg.module:fn)")
    workers: int = option(2, "worker processes on this machine (one GPU each where there are GPUs)")
    per_node: int = option(0, "workers per node, for hsdp's mesh (0 = all workers: one node)")
    strategies: str = option("ddp,fsdp", "comma list of ddp, fsdp, hsdp")
    activation_checkpointing: bool = option(False, "also run every strategy with activation checkpointing "
                                            "(rows STRATEGY+ac)", bool_flag=True)
    batch_size: int = option(128, "global batch size, split across the workers")
    steps: int = option(5, "training steps per strategy; images/s counts those after the first")
    image_size: int = option(32, "side of the synthetic square images")
    optimizer: str = option("auto", "sgd, adamw, or auto (as train: adamw for transformers)",
                            choices=("auto", "sgd", "adamw"))
    out: str = option("results/bench_memory.json", "where the JSON report goes (the table beside it, .md)")

    def __post_init__(self) -> None:
        unknown = [s for s in self.strategy_list if s not in STRATEGIES]
        if unknown or not self.strategy_list:
            raise UsageError(f"--strategies {self.strategies!r}: use a comma list of {', '.join(STRATEGIES)}")
        if self.steps < 2 or self.batch_size < 1 or self.image_size < 1 or self.per_node < 0:
            raise UsageError("--steps must be at least 2 (the first is not timed), --batch-size and --image-size "
                             "at least 1, --per-node not negative")
        nodes, rest = divmod(self.workers, self.node_size)
        if "hsdp" in self.strategy_list and (rest or nodes < 2):
            raise UsageError(f"--strategies hsdp needs two or more whole nodes: --workers {self.workers} is not a "
                             f"multiple of --per-node {self.node_size} above it; give --per-node (e.g. "
                             f"{max(1, self.workers // 2)}) or leave hsdp out")

    @property
    def strategy_list(self) -> list[str]:
        return [s.strip() for s in self.strategies.split(",") if s.strip()]

    @property
    def node_size(self) -> int:
        return self.per_node or self.workers

    def variants(self) -> list[tuple[str, bool]]:
        """(strategy, activation checkpointing) of each run, in order."""
        ac = (False, True) if self.activation_checkpointing else (False,)
        return [(s, a) for a in ac for s in self.strategy_list]


def train_config(cfg: MemoryBenchConfig) -> TrainConfig:
    """The model's and optimizer's choices as `train` makes them (the data is synthetic here; a
    prepared dataset is the one --data whose images can have any size)."""
    return TrainConfig(model=cfg.model, image_size=cfg.image_size, batch_size=cfg.batch_size,
                       optimizer=cfg.optimizer, data="synthetic" if cfg.image_size == 32 else "prepared")


def _placed(cfg: MemoryBenchConfig, strategy: str, ac: bool, device: torch.device, world: int):
    """The model as a worker trains it under `strategy`, and the memory plan of its states."""
    from ..model import memory, sharding, zoo

    run = train_config(cfg)
    model = zoo.build(run, 10).to(device)
    states = memory.plan(model, run.optimizer_in_use, strategy, world, cfg.node_size)
    if ac:
        sharding.checkpoint_activations(model)
    if strategy == "ddp":
        # as `train` wraps it: gradients are views into DDP's buckets, not a second copy
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=None if device.index is None else [
            device.index], gradient_as_bucket_view=True), states
    mesh = sharding.device_mesh(strategy, world, cfg.node_size, device.type)
    return sharding.shard(model, mesh, bf16=device.type == "cuda", cpu_offload=False), states


def _train(cfg: MemoryBenchConfig, model, device: torch.device, world: int, bf16_autocast: bool):
    """--steps steps on synthetic data; the optimizer and the seconds of the steps after the first."""
    from ..model.optim import build_optimizer
    from ..model.parts import unwrap

    optimizer = build_optimizer(unwrap(model), train_config(cfg), world, device)
    per_worker = max(1, cfg.batch_size // world)
    x = torch.randn(per_worker, 3, cfg.image_size, cfg.image_size, device=device)
    y = torch.randint(0, 10, (per_worker,), device=device)
    started = 0.0
    for step in range(cfg.steps):
        if step == 1:
            _sync(device)
            started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)  # the last step's gradients stay, to be counted
        with torch.autocast("cuda", torch.bfloat16, enabled=bf16_autocast):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    _sync(device)
    return optimizer, time.perf_counter() - started, per_worker


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker(rank: int, world: int, port: int, cfg: MemoryBenchConfig, strategy: str, ac: bool, out) -> None:
    """One rank of one run: its row, or its traceback, on `out`."""
    import torch.distributed as dist

    from ..model.sharding import local_state_bytes
    from ..train.engine import memory_in_use, reset_peak_memory

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        reset_peak_memory(device)
        before = 0 if cuda else memory_in_use(device)  # the GPU's figure is allocations alone
        model, states = _placed(cfg, strategy, ac, device, world)
        optimizer, seconds, per_worker = _train(cfg, model, device, world, cuda and strategy == "ddp")
        peak = memory_in_use(device, peak=True) - before
        held = local_state_bytes(model, optimizer)
        out.put((rank, dict(strategy=strategy + "+ac" * ac, rank=rank, **held, model_states=sum(held.values()),
                            planned_states=states.total, peak_bytes=peak,
                            images_per_s=per_worker * world * (cfg.steps - 1) / seconds)))
    except BaseException:
        out.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run(cfg: MemoryBenchConfig, strategy: str, ac: bool, timeout: float = 3600) -> tuple[list[dict], list[str]]:
    """One strategy on --workers fresh processes: the rows by rank, and the errors."""
    import torch.multiprocessing as mp

    from ..cluster.ports import free_port

    # fresh processes per run (each strategy's peak its own), forked from a server that imported
    # torch once: a run costs no import time
    ctx = mp.get_context("forkserver")
    if not torch.cuda.is_available():
        # freed blocks over 1 MiB go back to the OS at once (glibc keeps them otherwise): the peak
        # resident memory is then that of the tensors in use, not of what malloc happened to keep
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(2**20))
    ctx.set_forkserver_preload([__name__])
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, cfg.workers, port, cfg, strategy, ac, out))
             for r in range(cfg.workers)]
    for p in procs:
        p.start()
    rows, errors = _collect(procs, out, timeout, f"{strategy}{'+ac' * ac}")
    return sorted(rows, key=lambda r: r["rank"]), errors


def _collect(procs, out, timeout: float, what: str) -> tuple[list[dict], list[str]]:
    """The ranks' rows; a rank that raised or died (out of memory: killed) is an error, and ends the run."""
    rows, errors, deadline = [], [], time.time() + timeout
    while len(rows) + len(errors) < len(procs) and not errors and time.time() < deadline:
        try:
            rank, value = out.get(timeout=2)
            (rows.append(value) if isinstance(value, dict) else
             errors.append(f"{what} rank {rank}: {value.strip().splitlines()[-1]}"))
        except queue.Empty:
            dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            errors += [f"{what} rank {i} died with exit code {code}" + (" (killed: out of memory?)" if code == -9
                                                                         else "") for i, code in dead]
    if len(rows) + len(errors) < len(procs) and not errors:
        errors.append(f"{what}: no result within {timeout:.0f} s")
    for p in procs:
        p.join(30 if not errors else 1)
        if p.is_alive():
            p.kill()
            p.join(10)
    return rows, errors


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row with its model states, peak and images/s as ratios to plain ddp's same rank."""
    ddp = {r["rank"]: r for r in rows if r["strategy"] == "ddp"}
    for r in rows:
        base = ddp.get(r["rank"])
        for key in ("model_states", "peak_bytes", "images_per_s"):
            r[f"{key}_vs_ddp"] = r[key] / base[key] if base and base[key] else None
    return rows


def main(cfg: MemoryBenchConfig) -> dict:
    from ..model import zoo

    cuda = torch.cuda.is_available()
    check_workers(cfg.workers, cfg.batch_size, cuda)
    zoo.check(train_config(cfg), 10)  # one line on the driver if the model cannot be built or take the size
    rows, errors = [], []
    for strategy, ac in cfg.variants():
        got, failed = run(cfg, strategy, ac)
        rows += got
        errors += failed
    report = dict(kind="memory", date=time.strftime("%Y-%m-%d %H:%M:%S %z"), device=machine(cuda),
                  torch=torch.__version__, config=dataclasses.asdict(cfg),
                  optimizer=train_config(cfg).optimizer_in_use,
                  peak="GPU memory allocated (max_memory_allocated)" if cuda else
                  "host RSS peak above the RSS before the model was built (VmHWM)",
                  rows=with_ratios(rows), errors=errors, load_avg=list(os.getloadavg()))
    table = format_report(report)
    with open(os.path.splitext(cfg.out)[0] + ".md", "w") as f:
        f.write(table + "\n")
    print(table)
    return report


def format_report(r: dict) -> str:
    """The markdown table (also what is printed)."""
    c, mib = r["config"], 2**20
    lines = [f"bench memory {r['date']} on {r['device']}: {c['model']}, {c['workers']} workers, global batch "
             f"{c['batch_size']}, {c['image_size']}px, {c['steps']} steps, {r['optimizer']}; peak = {r['peak']}; "
             f"load average {r['load_avg'][0]:.2f}", "",
             "| strategy | rank | params MiB | grads MiB | optimizer MiB | states MiB | planned MiB | peak MiB "
             "| img/s | states vs ddp | peak vs ddp | img/s vs ddp |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in r["rows"]:
        lines.append(f"| {x['strategy']} | {x['rank']} | {x['params'] / mib:.1f} | {x['grads'] / mib:.1f} | "
                     f"{x['optimizer'] / mib:.1f} | {x['model_states'] / mib:.1f} | {x['planned_states'] / mib:.1f} | "
                     f"{x['peak_bytes'] / mib:.0f} | {x['images_per_s']:.1f} | {fmt(x['model_states_vs_ddp'], '.2f')} "
                     f"| {fmt(x['peak_bytes_vs_ddp'], '.2f')} | {fmt(x['images_per_s_vs_ddp'], '.2f')} |")
    lines += [f"error: {e}" for e in r["errors"]]
    return "\n".join(lines)
