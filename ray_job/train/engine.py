"""One training epoch and one evaluation pass: plain PyTorch, no Ray, unit-tested on CPU.

Counts are returned as local sums; `global_sums` adds them over all ranks when a process group
exists, so accuracy is the whole test set's, not rank 0's share.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class EpochStats:
    """Local sums and timings of one pass over (a shard of) the data."""

    loss_sum: float = 0.0
    correct: int = 0
    count: int = 0
    steps: int = 0
    data_s: float = 0.0        # blocked waiting for the next batch, plus its preprocessing
    fwd_bwd_s: float = 0.0     # forward + backward (includes DDP's overlapped all-reduce)
    optim_s: float = 0.0       # optimizer step + LR schedule
    wall_s: float = 0.0
    first_step_time: Optional[float] = None   # unix time when the first step finished
    step_times: list = field(default_factory=list)


def autocast_context(device: torch.device, bf16: bool):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16)


def _sync(device: torch.device, enabled: bool) -> None:
    if enabled and device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Step:
    """One finished optimizer step, as the loop sees it."""

    number: int          # steps done in this epoch (skipped ones included)
    loss: torch.Tensor   # on the device: reading it waits for the device
    data_s: float        # waiting for the batch, plus its preprocessing
    compute_s: float     # forward, backward and optimizer


class EpochSteps:
    """Trains one epoch at a time, built once per run: `run()` yields after each step, the caller may
    stop iterating at any step, and `finish()` returns that epoch's EpochStats. With `sync_timing`
    the device is synchronised around each phase so the split is exact."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, loss_fn: Callable,
                 preprocess: Callable, device: torch.device, bf16: bool = False, sync_timing: bool = False):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.loss_fn, self.preprocess, self.device = loss_fn, preprocess, device
        self.bf16, self.sync_timing = bf16, sync_timing

    def run(self, batches: Iterable, max_steps: int = 0, skip_steps: int = 0) -> Iterator[Step]:
        """A new epoch's steps over `batches`, skipping the first `skip_steps` and stopping after
        `max_steps`."""
        self.stats, self._loss_sum, self._correct = EpochStats(), 0, 0
        self.model.train()
        it = iter(batches)
        # Resuming mid-epoch: the sampler order is the same, so skipping reproduces the position.
        for _ in islice(it, skip_steps):
            pass
        step, stats = skip_steps, self.stats
        self._start = t0 = time.perf_counter()
        for images, labels in it:
            x = self.preprocess(images, True)
            _sync(self.device, self.sync_timing)
            t1 = time.perf_counter()
            with autocast_context(self.device, self.bf16):
                logits = self.model(x)
                loss = self.loss_fn(logits, labels)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            _sync(self.device, self.sync_timing)
            t2 = time.perf_counter()
            self.optimizer.step()
            self.scheduler.step()
            # .item() would sync every step; keep running sums on the device instead.
            self._loss_sum += loss.detach() * labels.size(0)
            self._correct += (logits.argmax(1) == labels).sum()
            stats.count += labels.size(0)
            _sync(self.device, self.sync_timing)
            t3 = time.perf_counter()
            stats.data_s += t1 - t0
            stats.fwd_bwd_s += t2 - t1
            stats.optim_s += t3 - t2
            stats.step_times.append(t3 - t0)
            stats.steps += 1
            step += 1
            if stats.first_step_time is None:
                stats.first_step_time = time.time()
            yield Step(step, loss, t1 - t0, t3 - t1)
            if max_steps and step >= max_steps:
                return
            t0 = time.perf_counter()

    def finish(self) -> EpochStats:
        """The epoch's sums and timings (waits for the device, so wall_s includes all its work)."""
        self.stats.loss_sum = float(self._loss_sum)
        self.stats.correct = int(self._correct)
        self.stats.wall_s = time.perf_counter() - self._start
        return self.stats

    def train_epoch(self, batches: Iterable, max_steps: int = 0, skip_steps: int = 0) -> EpochStats:
        """One whole epoch (or `max_steps` of it) with nothing in between the steps: benchmarks."""
        for _ in self.run(batches, max_steps, skip_steps):
            pass
        return self.finish()


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable, loss_fn: Callable, preprocess: Callable,
             device: torch.device, bf16: bool = False) -> EpochStats:
    """Sums of loss and correct predictions over this rank's share of the test set."""
    model.eval()
    stats = EpochStats()
    start = time.perf_counter()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.int64)
    for images, labels in batches:
        with autocast_context(device, bf16):
            logits = model(preprocess(images, False))
        loss_sum += loss_fn(logits.float(), labels) * labels.size(0)
        correct += (logits.argmax(1) == labels).sum()
        stats.count += labels.size(0)
        stats.steps += 1
    stats.loss_sum, stats.correct = float(loss_sum), int(correct)
    stats.wall_s = time.perf_counter() - start
    return stats


def reset_peak_memory(device: torch.device) -> None:
    """Starts a new peak for `memory_in_use(device, peak=True)` (on Linux, clearing the process's VmHWM)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def memory_in_use(device: torch.device, peak: bool = False) -> int:
    """Bytes this process holds now (or at its peak since `reset_peak_memory`): the GPU's allocated
    memory, or without a GPU the process's resident memory (VmRSS / VmHWM; 0 where /proc has none)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)
    key = "VmHWM:" if peak else "VmRSS:"
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    return 0


def peak_rss_gib() -> float:
    """This process's peak resident memory (host memory of one worker, or of the caller)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def global_sums(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sum over all ranks (identity without a process group)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def measure_comm_wait(steps: EpochSteps, batch, repeats: int = 3) -> float:
    """Seconds per step spent waiting for DDP's gradient all-reduce (0 without DDP): forward+backward
    timed with gradient sync and without (`no_sync`) on the same batch; the difference is the
    communication the backward pass could not hide. The batch is not augmented (no random draw) and
    BatchNorm statistics are restored afterwards, so the measurement does not change training."""
    model, device = steps.model, steps.device
    if not hasattr(model, "no_sync"):
        return 0.0
    buffers = {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}
    images, labels = batch
    x = steps.preprocess(images, False)

    def timed(sync_grads: bool) -> float:
        best = math.inf
        for _ in range(repeats):
            ctx = contextlib.nullcontext() if sync_grads else model.no_sync()
            _sync(device, True)
            t = time.perf_counter()
            with ctx:
                with autocast_context(device, steps.bf16):
                    loss = steps.loss_fn(model(x), labels)
                loss.backward()
            _sync(device, True)
            best = min(best, time.perf_counter() - t)
            model.zero_grad(set_to_none=True)
        return best

    timed(True)  # warm up buckets
    wait = max(0.0, timed(True) - timed(False))
    model.load_state_dict(buffers, strict=False)
    return wait
