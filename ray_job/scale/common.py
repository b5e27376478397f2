"""What the sweep, the report and --predict share: the options, the columns, scaling.json's layout.

Imports no Ray and nothing above it in this package (sweep, report, predict), so every part can
import it and --predict stays free of Ray.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Optional

from ..config import TrainConfig, config_from_args
from ..config.parser import add_config_args, apply_recipe
from ..core.errors import UsageError
from ..core.flags import ArgumentParser, Formatter, add_dataclass_args, option
from ..storage import read_json
from . import commmodel

# A fixed, short amount of work per point; --sync-timing makes the GPU step split exact.
SCALE_DEFAULTS = dict(epochs=1, steps_per_epoch=50, sync_timing=True, max_failures=0)
MODES = {"strong": "global", "weak": "per-worker"}  # scaling mode -> --batch-mode
# Train flags the sweep sets per point, so they are not flags of `scale`.
POINT_FIELDS = ("num_workers", "batch_mode")
SCALING_JSON, SCALING_CSV, SCALING_MD, SCALING_PNG = ("scaling.json", "scaling.csv", "scaling.md",
                                                      "scaling.png")

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
    "pred_comm_s": "the model's ring all-reduce time per step",
    "pred_exposed_comm_s": "the part of pred_comm_s the step waits for (the rest overlaps backward)",
    "pred_step_s": "the model's step time",
    "pred_efficiency": "the model's efficiency",
    "pred_step_error_pct": "100 * (pred_step_s - step_s) / step_s",
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
    """The flags of `scale` that are not train flags: which points, and the model's assumptions."""

    # --- the sweep ---
    workers: tuple[int, ...] = option((1, 2, 4, 8), "worker counts, comma-separated (1 is always "
                                      "added: it is the baseline)", type=worker_list)
    mode: str = option("both", "strong: fixed global --batch-size split across workers (the raw-DDP "
                       "baseline's chart); weak: every worker takes --batch-size", choices=("strong", "weak", "both"))
    link: str = option("auto", f"interconnect for the model: {', '.join(commmodel.LINKS)}, custom (give "
                       "both numbers), or auto (a sweep on one node: nvlink with NCCL, loopback with gloo; "
                       "several nodes: ib. predict: ib)")
    bandwidth_gbps: Optional[float] = option(None, "override the link's bus bandwidth (Gbit/s)", type=float)
    latency_us: Optional[float] = option(None, "override the link's per-step latency (us)", type=float)
    overlap: Optional[bool] = option(None, "model DDP's overlap of all-reduce with backward; default: on "
                                     "for GPU workers, off for CPU workers (gloo reduces on the cores "
                                     "that compute backward, so little is hidden); predict prints both",
                                     bool_flag=True)
    # --- on paper (scale predict) ---
    from_path: Optional[str] = option(None, "take the single-worker step and gradient size (and train "
                                      "flags' defaults) from a previous sweep's scaling.json")
    step_ms: Optional[float] = option(None, "single-worker step time at --batch-size per worker (default: "
                                      "a reference measurement on one H200 for resnet50, both stems)",
                                      type=float)
    optim_ms: Optional[float] = option(None, "part of --step-ms that does not shrink with the batch "
                                       "(optimizer step); default 0", type=float)
    grad_mb: Optional[float] = option(None, "MB all-reduced per step (default: from --model, fp32, "
                                      "halved by --grad-compression bf16)", type=float)

    def __post_init__(self) -> None:
        if self.mode not in ("strong", "weak", "both"):
            raise UsageError(f"--mode {self.mode!r} is not one of: strong, weak, both")
        if not self.workers or min(self.workers) < 1:
            raise UsageError("--workers: worker counts must be positive integers")

    @property
    def modes(self) -> list[str]:
        return ["strong", "weak"] if self.mode == "both" else [self.mode]

    @property
    def counts(self) -> list[int]:
        """The worker counts, the 1-worker baseline included."""
        return sorted({1, *self.workers})


PAPER_FLAGS = ("from_path", "step_ms", "optim_ms", "grad_mb")
COMMANDS = ("sweep", "predict")


def split_command(argv: list[str]) -> tuple[str, list[str]]:
    """`scale sweep FLAGS` or `scale predict FLAGS`; flags alone mean sweep."""
    if argv and argv[0] in COMMANDS:
        return argv[0], list(argv[1:])
    if argv and not argv[0].startswith("-"):
        raise UsageError(f"unknown scale command {argv[0]!r}; use sweep (the default) or predict")
    return "sweep", list(argv)


