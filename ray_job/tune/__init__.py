"""Hyperparameter search with Ray Tune: trials that are ordinary `train` runs, ASHA, Optuna, stop
requests and requeues.

    python -m ray_job tune --data synthetic --model resnet18 --stem imagenet --epochs 4 \\
        --space lr=loguniform:0.001:1 --space weight_decay=loguniform:1e-5:1e-3 --num-samples 8
    sbatch slurm_ray_start.sh tune --space lr=loguniform:0.01:1 --num-samples 16

The parts, each importing only those listed before it:
  options   TuneOptions, the parser, the space (--space NAME=DIST), Search; no Ray
  trial     the trial function (a `train` run in Tune's trial actor), epoch results to Tune
  control   on the driver: progress lines, ASHA whose stop is a stop request, the search's stop
  report    tune.csv / tune.md / tune.png and the best trial's `train` command, from the run folders
  search    the driver: checks, Tuner (new or restored), report, exit code
"""

from __future__ import annotations


def main(argv: list[str]) -> int:
    from .options import parse_args

    search = parse_args(list(argv))  # bad input fails here, before Ray is imported
    from .search import run_search

    return run_search(search, list(argv))
