"""The flags of `tune`: what to search and how (TuneOptions), plus every `train` flag, fixed for all
trials. Parsed and checked without Ray: a bad search fails in a second, before any trial starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from dataclasses import dataclass
from ..config import TrainConfig, config_from_args
from ..config.parser import add_config_args, apply_recipe
from ..config.run import UNREAD_BY_DATA
from ..core.errors import UsageError
from ..core.flags import ArgumentParser, Formatter, add_dataclass_args, flag_name, flags_given, option
from .space import Dist, check_against, parse_space

# What a trial reports at each epoch's end that a search may rank trials by, with its direction.
METRICS = {"test_acc": "max", "test_loss": "min", "train_acc": "max", "train_loss": "min",
           "images_per_s": "max"}
# Train defaults that suit many runs printing into one log: epoch lines only, no live bar.
TUNE_DEFAULTS = dict(epochs=10, log_every=0, progress="lines")


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

    def search_dir(self) -> str:
        return self.base.run_dir()

    def record(self) -> dict:
        """What makes this search this search (search.json): a run of the same command continues
        it; other values under the same name are refused. Where and how wide it runs may change."""
        opts = {k: v for k, v in dataclasses.asdict(self.opts).items() if k not in ("space", "max_concurrent_trials")}
        unread = ("name", "storage_path", *UNREAD_BY_DATA[self.base.data])
        base = {k: v for k, v in self.base.result_fields().items() if k not in unread}
        return dict(space=[d.text for d in self.space], options=opts, train=base)

    def default_name(self) -> str:
        digest = hashlib.sha1(json.dumps(self.record(), sort_keys=True).encode()).hexdigest()[:8]
        return f"tune_{self.base.data}_{self.base.model}_{digest}"


def build_parser(argv: list[str]) -> ArgumentParser:
    parser = ArgumentParser(prog="python -m ray_job tune", formatter_class=Formatter, description=DESCRIPTION)
    search = parser.add_argument_group("the search")
    add_dataclass_args(search, TuneOptions, skip=("space",))
    search.add_argument("--space", dest="space", action=Extend, nargs="+", default=[], metavar="NAME=DIST",
                        help=_field_help("space"))
    add_config_args(parser)
    apply_recipe(parser, argv)
    parser.set_defaults(**TUNE_DEFAULTS)
    return parser


class Extend(argparse.Action):
    """argparse's "extend", also over a namespace that holds no list yet (flags_given's)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, [*(current if isinstance(current, list) else []), *values])


def _field_help(name: str) -> str:
    return next(f.metadata["help"] for f in dataclasses.fields(TuneOptions) if f.name == name)


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
        search = dataclasses.replace(search, base=dataclasses.replace(base, name=search.default_name()))
    return search


def searched_values(search: Search, cfg: dict) -> dict:
    """The searched flags' values in a trial's config (its config.json)."""
    return {d.name: cfg.get(d.name) for d in search.space}


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
