"""The search space: `--space NAME=DIST` over numeric `train` flags, parsed and checked without Ray.

    lr=loguniform:0.001:1        log-uniform between the two bounds (both > 0)
    weight_decay=uniform:0:1e-3  uniform between the two bounds
    warmup_epochs=randint:0:3    a whole number from the first to the second, both included
    batch_size=choice:64,128,256 one of the values listed

NAME is a `train` flag (`lr`, `--weight-decay` and `weight-decay` all name the same field). A flag
can be searched when it is a number and changes what a run computes; the run's length (--epochs:
the scheduler's budget) and its workers (fixed by the cluster check) cannot. Every bound and choice
is checked against the train config's own rules here, so a bad space fails before any trial starts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Union
from collections.abc import Callable

from ..config import TrainConfig
from ..core.errors import UsageError
from ..core.flags import flag_name

KINDS = ("choice", "uniform", "loguniform", "randint")
# Numbers that are not hyperparameters of a trial: the search's budget and the cluster's shape.
NOT_SEARCHABLE = ("epochs", "num_workers", "min_workers", "cpus_per_worker", "gpus_per_worker")
Number = Union[int, float]


def searchable_fields() -> dict[str, type]:
    """Field name -> int or float, for every train flag a space may name."""
    fields = {}
    for f in dataclasses.fields(TrainConfig):
        kind = type(f.default)
        if kind in (int, float) and f.metadata.get("affects_result", True) and f.name not in NOT_SEARCHABLE:
            fields[f.name] = kind
    return fields


@dataclass(frozen=True)
class Dist:
    """One searched flag: its field, the distribution and its arguments (bounds, or the choices)."""

    name: str
    kind: str
    args: tuple[Number, ...]

    @property
    def text(self) -> str:
        """How the user wrote it (normalised): NAME=KIND:ARGS."""
        sep = "," if self.kind == "choice" else ":"
        return f"{self.name}={self.kind}:{sep.join(_num(a) for a in self.args)}"

    def extremes(self) -> tuple[Number, ...]:
        """The values to check against the train config: every choice, or both bounds."""
        return self.args

    def to_tune(self) -> Any:
        """The Ray Tune domain (ray.tune.choice / uniform / loguniform / randint)."""
        from ray import tune

        if self.kind == "choice":
            return tune.choice(list(self.args))
        if self.kind == "randint":  # Ray's upper bound is exclusive; ours is included
            return tune.randint(int(self.args[0]), int(self.args[1]) + 1)
        return getattr(tune, self.kind)(float(self.args[0]), float(self.args[1]))


def _num(value: Number) -> str:
    return str(value) if isinstance(value, int) else format(value, "g")


def _parse_number(text: str, kind: type, where: str) -> Number:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"--space {where}: {text!r} is not a number") from None
    if not math.isfinite(value):
        raise UsageError(f"--space {where}: {text!r} is not a finite number")
    if kind is int:
        if value != int(value):
            raise UsageError(f"--space {where}: {text!r} is not a whole number (--{flag_name(where.split('=')[0])} "
                             f"takes whole numbers)")
        return int(value)
    return value


def parse_dist(spec: str) -> Dist:
    """NAME=KIND:ARGS -> Dist, or UsageError saying what is wrong and what is accepted."""
    fields = searchable_fields()
    name, eq, rest = spec.partition("=")
    name = name.strip().lstrip("-").replace("-", "_")
    kind, colon, args = rest.partition(":")
    if not eq or not colon or not name:
        raise UsageError(f"--space {spec!r}: write NAME=DIST, e.g. lr=loguniform:0.001:1 or "
                         f"batch_size=choice:64,128 (DIST: {', '.join(KINDS)})")
    if name not in fields:
        hint = ("it is fixed for the whole search" if name in NOT_SEARCHABLE else
                "not a numeric train flag that changes what a run computes")
        raise UsageError(f"--space {spec!r}: cannot search {name!r} ({hint}); searchable: "
                         f"{', '.join(sorted(fields))}")
    if kind not in KINDS:
        raise UsageError(f"--space {spec!r}: unknown distribution {kind!r}; use one of {', '.join(KINDS)}")
    value_type = int if kind == "randint" else fields[name]
    if kind in ("uniform", "loguniform") and value_type is int:
        raise UsageError(f"--space {spec!r}: --{flag_name(name)} takes whole numbers; use randint:LO:HI "
                         f"or choice:A,B,...")
    parts = [p.strip() for p in args.split("," if kind == "choice" else ":")]
    values = tuple(_parse_number(p, value_type, f"{name}={kind}") for p in parts if p)
    check_args(spec, kind, values)
    return Dist(name, kind, values)


def check_args(spec: str, kind: str, values: tuple[Number, ...]) -> None:
    if kind == "choice":
        if not values:
            raise UsageError(f"--space {spec!r}: choice needs at least one value: choice:A,B,...")
        if len(set(values)) != len(values):
            raise UsageError(f"--space {spec!r}: a value is listed twice")
        return
    if len(values) != 2:
        raise UsageError(f"--space {spec!r}: {kind} takes two bounds: {kind}:LOW:HIGH")
    low, high = values
    if kind == "randint" and low > high or kind != "randint" and low >= high:
        raise UsageError(f"--space {spec!r}: the low bound must be below the high bound")
    if kind == "loguniform" and low <= 0:
        raise UsageError(f"--space {spec!r}: loguniform needs bounds above 0")


def parse_space(specs: list[str]) -> tuple[Dist, ...]:
    """Every --space given, each flag at most once; at least one."""
    if not specs:
        raise UsageError("nothing to search: give at least one --space NAME=DIST, e.g. "
                         "--space lr=loguniform:0.001:1")
    dists = tuple(parse_dist(s) for s in specs)
    names = [d.name for d in dists]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UsageError(f"--space names {', '.join(twice)} more than once; give each flag one distribution")
    return dists


def check_against(dists: tuple[Dist, ...], base: TrainConfig, world_sizes: set[int],
                  check: Callable[[TrainConfig, int], None]) -> None:
    """Every choice and bound makes a valid train config: the config's own rules, and `check(cfg,
    world)` (the driver's size checks) for every world size a trial may run at."""
    for d in dists:
        for value in d.extremes():
            try:
                cfg = dataclasses.replace(base, **{d.name: value})
                for world in world_sizes:
                    check(cfg, world)
            except UsageError as e:
                raise UsageError(f"--space {d.text}: with {d.name}={_num(value)}: {e}") from None


def trial_config(base: TrainConfig, values: dict[str, Any]) -> TrainConfig:
    """The train config of one trial: the fixed flags with the sampled values put in (numbers of
    the field's own type)."""
    kinds = searchable_fields()
    typed = {k: kinds[k](v) for k, v in values.items()}
    return dataclasses.replace(base, **typed)
