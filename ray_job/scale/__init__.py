"""Scaling sweep: the trainer once per worker count, strong and weak, for a fixed amount of work.

    python -m ray_job scale sweep --workers 1,2,4,8 --mode both --data cifar10 --address auto

Each point is a real `train` run in <storage-path>/<name>/<mode>_w<N>/. The sweep folder gets
scaling.csv/.json/.md/.png: wall time, time to first step, steady images/s, the step split (data /
compute / all-reduce wait / optimizer), speedup and efficiency against 1 worker.

Here: the flags, the modes and the columns (no Ray: bad flags fail before Ray is imported); then,
each importing only those before it, report (scaling.json/.csv/.md/.png from the sweep record) and
sweep (the points on Ray, the measurements and speedups).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from ..config import TrainConfig, config_from_args
from ..config.parser import add_config_args, apply_recipe
from ..core.errors import UsageError
from ..core.flags import ArgumentParser, Formatter, add_dataclass_args, option

# A fixed, short amount of work per point; --sync-timing makes the GPU step split exact.
SCALE_DEFAULTS = dict(epochs=1, steps_per_epoch=50, sync_timing=True, measure_comm_wait=True, max_failures=0)
MODES = {"strong": "global", "weak": "per-worker"}  # scaling mode -> --batch-mode
POINT_FIELDS = ("num_workers", "batch_mode")  # train flags the sweep sets per point: not flags of `scale`
OUTPUTS = ("scaling.csv", "scaling.json", "scaling.md", "scaling.png")

# One row per (mode, worker count), in scaling.csv and scaling.json; None where not measured.
COLUMN_HELP = {
    "mode": "strong (a fixed global batch split across the workers) or weak (a fixed batch per worker)",
    "workers": "training workers (DDP ranks)",
    "status": "ok, skipped (the cluster cannot run it), failed, preempted (stopped on request), or "
              "not run (the sweep was asked to stop before it)",
    "reason": "why the point is not ok, or that it was reused from an earlier run of the sweep",
    "run": "the point's run folder inside the sweep folder",
    "global_batch": "images per step, all workers together",
    "per_worker_batch": "images per step on each worker",
    "steps": "optimizer steps timed",
    "wall_s": "the point's whole `train` run: Ray start, training, evaluation",
    "time_to_first_step_s": "from the start of the point's run to its first training step",
    "train_s": "training time of the epoch (rank 0)",
    "images_per_s": "global train images / train_s",
    "steady_images_per_s": "global images/s from the median step, the first steps skipped",
    "step_s": "global_batch / steady_images_per_s",
    "data_s_per_step": "mean wait for a batch and its preprocessing (rank 0)",
    "compute_s_per_step": "mean forward + backward, without the all-reduce wait (rank 0)",
    "comm_wait_s_per_step": "DDP all-reduce wait: backward with minus without gradient sync",
    "optim_s_per_step": "mean optimizer step and LR schedule (rank 0)",
    "speedup": "steady_images_per_s / the 1-worker run's",
    "efficiency": "speedup / workers",
    "grad_bytes": "fp32 gradient bytes of the model",
}
COLUMNS = list(COLUMN_HELP)


def worker_list(text: str) -> tuple[int, ...]:
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of counts") from None
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError("worker counts must be positive integers")
    return tuple(counts)


@dataclass(frozen=True)
class ScaleOptions:
    """The flags of `scale sweep` that are not train flags: which points."""

    workers: tuple[int, ...] = option((1, 2, 4, 8), "worker counts, comma-separated (1 is always "
                                      "added: it is the baseline)", type=worker_list)
    mode: str = option("both", "strong: fixed global --batch-size split across workers (the raw-DDP "
                       "baseline's chart); weak: every worker takes --batch-size", choices=("strong", "weak", "both"))

    @property
    def modes(self) -> list[str]:
        return ["strong", "weak"] if self.mode == "both" else [self.mode]

    @property
    def counts(self) -> list[int]:
        """The worker counts, the 1-worker baseline included."""
        return sorted({1, *self.workers})


def split_command(argv: list[str]) -> tuple[str, list[str]]:
    """`scale sweep FLAGS`, or the flags alone: ("sweep", FLAGS)."""
    if argv and argv[0] == "sweep":
        return "sweep", list(argv[1:])
    if argv and not argv[0].startswith("-"):
        raise UsageError(f"unknown scale command {argv[0]!r}; use sweep (the default)")
    return "sweep", list(argv)


def build_parser(argv: list[str], command: str = "sweep") -> ArgumentParser:
    """The parser of `scale sweep`: its own flags, and the train flags as the points run them."""
    parser = ArgumentParser(prog=f"python -m ray_job scale {command}", formatter_class=Formatter,
                            description=DESCRIPTION)
    add_dataclass_args(parser.add_argument_group("the points"), ScaleOptions)
    add_config_args(parser, skip=POINT_FIELDS)
    apply_recipe(parser, argv)
    parser.set_defaults(**SCALE_DEFAULTS)
    return parser


def parse_args(argv: list[str]) -> tuple[ScaleOptions, TrainConfig]:
    """The scale options and the train config; without --name, the sweep is named after what its
    points compute (as `train` names a run), so the same command finds its finished points again."""
    ns = build_parser(argv).parse_args(argv)
    opts = ScaleOptions(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ScaleOptions)})
    cfg = config_from_args(ns)
    if not cfg.name:
        cfg = dataclasses.replace(cfg, name="scale_" + cfg.default_name().removeprefix("ray_job_"))
    return opts, cfg


def main(argv: list[str]) -> int:
    opts, cfg = parse_args(split_command(argv)[1])  # bad input fails here, before Ray is imported
    from .sweep import run_sweep

    return run_sweep(opts, cfg, argv)


DESCRIPTION = """\
Run the trainer for several worker counts (strong and/or weak scaling) and report wall time, time to
the first step, steady images/s, where a step goes, and speedup and efficiency against 1 worker.
Train flags pass through; the defaults here are a fixed short amount of work (--epochs 1
--steps-per-epoch 50 --sync-timing --max-failures 0).

Outputs in <storage-path>/<name>/: scaling.csv, scaling.json, scaling.md, scaling.png, and one run
folder per point. The default name, scale_<data>_<model>_<hash of what the points compute>, is the
same for the same command: run again, it reuses the points that finished.

examples:
  python -m ray_job scale sweep --workers 1,2,4,8 --data cifar10 --address auto
  python -m ray_job scale sweep --workers 1,2 --no-gpu --data synthetic --model resnet18 --stem imagenet
"""
