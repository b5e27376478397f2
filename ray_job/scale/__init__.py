"""Scaling sweep: the trainer once per worker count, strong and weak, for a fixed amount of work.

    python -m ray_job scale sweep --workers 1,2,4,8 --mode both --data cifar10 --address auto
    python -m ray_job scale predict --workers 8,16,32,64 --link ib

Each point is a real `train` run in <storage-path>/<name>/<mode>_w<N>/. The sweep folder gets
scaling.csv/.json/.md/.png: wall time, time to first step, steady images/s, the step split (data /
compute / all-reduce wait / optimizer), speedup and efficiency against 1 worker, and the
communication model's prediction beside each point. `scale predict` projects on paper, without Ray.

The parts, each importing only those listed before it:
  commmodel  the all-reduce model: links, StepProfile, predict (pure arithmetic)
  common     ScaleOptions and the parser, the modes, the columns, scaling.json's baseline profile
  report     scaling.json/.csv/.md/.png from the sweep record
  predict    `scale predict`: the projection on paper (no Ray)
  sweep      the points on Ray (`train` runs), the measurements, speedups and predictions
"""

from __future__ import annotations

from .common import COLUMNS, ScaleOptions, build_parser, chosen_link, parse_args, split_command

__all__ = ["COLUMNS", "ScaleOptions", "build_parser", "main", "measure_all", "parse_args", "split_command"]


def main(argv: list[str]) -> int:
    command, argv = split_command(argv)
    opts, cfg, previous = parse_args(argv, command)
    if command == "predict":  # on paper: the Ray sweep is not even imported
        from .predict import print_projection

        return print_projection(opts, cfg, chosen_link(opts, "ib"), previous)
    from .sweep import run_sweep

    # --link auto: the sweep picks the link once it sees the cluster
    return run_sweep(opts, cfg, None if opts.link == "auto" else chosen_link(opts, ""), argv)


def __getattr__(name: str):
    """`measure_all` lives with the Ray sweep: imported when asked for, not with the package."""
    if name == "measure_all":
        from .sweep import measure_all

        return measure_all
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
