"""Command-line flags generated from TrainConfig's fields: one flag per field, same default, same help."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Optional, Sequence

from .config import RECIPES, TrainConfig, UsageError, _flag

GROUP_TITLES = {
    "cluster": "cluster and workers",
    "optimisation": "schedule and optimisation",
    "model": "model",
    "data": "data",
    "speed": "speed (GPU fast path)",
    "results": "results, checkpoints and fault tolerance",
}


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises UsageError (one line, exit 2 via the dispatcher) instead of exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see `python -m ray_job {self.prog.split()[-1]} --help`)")


def _value_type(field: dataclasses.Field) -> Any:
    if field.name == "address":
        return str
    return type(field.default)


def add_config_args(parser: argparse.ArgumentParser, skip: Sequence[str] = ()) -> None:
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(TrainConfig):
        if f.name in skip:
            continue
        meta = f.metadata
        group = groups.get(meta["group"]) or groups.setdefault(
            meta["group"], parser.add_argument_group(GROUP_TITLES[meta["group"]]))
        flag = f"--{_flag(f.name)}"
        if meta.get("bool_flag"):
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=f.default, help=meta["help"])
        else:
            group.add_argument(flag, dest=f.name, type=_value_type(f), default=f.default,
                               choices=meta.get("choices"), help=meta["help"],
                               metavar=None if meta.get("choices") else f.name.upper())
        if f.name == "use_gpu":
            group.add_argument("--no-gpu", dest="use_gpu", action="store_false",
                               help="same as --no-use-gpu: train on CPUs with gloo")


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


def parse_train_args(argv: Optional[Sequence[str]], prog: str = "python -m ray_job train") -> TrainConfig:
    parser = ArgumentParser(prog=prog, formatter_class=Formatter, description=TRAIN_DESCRIPTION)
    add_config_args(parser)
    apply_recipe(parser, argv or [])
    return config_from_args(parser.parse_args(argv))


TRAIN_DESCRIPTION = """\
Train a ResNet on CIFAR-10 with Ray Train (DDP: NCCL on GPUs, gloo on CPUs).

Joins the Ray cluster given by --address / $RAY_ADDRESS, or starts a local one. Results go to
<storage-path>/<name>/: metrics.jsonl/.csv, TensorBoard events, config.json, Ray checkpoints.
Running again with the same --name continues from the latest checkpoint.

examples:
  python -m ray_job train --data synthetic --num-workers 2 --epochs 2
  python -m ray_job train --data cifar10 --data-dir /shared/cifar10 --recipe fast --address auto
"""
