"""`python -m ray_job.commands.slurm_plan [MODE] [FLAGS...]`: what slurm_ray_start.sh runs, decided
in Python with the commands' own parsers.

Reads the allocation (ray_job.cluster.slurm.Allocation) and parses the user's mode and flags with the
driver's own parser. Prints NUL-terminated records, for bash's `mapfile -d ''`: one KEY=VALUE per
fact (see `plan_records`), then "--", then the driver's flags (the user's, plus the defaults the job
adds; the script sets only RAY_ADDRESS, the head). Bad input: one line `error: ...`, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from ..cluster.slurm import Allocation
from ..core.errors import UsageError
from ..core.flags import flags_given
from ..core.paths import resolve_path


MODES = ("train", "scale", "tune", "predict", "serve")


NO_GPUS_HINT = ("HINT: submit with sbatch --gpus-per-node=N (or --gres=gpu:N), or train on CPUs "
                "with --no-gpu")


@dataclass(frozen=True)
class DriverPlan:
    """How the script runs `python -m ray_job MODE`, and what it reports about the run."""

    mode: str                # train | scale | tune | predict | serve (serve: no driver)
    args: tuple[str, ...]    # flags for the driver; the script sets RAY_ADDRESS
    storage_path: str        # effective --storage-path, absolute (for the log)
    run_name: str            # effective --name
    use_gpu: bool            # whether the driver trains on GPUs


def split_mode(argv: Sequence[str]) -> tuple[str, list[str]]:
    """The script's first argument is the mode (train when it is a flag or absent)."""
    if not argv or argv[0].startswith("-"):
        return "train", list(argv)
    first, rest = argv[0], list(argv[1:])
    if first not in MODES:
        raise UsageError(f"unknown mode {first!r}. HINT: use train (default), tune, scale, predict or serve")
    return first, rest


def parser_for(mode: str, argv: Sequence[str]) -> argparse.ArgumentParser:
    """The mode's own parser (imported here: a mode's modules load only for that mode)."""
    if mode == "scale":
        from ..scale import build_parser, split_command

        command, rest = split_command(list(argv))
        return build_parser(rest, command)
    if mode == "tune":
        from ..tune.options import build_parser

        return build_parser(list(argv))
    if mode == "predict":
        from ..infer.options import build_predict_parser

        return build_predict_parser()
    from ..config import build_train_parser

    return build_train_parser(argv)


def plan_driver(argv: Sequence[str], alloc: Allocation) -> DriverPlan:
    """The driver's final flags: the user's, plus --storage-path, --name and a GPU flag unless the
    user gave one in any form. Raises UsageError for input the job would fail on."""
    from ..config import config_from_args

    mode, flags = split_mode(argv)
    if mode == "serve":
        if flags:
            raise UsageError(f"serve takes no flags (got {' '.join(flags)}). HINT: give them to the "
                             f"jobs: ray job submit ... -- python -m ray_job train FLAGS")
        return DriverPlan("serve", (), resolve_path(alloc.storage_path), "", alloc.gpus_per_node > 0)
    if mode == "predict":
        return plan_predict(flags, alloc)
    given = flags_given(parser_for(mode, flags), without_command(mode, flags))
    if "address" in given:
        raise UsageError("--address is set by this script; do not pass it")
    added: list[str] = []
    if "storage_path" not in given:
        added += ["--storage-path", alloc.storage_path]
    if "name" not in given:
        added += ["--name", alloc.run_name]
    if "use_gpu" not in given:
        added.append("--use-gpu" if alloc.gpus_per_node else "--no-gpu")
    args = with_command(mode, flags, added)  # ours before the user's: a `--` cannot swallow them
    cfg = config_from_args(parser_for(mode, args).parse_args(without_command(mode, args)))  # validates, as the driver
    if cfg.use_gpu and not alloc.gpus_per_node:
        raise UsageError(f"--use-gpu was given but SLURM gave this job no GPUs. {NO_GPUS_HINT}")
    if mode == "tune":  # the search's own checks (the space, the scheduler), before Ray starts
        from ..tune.options import parse_args as parse_tune_args

        parse_tune_args(list(args))
    if not cfg.storage_path or not cfg.name:
        raise UsageError("--storage-path and --name need a value (a requeued job resumes its run by name)")
    return DriverPlan(mode, tuple(args), resolve_path(cfg.storage_path), cfg.name, bool(cfg.use_gpu))


def plan_predict(flags: Sequence[str], alloc: Allocation) -> DriverPlan:
    """`predict` as the user gave it (it uses the cluster's GPUs when there are any); its checks
    run here, before Ray starts. The log's storage path is the folder of --out."""
    from ..infer.options import parse_predict_args

    opts = parse_predict_args(list(flags))
    if opts.address:
        raise UsageError("--address is set by this script; do not pass it")
    return DriverPlan("predict", tuple(flags), os.path.dirname(resolve_path(opts.out)), "", alloc.gpus_per_node > 0)


def plan_records(alloc: Allocation, plan: DriverPlan) -> list[str]:
    """What `plan` prints; the keys are the script's variable names."""
    facts = dict(JOB_ID=alloc.job_id, RESTART_COUNT=alloc.restart_count,
                 CPUS_PER_NODE=alloc.cpus_per_node, GPUS_PER_NODE=alloc.gpus_per_node,
                 LOG_DIR=alloc.log_dir, MODE=plan.mode, STORAGE_PATH=plan.storage_path,
                 RUN_NAME=plan.run_name, WANT_GPU=int(plan.use_gpu))
    return [f"{key}={value}" for key, value in facts.items()] + ["--", *plan.args]


SUBCOMMANDS = {"scale": ("sweep",)}


def without_command(mode: str, flags: Sequence[str]) -> list[str]:
    """The flags alone, after a mode's subcommand (scale sweep|predict)."""
    flags = list(flags)
    return flags[1:] if flags and flags[0] in SUBCOMMANDS.get(mode, ()) else flags


def with_command(mode: str, flags: Sequence[str], added: Sequence[str]) -> list[str]:
    """`added` in front of the user's flags, behind the mode's subcommand if there is one."""
    flags = list(flags)
    if flags and flags[0] in SUBCOMMANDS.get(mode, ()):
        return [flags[0], *added, *flags[1:]]
    return [*added, *flags]


def main(argv: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        alloc = Allocation.from_env(os.environ if env is None else env)
        # stdout carries the records only: --help (argparse prints it and exits 0, and then
        # there are no records: nothing to run) and anything else go to the job's log.
        with contextlib.redirect_stdout(sys.stderr):
            try:
                plan = plan_driver(argv, alloc)
            except SystemExit as e:
                return e.code if isinstance(e.code, int) else 2
        if plan.mode != "serve" and alloc.gpus_per_node and not plan.use_gpu:
            print(f"warning: {alloc.gpus_per_node} GPU(s) per node allocated but the driver was told not to "
                  f"use them (--no-use-gpu / --no-gpu)", file=sys.stderr)
        sys.stdout.write("".join(f"{record}\0" for record in plan_records(alloc, plan)))
        return 0
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