def build_parser(argv: list[str], command: str = "sweep") -> ArgumentParser:
    """The parser of `scale sweep` (train flags, as the points run them) or `scale predict`."""
    parser = ArgumentParser(prog=f"python -m ray_job scale {command}", formatter_class=Formatter,
                            description=DESCRIPTION)
    add_dataclass_args(parser.add_argument_group("the points and the model"), ScaleOptions, skip=PAPER_FLAGS)
    if command == "predict":
        paper = parser.add_argument_group("on paper: no Ray, nothing run")
        add_dataclass_args(paper, ScaleOptions, skip=[f.name for f in dataclasses.fields(ScaleOptions)
                                                      if f.name not in PAPER_FLAGS or f.name == "from_path"])
        # `from` is a keyword, so its field is from_path: the one flag not named after its field.
        from_path = next(f for f in dataclasses.fields(ScaleOptions) if f.name == "from_path")
        paper.add_argument("--from", dest="from_path", metavar="SCALING_JSON", help=from_path.metadata["help"])
    add_config_args(parser, skip=POINT_FIELDS)
    apply_recipe(parser, argv)
    parser.set_defaults(**SCALE_DEFAULTS)
    return parser


def parse_args(argv: list[str], command: str) -> tuple[ScaleOptions, TrainConfig, Optional[dict]]:
    """Scale options, the train config, and the --from sweep (whose config gives the defaults)."""
    previous = None
    if command == "predict":
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--from", dest="from_path")
        previous = load_sweep(pre.parse_known_args(argv)[0].from_path)
    parser = build_parser(argv, command)
    if previous is not None:
        saved = previous.get("config", {})
        parser.set_defaults(**{k: v for k, v in saved.items() if k not in POINT_FIELDS})
    ns = parser.parse_args(argv)
    opts = ScaleOptions(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ScaleOptions)
                           if hasattr(ns, f.name)})
    cfg = config_from_args(ns)
    if not cfg.name:
        cfg = dataclasses.replace(cfg, name=time.strftime("scale_%Y%m%d_%H%M%S"))
    return opts, cfg, previous


def load_sweep(path: Optional[str]) -> Optional[dict]:
    """A previous sweep's scaling.json (a file or its folder), checked to hold a baseline profile."""
    if path is None:
        return None
    if os.path.isdir(path):
        path = os.path.join(path, SCALING_JSON)
    try:
        sweep = read_json(path)
        profile = saved_profile(sweep)
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise UsageError(f"--from {path}: cannot read a scaling.json ({e})") from None
    if profile is None:
        raise UsageError(f"--from {path} has no single-worker profile (its 1-worker run did not "
                         f"finish); rerun the sweep or give --step-ms")
    return sweep


def saved_profile(sweep: dict) -> Optional[commmodel.StepProfile]:
    """The single-worker step a sweep calibrated its model on; None if its 1-worker run failed."""
    saved = (sweep.get("model") or {}).get("profile")
    return commmodel.StepProfile(**saved) if saved else None


def chosen_link(opts: ScaleOptions, auto: str) -> commmodel.Link:
    """--link with its overrides; `auto` names the link that --link auto means here."""
    name = auto if opts.link == "auto" else opts.link
    try:
        return commmodel.make_link(name, opts.bandwidth_gbps, opts.latency_us)
    except ValueError as e:
        raise UsageError(str(e)) from None


DESCRIPTION = """\
Run the trainer for several worker counts (strong and/or weak scaling) and report wall time, time to
the first step, steady images/s, where a step goes, speedup and efficiency against 1 worker, and the
communication model's prediction beside each point. Train flags pass through; the defaults here are a
fixed short amount of work (--epochs 1 --steps-per-epoch 50 --sync-timing --max-failures 0).

Outputs in <storage-path>/<name>/ (default name scale_<date>_<time>): scaling.csv, scaling.json,
scaling.md, scaling.png, and one run folder per point.

`scale predict` projects on paper without Ray: the single-worker step comes from --from (a previous
sweep's scaling.json), else --step-ms, else a reference measurement for ResNet-50 on one H200; the
gradient size from --grad-mb, else --from, else the --model's parameter count.

examples:
  python -m ray_job scale sweep --workers 1,2,4,8 --data cifar10 --address auto
  python -m ray_job scale sweep --workers 1,2 --no-gpu --data synthetic --model resnet18 --stem imagenet
  python -m ray_job scale predict --workers 8,16,32,64 --link ib
  python -m ray_job scale predict --from results/scale_x/scaling.json --workers 2,4,8 --link 10gbe
"""
