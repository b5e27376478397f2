"""The metrics of one epoch: one typed record that the worker builds and everyone else reads.

Rank 0 writes it to metrics.jsonl/csv and TensorBoard (runlog.py) and reports it to Ray; the driver's
summary and table and the scaling sweep read it back with `EpochMetrics.from_dict`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class EpochMetrics:
    """Global figures of one epoch: counts summed over all ranks, times are rank 0's."""

    epoch: int                  # 1-based, finished epochs after this one
    epochs: int                 # epochs the run was asked for
    train_loss: float
    train_acc: float
    test_loss: float
    test_acc: float
    train_images: int
    test_images: int
    epoch_s: float              # train + eval
    train_s: float
    eval_s: float
    images_per_s: float         # global train images / train seconds
    data_s: float               # waiting for batches, plus their preprocessing
    compute_s: float            # train_s - data_s
    fwd_bwd_s: float
    optim_s: float
    steps: int
    lr: float
    world_size: int
    time: float                 # unix time at the end of the epoch
    peak_host_mem_gib: float
    grad_bytes: int
    steady_images_per_s: Optional[float] = None   # from the median step, first steps skipped
    peak_gpu_mem_gib: Optional[float] = None
    comm_wait_s_per_step: Optional[float] = None  # DDP all-reduce wait (scaling sweeps)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> EpochMetrics:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def line(self) -> str:
        """The epoch's log line."""
        return (f"epoch {self.epoch}/{self.epochs}: train loss {self.train_loss:.4f} acc "
                f"{self.train_acc:.3f} | test loss {self.test_loss:.4f} acc {self.test_acc:.3f} | "
                f"{self.epoch_s:.1f}s, {self.images_per_s:.0f} img/s, data {self.data_s:.1f}s vs "
                f"compute {self.compute_s:.1f}s | lr {self.lr:.4g}")


TABLE_HEAD = (f"{'epoch':>5} {'train loss':>10} {'train acc':>9} {'test loss':>9} {'test acc':>8} "
              f"{'seconds':>8} {'img/s':>8} {'data s':>7} {'compute s':>9} {'lr':>8}")


def table(rows: list[EpochMetrics]) -> str:
    """The final table the driver prints: one line per epoch."""
    return "\n".join([TABLE_HEAD, "-" * len(TABLE_HEAD), *(
        f"{r.epoch:>5} {r.train_loss:>10.4f} {r.train_acc:>9.3f} {r.test_loss:>9.4f} {r.test_acc:>8.3f} "
        f"{r.epoch_s:>8.1f} {r.images_per_s:>8.0f} {r.data_s:>7.1f} {r.compute_s:>9.1f} {r.lr:>8.4f}" for r in rows)])
