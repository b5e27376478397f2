"""The `train` flags, generated from TrainConfig's fields: one flag per field, same default, same help."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

from ..core.errors import UsageError
from ..core.flags import ArgumentParser, Formatter, add_dataclass_args
from .run import RECIPES, TrainConfig


GROUP_TITLES = {
    "cluster": "cluster and workers",
    "optimisation": "schedule and optimisation",
    "model": "model",
    "data": "data",
    "speed": "speed (GPU fast path)",
    "results": "results, checkpoints and fault tolerance",
    "tracking": "experiment tracking (MLflow)",
}


def add_config_args(parser: argparse.ArgumentParser, skip: Sequence[str] = ()) -> None:
    add_dataclass_args(parser, TrainConfig, skip, GROUP_TITLES)


def apply_recipe(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Makes the chosen --recipe's values the defaults, so explicit flags still override them."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--recipe", default="default")
    known, _ = pre.parse_known_args(argv)
    if known.recipe not in RECIPES:
        raise UsageError(f"--recipe {known.recipe!r} is not one of: {', '.join(RECIPES)}")
    parser.set_defaults(**RECIPES[known.recipe])


def config_from_args(ns: argparse.Namespace, **overrides: Any) -> TrainConfig:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(ns).items() if k in names}
    return TrainConfig(**{**values, **overrides})


def build_train_parser(argv: Sequence[str], prog: str = "python -m ray_job train") -> ArgumentParser:
    """The `train` parser, with the --recipe named in `argv` applied to its defaults."""
    parser = ArgumentParser(prog=prog, formatter_class=Formatter, description=TRAIN_DESCRIPTION)
    add_config_args(parser)
    apply_recipe(parser, argv)
    return parser


def parse_train_args(argv: Optional[Sequence[str]], prog: str = "python -m ray_job train") -> TrainConfig:
    argv = list(argv or [])
    return config_from_args(build_train_parser(argv, prog).parse_args(argv))


TRAIN_DESCRIPTION = """\
Train a ResNet on CIFAR-10 with Ray Train (DDP: NCCL on GPUs, gloo on CPUs).

Joins the Ray cluster given by --address / $RAY_ADDRESS, or starts a local one. Results go to
<storage-path>/<name>/: metrics.jsonl/.csv, TensorBoard events, config.json, Ray checkpoints.
Running again with the same --name continues from the latest checkpoint.

examples:
  python -m ray_job train --data synthetic --num-workers 2 --epochs 2
  python -m ray_job train --data cifar10 --data-dir /shared/cifar10 --recipe fast --address auto
"""
