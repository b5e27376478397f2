"""The flags of `tune`: what to search and how (TuneOptions), the space, plus every `train` flag,
fixed for all trials. Parsed and checked without Ray: a bad search fails in a second, before any
trial starts.

The space, `--space NAME=DIST` over numeric `train` flags:

    lr=loguniform:0.001:1        log-uniform between the two bounds (both > 0)
    weight_decay=uniform:0:1e-3  uniform between the two bounds
    warmup_epochs=randint:0:3    a whole number from the first to the second, both included
    batch_size=choice:64,128,256 one of the values listed

NAME is a `train` flag (`lr`, `--weight-decay` and `weight-decay` all name the same field). A flag
can be searched when it is a number and changes what a run computes; the run's length (--epochs:
the scheduler's budget) and its workers (fixed by the cluster check) cannot. Every bound and choice
is checked against the train config's own rules, so a bad space fails before any trial starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

from ..config import TrainConfig, config_from_args
from ..config.parser import add_config_args, apply_recipe
from ..config.families import model_label
from ..core.errors import UsageError
from ..core.flags import ArgumentParser, Formatter, add_dataclass_args, flag_name, flags_given, option

KINDS = ("choice", "uniform", "loguniform", "randint")
# Numbers that are not hyperparameters of a trial: the search's budget and the cluster's shape.
NOT_SEARCHABLE = ("epochs", "num_workers", "min_workers", "cpus_per_worker", "gpus_per_worker")
Number = Union[int, float, str]
# What a trial reports at each epoch's end that a search may rank trials by, with its direction.
METRICS = {"test_acc": "max", "test_loss": "min", "train_acc": "max", "train_loss": "min",
           "images_per_s": "max"}
# Train defaults that suit many runs printing into one log: epoch lines only, no live bar.
TUNE_DEFAULTS = dict(epochs=10, log_every=0, progress="lines")


# Words a search may choose among (choice only): what is trained and how, not where or on what data.
WORDS = ("model", "optimizer", "schedule", "stem", "precision", "batch_mode")


def searchable_fields() -> dict[str, type]:
    """Field name -> int, float or str, for every train flag a space may name."""
    return {f.name: type(f.default) for f in dataclasses.fields(TrainConfig)
            if (type(f.default) in (int, float) and f.metadata.get("affects_result", True)
                or f.name in WORDS) and f.name not in NOT_SEARCHABLE}


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

    def to_tune(self) -> Any:
        """The Ray Tune domain (ray.tune.choice / uniform / loguniform / randint)."""
        from ray import tune

        if self.kind == "choice":
            return tune.choice(list(self.args))
        if self.kind == "randint":  # Ray's upper bound is exclusive; ours is included
            return tune.randint(int(self.args[0]), int(self.args[1]) + 1)
        return getattr(tune, self.kind)(float(self.args[0]), float(self.args[1]))


def _num(value: Number) -> str:
    return format(value, "g") if isinstance(value, float) else str(value)


def _parse_number(text: str, kind: type, where: str) -> Number:
    if kind is str:
        return text
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
                "not a numeric train flag that changes what a run computes, nor one of the words "
                "a search may choose among")
        raise UsageError(f"--space {spec!r}: cannot search {name!r} ({hint}); searchable: "
                         f"{', '.join(sorted(fields))}")
    if kind not in KINDS:
        raise UsageError(f"--space {spec!r}: unknown distribution {kind!r}; use one of {', '.join(KINDS)}")
    value_type = int if kind == "randint" else fields[name]
    if fields[name] is str and kind != "choice":
        raise UsageError(f"--space {spec!r}: --{flag_name(name)} takes words: use choice:A,B,...")
    if kind in ("uniform", "loguniform") and value_type is int:
        raise UsageError(f"--space {spec!r}: --{flag_name(name)} takes whole numbers; use randint:LO:HI "
                         f"or choice:A,B,...")
    parts = [p.strip() for p in args.split("," if kind == "choice" else ":")]
    values = tuple(_parse_number(p, value_type, f"{name}={kind}") for p in parts if p)
    if kind == "choice":
        if not values:
            raise UsageError(f"--space {spec!r}: choice needs at least one value: choice:A,B,...")
        if len(set(values)) != len(values):
            raise UsageError(f"--space {spec!r}: a value is listed twice")
        return Dist(name, kind, values)
    if len(values) != 2:
        raise UsageError(f"--space {spec!r}: {kind} takes two bounds: {kind}:LOW:HIGH")
    low, high = values
    if kind == "randint" and low > high or kind != "randint" and low >= high:
        raise UsageError(f"--space {spec!r}: the low bound must be below the high bound")
    if kind == "loguniform" and low <= 0:
        raise UsageError(f"--space {spec!r}: loguniform needs bounds above 0")
    return Dist(name, kind, values)


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
        for value in d.args:
            try:
                cfg = dataclasses.replace(base, **{d.name: value})
                if d.name == "model":  # a name or a module that builds no model: one line now
                    from ..model import zoo  # torchvision: seconds, paid only when a model is searched

                    zoo.check(cfg, 10)
                for world in world_sizes:
                    check(cfg, world)
            except UsageError as e:
                raise UsageError(f"--space {d.text}: with {d.name}={_num(value)}: {e}") from None


def values_text(config: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in config.items())


def trial_config(base: TrainConfig, values: dict[str, Any]) -> TrainConfig:
    """The fixed flags with a trial's sampled values put in (numbers of the field's own type)."""
    kinds = searchable_fields()
    return dataclasses.replace(base, **{k: kinds[k](v) for k, v in values.items()})


@dataclass(frozen=True)
class TuneOptions:
    """How to search; the train flags (fixed for every trial) come with the TrainConfig."""

    space: tuple[str, ...] = option((), "a searched train flag: NAME=choice:A,B,... | uniform:LOW:HIGH | "
                                    "loguniform:LOW:HIGH | randint:LOW:HIGH (both bounds included); "
                                    "repeat for more flags, e.g. --space lr=loguniform:0.01:1 "
                                    "--space batch_size=choice:64,128")
    num_samples: int = option(8, "trials to run")
    max_concurrent_trials: int = option(0, "trials running at once (each with --num-workers workers); "
                                        "0 = as many as the cluster holds")
    scheduler: str = option("asha", "asha: stop trials that are behind at epoch ends (successive "
                            "halving); none: run every trial for all --epochs", choices=("asha", "none"))
    search: str = option("random", "random: sample the space; optuna: a model of the results so far "
                         "proposes the next trial (TPE)", choices=("random", "optuna"))
    metric: str = option("test_acc", "epoch metric that ranks trials", choices=tuple(METRICS))
    mode: str = option("auto", "max or min the metric (auto: max for accuracies and images/s, min "
                       "for losses)", choices=("auto", "max", "min"))
    grace_epochs: int = option(1, "asha: epochs every trial runs before it may be stopped")
    reduction_factor: float = option(3.0, "asha: keep about 1/R of the trials at each rung (epochs "
                                     "G, G*R, G*R^2, ...)")
    search_seed: int = option(0, "seed of the sampler (random and optuna), so the same command "
                              "proposes the same trials")

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise UsageError(f"--num-samples must be at least 1, got {self.num_samples}")
        if self.max_concurrent_trials < 0:
            raise UsageError("--max-concurrent-trials must be 0 (as many as fit) or a count")
        if self.grace_epochs < 1:
            raise UsageError(f"--grace-epochs must be at least 1, got {self.grace_epochs}")
        if self.reduction_factor <= 1:
            raise UsageError(f"--reduction-factor must be above 1, got {self.reduction_factor:g}")

    @property
    def direction(self) -> str:
        return METRICS[self.metric] if self.mode == "auto" else self.mode


@dataclass(frozen=True)
class Search:
    """One search: how, over what, and the train flags every trial shares."""

    opts: TuneOptions
    space: tuple[Dist, ...]
    base: TrainConfig          # name = the search's name; storage_path = where the search goes

    def record(self) -> dict:
        """What makes this search this search (search.json): a run of the same command continues
        it; other values under the same name are refused. Where and how wide it runs may change."""
        opts = {k: v for k, v in dataclasses.asdict(self.opts).items() if k not in ("space", "max_concurrent_trials")}
        return dict(space=[d.text for d in self.space], options=opts, train=self.base.computed())


def build_parser(argv: list[str]) -> ArgumentParser:
    parser = ArgumentParser(prog="python -m ray_job tune", formatter_class=Formatter, description=DESCRIPTION)
    search = parser.add_argument_group("the search")
    add_dataclass_args(search, TuneOptions, skip=("space",))
    search.add_argument("--space", dest="space", action=Extend, nargs="+", default=[], metavar="NAME=DIST",
                        help=TuneOptions.__dataclass_fields__["space"].metadata["help"])
    add_config_args(parser)
    apply_recipe(parser, argv)
    parser.set_defaults(**TUNE_DEFAULTS)
    return parser


class Extend(argparse.Action):
    """argparse's "extend", also over a namespace that holds no list yet (flags_given's)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, [*(current if isinstance(current, list) else []), *values])


