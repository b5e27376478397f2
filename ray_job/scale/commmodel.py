"""A paper model of data-parallel step time: one worker's measured step plus ring all-reduce.

    python -m ray_job scale --predict --workers 8,16,32,64 --link ib

Ring all-reduce of S bytes over N ranks, each step costing latency a on a link of bandwidth B:

    t_comm = 2(N-1)/N * S/B + buckets * 2(N-1) * a

(reduce-scatter then all-gather; DDP all-reduces its gradient buckets one by one, so the latency
term is paid per bucket). Assumptions, stated once:
- compute (data + forward + backward) scales linearly with the per-worker batch; the optimizer step
  does not (it touches every parameter whatever the batch). Ideal for large batches; small batches
  on a GPU are less efficient than this says, so strong-scaling predictions are optimistic.
- with overlap, DDP all-reduces buckets while backward is still running: the backward pass, taken
  as BACKWARD_FRACTION of forward+backward, hides up to that much communication. Without overlap
  all communication adds to the step.
- the link numbers are nominal per-rank bus bandwidths (what nccl-tests calls busbw) and per-step
  latencies; real clusters reach 60-90 % of them. Override with --bandwidth-gbps / --latency-us.
- nothing else is modelled: no stragglers, no congestion between jobs, no host-side contention.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

BACKWARD_FRACTION = 2 / 3  # backward costs about twice the forward pass


@dataclass(frozen=True)
class Link:
    """One interconnect: per-rank bus bandwidth in one direction and per-step latency."""

    name: str
    bandwidth_gbps: float  # Gbit/s
    latency_us: float
    note: str = ""

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8


# Nominal numbers (vendor figures per direction, not measurements), except `loopback`.
LINKS: dict[str, Link] = {link.name: link for link in (
    Link("nvlink", 3600, 3, "NVLink 4 (H100/H200 node): 450 GB/s per GPU per direction"),
    Link("pcie", 256, 5, "PCIe 4.0 x16 between GPUs of one node without NVLink: 32 GB/s"),
    Link("ib", 400, 5, "InfiniBand NDR, one 400 Gb/s HCA per GPU"),
    Link("ib-hdr", 200, 5, "InfiniBand HDR, one 200 Gb/s HCA per GPU"),
    Link("100gbe", 100, 20, "100 Gb Ethernet (RoCE or TCP)"),
    Link("10gbe", 10, 50, "10 Gb Ethernet, TCP"),
    Link("loopback", 8, 150, "gloo over TCP between processes of one host; measured on the 2-core "
         "dev machine 2026-12-01: 7.3-8.6 Gb/s bus bandwidth, 0.32 ms for a 4 KiB all-reduce"),
)}


def make_link(name: str, bandwidth_gbps: Optional[float] = None,
              latency_us: Optional[float] = None) -> Link:
    """A preset, with either number overridden; both numbers and no preset make a custom link."""
    if name not in LINKS and name != "custom":
        raise ValueError(f"unknown link {name!r}; use one of {', '.join(LINKS)} or give "
                         f"--bandwidth-gbps and --latency-us")
    base = LINKS.get(name, Link("custom", math.nan, math.nan, "given on the command line"))
    bw = base.bandwidth_gbps if bandwidth_gbps is None else bandwidth_gbps
    lat = base.latency_us if latency_us is None else latency_us
    if not bw > 0 or not lat >= 0:
        raise ValueError("a link needs a positive --bandwidth-gbps and a --latency-us >= 0")
    overridden = (bandwidth_gbps, latency_us) != (None, None) and name != "custom"
    return Link(base.name + ("*" if overridden else ""), bw, lat,
                base.note + (" (overridden on the command line)" if overridden else ""))


def ring_allreduce_s(nbytes: float, workers: int, link: Link, buckets: int = 1) -> float:
    """Seconds for a ring all-reduce of `nbytes` over `workers` ranks (0 for one worker)."""
    if workers <= 1:
        return 0.0
    n = workers
    return 2 * (n - 1) / n * nbytes / link.bytes_per_s + buckets * 2 * (n - 1) * link.latency_us * 1e-6


@dataclass(frozen=True)
class StepProfile:
    """One worker's steady training step at per-worker batch `batch`, without communication."""

    batch: int
    data_s: float      # waiting for and preparing the batch (scales with the batch)
    fwd_bwd_s: float   # forward + backward (scales with the batch)
    optim_s: float     # optimizer + LR schedule (does not)
    grad_bytes: int    # bytes all-reduced per step (fp32 gradients, or half with bf16 compression)
    bucket_bytes: int = 25 * 2**20  # DDP bucket size: one latency term per bucket
    source: str = ""

    def compute_s(self, batch: int) -> tuple[float, float]:
        """(data + forward + backward, forward + backward) seconds at per-worker `batch`."""
        k = batch / self.batch
        return k * (self.data_s + self.fwd_bwd_s), k * self.fwd_bwd_s

    @property
    def buckets(self) -> int:
        return max(1, math.ceil(self.grad_bytes / self.bucket_bytes))

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Prediction:
    """The model's step for `workers` ranks in one scaling mode."""

    mode: str
    workers: int
    per_worker_batch: int
    global_batch: int
    comm_s: float          # the whole all-reduce
    exposed_comm_s: float  # the part the step waits for
    step_s: float
    images_per_s: float
    speedup: float         # throughput against one worker in the same mode
    efficiency: float      # speedup / workers


def per_worker_batch(mode: str, batch: int, workers: int) -> int:
    """Strong scaling splits a fixed global `batch`; weak scaling gives every worker `batch`."""
    if mode not in ("strong", "weak"):
        raise ValueError(f"mode must be strong or weak, not {mode!r}")
    return batch // workers if mode == "strong" else batch


def step_s(profile: StepProfile, link: Link, workers: int, batch: int,
           overlap: bool) -> tuple[float, float, float]:
    """(step, all-reduce, exposed all-reduce) seconds at per-worker `batch` on `workers` ranks."""
    work, fwd_bwd = profile.compute_s(batch)
    comm = ring_allreduce_s(profile.grad_bytes, workers, link, profile.buckets)
    hidden = BACKWARD_FRACTION * fwd_bwd if overlap else 0.0
    exposed = max(0.0, comm - hidden)
    return work + exposed + profile.optim_s, comm, exposed


def predict(profile: StepProfile, link: Link, workers: int, mode: str, batch: int,
            overlap: bool = True) -> Optional[Prediction]:
    """The step for `workers` ranks; `batch` is the global (strong) or per-worker (weak) batch.

    None when strong scaling leaves a worker without a single image.
    """
    local = per_worker_batch(mode, batch, workers)
    if local < 1:
        return None
    base_batch = per_worker_batch(mode, batch, 1)
    base_ips = base_batch / step_s(profile, link, 1, base_batch, overlap)[0]
    step, comm, exposed = step_s(profile, link, workers, local, overlap)
    ips = local * workers / step
    speedup = ips / base_ips
    return Prediction(mode, workers, local, local * workers, comm, exposed, step, ips, speedup,
                      speedup / workers)
