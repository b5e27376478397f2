"""Scaling sweep: the trainer once per worker count, strong and weak, for a fixed amount of work.

    python -m ray_job scale sweep --workers 1,2,4,8 --mode both --data cifar10 --address auto

Each point is a real `train` run in <storage-path>/<name>/<mode>_w<N>/. The sweep folder gets
scaling.csv/.json/.md/.png: wall time, time to first step, steady images/s, the step split (data /
compute / all-reduce wait / optimizer), speedup and efficiency against 1 worker.

The parts, each importing only those listed before it:
  common     ScaleOptions and the parser, the modes, the columns
  report     scaling.json/.csv/.md/.png from the sweep record
  sweep      the points on Ray (`train` runs), the measurements and speedups
"""

from __future__ import annotations

from .common import COLUMNS, ScaleOptions, build_parser, parse_args, split_command

__all__ = ["COLUMNS", "ScaleOptions", "build_parser", "main", "measure_all", "parse_args", "split_command"]


def main(argv: list[str]) -> int:
    opts, cfg = parse_args(split_command(argv)[1])  # bad input fails here, before Ray is imported
    from .sweep import run_sweep

    return run_sweep(opts, cfg, argv)


def __getattr__(name: str):
    """`measure_all` lives with the Ray sweep: imported when asked for, not with the package."""
    if name == "measure_all":
        from .sweep import measure_all

        return measure_all
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