def parse_args(argv: list[str]) -> Search:
    parser = build_parser(argv)
    ns = parser.parse_args(argv)
    opts = TuneOptions(**{f.name: (tuple(getattr(ns, f.name)) if f.name == "space" else getattr(ns, f.name))
                          for f in dataclasses.fields(TuneOptions)})
    space = parse_space(list(opts.space))
    fixed = flags_given(parser, argv) & {d.name for d in space}
    if fixed:
        name = sorted(fixed)[0]
        raise UsageError(f"--{flag_name(name)} is given and searched (--space {name}=...); drop one of them")
    base = config_from_args(ns)
    if opts.scheduler == "asha" and opts.grace_epochs > base.epochs:
        raise UsageError(f"--grace-epochs {opts.grace_epochs} is more than --epochs {base.epochs}: "
                         f"no trial could be stopped early; lower it or use --scheduler none")
    # the config's own rules for every value now; the batch split again once the workers are known
    check_against(space, base, {base.num_workers} if base.num_workers else set(),
                  lambda cfg, world: cfg.per_worker_batch(world))
    search = Search(opts, space, base)
    if not base.name:
        digest = hashlib.sha1(json.dumps(search.record(), sort_keys=True).encode()).hexdigest()[:8]
        name = f"tune_{base.data}_{model_label(base.model)}_{digest}"
        search = dataclasses.replace(search, base=dataclasses.replace(base, name=name))
    return search


DESCRIPTION = """\
Search hyperparameters with Ray Tune: each trial is an ordinary `train` run (its own folder,
metrics, TensorBoard, checkpoints, summary.json) in <storage-path>/<name>/trial_NNN/, with the
searched flags set to sampled values and every other flag as given here. ASHA stops trials that
are behind at epoch ends. At the end: tune.csv, tune.md, tune.png in <storage-path>/<name>/, and
the `train` command that continues the best trial.

Stop requests (SIGUSR1, Ctrl-C, SIGTERM) checkpoint the running trials; the same command continues
the same search: finished and early-stopped trials are not run again, the others resume.

examples:
  python -m ray_job tune --data synthetic --model resnet18 --epochs 4 --num-workers 1 \\
      --space lr=loguniform:0.001:1 --space weight_decay=loguniform:1e-5:1e-3 --num-samples 8
  sbatch slurm_ray_start.sh tune --space lr=loguniform:0.01:1 --num-samples 16 --search optuna
"""
