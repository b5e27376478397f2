"""Command-line flags generated from TrainConfig's fields: one flag per field, same default, same help."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

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
    if "type" in field.metadata:
        return field.metadata["type"]
    return str if field.default is None else type(field.default)


def option(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field that `add_dataclass_args` turns into a flag (kw: choices, bool_flag, ...)."""
    return dataclasses.field(default=default, metadata={"help": help, **kw})


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, skip: Sequence[str] = (),
                       titles: Optional[dict] = None) -> None:
    """One flag per field of the dataclass `cls`: same name (`-` for `_`), default, help, choices.

    Fields may carry metadata: help, group (an argument group, titled by `titles`), choices,
    bool_flag (--x/--no-x; implied for bool defaults) and type (for Optional fields).
    """
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        meta = f.metadata
        name = meta.get("group")
        group = parser if name is None else groups.get(name) or groups.setdefault(
            name, parser.add_argument_group((titles or {}).get(name, name)))
        flag = f"--{_flag(f.name)}"
        if meta.get("bool_flag") or isinstance(f.default, bool):
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=f.default, help=meta.get("help"))
        else:
            group.add_argument(flag, dest=f.name, type=_value_type(f), default=f.default,
                               choices=meta.get("choices"), help=meta.get("help"),
                               metavar=None if meta.get("choices") else f.name.upper())
        if f.name == "use_gpu":
            group.add_argument("--no-gpu", dest="use_gpu", action="store_false",
                               default=argparse.SUPPRESS,
                               help="same as --no-use-gpu: train on CPUs with gloo")


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
