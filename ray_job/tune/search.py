"""The search on a Ray cluster: the checks, Ray Tune (a new search, or the same one continued), the
report and the exit code.

Ray Tune's experiment lives in the search folder <storage-path>/<name>/ (its state: tuner.pkl,
experiment_state-*.json, the searcher's state), beside search.json (what this search is), the
trials' run folders trial_NNN/, and the report. The same command again finds Tune's state there and
continues (Tuner.restore): finished and early-stopped trials stay as they are, interrupted ones
resume from their checkpoints, and the searcher goes on where it was.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import shlex
import time
from typing import Any

from .. import storage
from ..core.errors import UsageError
from ..core.exits import ExitCode
from ..storage import StorageError
from ..tracking.settings import CREDENTIAL_VARS
from ..train import tracked
from ..train.driver import check_sizes, open_folder, preflight
from ..train.trainer import connect, resolve_workers, worker_size, workers_that_fit
from . import control, report
from .control import EpochASHA, SearchProgress
from .options import Search, check_against
from .trial import TrialSetup, run_trial, trial_dirname

SEARCH_JSON = "search.json"
# The trial function's actor holds no CPU or GPU: its run's Train workers need them (on a small
# cluster one CPU per trial would leave too few). Tune refuses a request of nothing at all, so it
# asks for one byte of memory.
TRIAL_RESOURCES = {"CPU": 0, "memory": 1}


def run_search(search: Search, argv: list[str]) -> int:
    """`python -m ray_job tune`: the exit code."""
    search = dataclasses.replace(search, base=preflight(search.base))
    search_dir = storage.at(search.base.run_dir())
    record = {**search.record(), "command": "python -m ray_job tune " + shlex.join(argv)}
    check_same_search(record, search_dir)
    open_folder(search_dir)  # without a requeued search's stop request: it must not stop at once
    control.ACTIVE = live = control.SearchControl(search_dir.uri)
    live.take_signals()  # from now on a stop request; again once Tune has put in its own
    try:
        return searched(search, search_dir, record, live)
    except KeyboardInterrupt:  # a second Ctrl-C / SIGTERM before Tune ran
        print(f"tune: aborted by a second {live.signals.reason}", flush=True)
        return live.signals.exit_code
    finally:
        control.ACTIVE = None
        live.give_back_signals()


def searched(search: Search, search_dir: storage.Location, record: dict, live: control.SearchControl) -> int:
    connect(search.base)
    search, at_once = fit_cluster(search)
    storage.write_json(search_dir.join(SEARCH_JSON), record)
    # Our progress lines instead of Tune's tables; no per-trial result files of Tune's (each trial's
    # run folder has its metrics), so no warning that they are missing either.
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    logging.getLogger("ray.tune.analysis.experiment_analysis").setLevel(logging.ERROR)
    meta = describe(search, at_once, record["command"])
    print(f"tune: {meta['how']}\ntune: search folder {search_dir.uri}", flush=True)
    # --mlflow: the search is a parent run, each trial a child (tagged when stopped early)
    parent = tracked.open_parent(search.base, search_dir.uri, "tune",
                                 {"space": " ".join(record["space"]), **record["options"]})
    errors: dict[str, str] = {}
    try:
        grid = tuner_for(search, at_once, parent.run_id if parent else "").fit()
        errors = trial_errors(grid)
    except KeyboardInterrupt:
        print(f"tune: aborted by a second {live.signals.reason}; the trials resume from their last "
              f"checkpoints when the same command runs again", flush=True)
    rows = report.write_report(search, search_dir, meta, errors)
    if live.stop_requested():
        print("search stopped on request; run the same command (same --name) to continue it: finished "
              "and early-stopped trials are kept, the others resume from their checkpoints", flush=True)
        rc = live.signals.exit_code
    else:
        rc = ExitCode.FAILED if any(r["status"] == "failed" for r in rows) else ExitCode.DONE
    tracked.finish_parent(parent, search_dir.uri, report.OUTPUTS, rc)
    return rc


def check_same_search(record: dict, search_dir: storage.Location) -> None:
    """The same --name continues the same search; other values under it are refused."""
    try:
        saved = storage.read_json(search_dir.join(SEARCH_JSON))
    except FileNotFoundError:
        return
    except (StorageError, ValueError) as e:
        raise UsageError(f"cannot read the search's {SEARCH_JSON}: {e}") from None
    differ = [k for k in ("space", "options") if saved.get(k) != record[k]]
    differ += [f"--{k.replace('_', '-')}" for k, v in record["train"].items() if saved.get("train", {}).get(k) != v]
    if differ:
        raise UsageError(f"{search_dir.uri} holds a search with other values ({', '.join(differ[:4])} differ); "
                         f"use a new --name, or the same flags to continue it")


def fit_cluster(search: Search) -> tuple[Search, int]:
    """The workers per trial and the trials at once, checked against the cluster; every value of
    the space checked against the batch split."""
    base = resolve_workers(search.base)  # --num-workers must fit, alone
    fits = workers_that_fit(base.cpus_per_worker, base.gpus_in_use)
    most = fits // base.num_workers
    at_once = search.opts.max_concurrent_trials or min(most, search.opts.num_samples)
    if at_once > most:
        raise UsageError(f"--max-concurrent-trials {at_once} x --num-workers {base.num_workers} = "
                         f"{at_once * base.num_workers} workers of {worker_size(base)} "
                         f"each, but the cluster holds at most {fits}; lower --max-concurrent-trials "
                         f"(at most {most} here) or --num-workers, or add nodes")
    worlds = {base.min_workers or base.num_workers, base.num_workers}
    for world in worlds:
        check_sizes(base, world)
    check_against(search.space, base, worlds, check_sizes)
    return dataclasses.replace(search, base=base), at_once


def describe(search: Search, at_once: int, command: str) -> dict:
    """The report's header facts."""
    o, b = search.opts, search.base
    how = (f"{o.num_samples} trials of {b.epochs} epochs, {at_once} at once, {b.num_workers} worker(s) each; "
           f"search {o.search} (seed {o.search_seed}), scheduler {o.scheduler}"
           + (f" (grace {o.grace_epochs} epochs, reduction factor {o.reduction_factor:g})" if o.scheduler == "asha"
              else "") + f"; metric {o.metric} ({o.direction})")
    return dict(name=b.name, date=time.strftime("%Y-%m-%d %H:%M:%S %z"), host=platform.node(), command=command,
                how=how, metric=o.metric, log_scale={d.name: d.kind == "loguniform" for d in search.space})


def tuner_for(search: Search, at_once: int, parent_id: str = ""):
    """A new Tuner, or the search's own continued from its state in the search folder."""
    from ray import tune

    root = storage.at(search.base.storage_path)
    fs = storage.for_ray(root, search.base.retry_storage_s)
    search_dir = root.join(search.base.name)
    setup = TrialSetup(base=search.base.to_dict(), search_dir=search_dir.uri,
                       env=trial_env(root.is_local, search.base.mlflow), parent_id=parent_id)
    trainable = tune.with_resources(tune.with_parameters(run_trial, setup=setup), TRIAL_RESOURCES)
    if tune.Tuner.can_restore(search_dir.path, storage_filesystem=fs):
        print(f"tune: continuing the search {search.base.name!r} from its saved state", flush=True)
        return tune.Tuner.restore(search_dir.path, trainable, resume_unfinished=True, resume_errored=False,
                                  storage_filesystem=fs)
    o = search.opts
    asha = (EpochASHA(search_dir.uri, o.metric, search.base.epochs, o.grace_epochs, o.reduction_factor)
            if o.scheduler == "asha" else None)
    return tune.Tuner(
        trainable,
        param_space={d.name: d.to_tune() for d in search.space},
        tune_config=tune.TuneConfig(
            metric=o.metric, mode=o.direction, num_samples=o.num_samples,
            scheduler=asha, search_alg=searcher_for(search, at_once),
            trial_name_creator=trial_dirname, trial_dirname_creator=trial_dirname, reuse_actors=False),
        run_config=tune.RunConfig(
            name=search.base.name, storage_path=root.path, storage_filesystem=fs, verbose=0,
            failure_config=tune.FailureConfig(max_failures=0),
            callbacks=[SearchProgress(o.metric, o.direction, search.base.epochs, o.num_samples, search_dir.uri)]))


def trial_env(local: bool, mlflow: bool) -> tuple[tuple[str, str], ...]:
    """The settings of the user's shell that a trial's actor needs and may not have: object
    storage's (AWS_*) and the tracking server's credentials (MLFLOW_TRACKING_*)."""
    wanted = (() if local else ("AWS_",)) + (tuple(CREDENTIAL_VARS) if mlflow else ())
    return tuple((k, v) for k, v in os.environ.items() if k.startswith(wanted))


def searcher_for(search: Search, at_once: int) -> Any:
    """The search algorithm, limited to `at_once` trials at a time (Tune's max_concurrent_trials
    wraps Optuna, but not the random search, which takes the limit itself)."""
    if search.opts.search == "optuna":
        from ray.tune.search import ConcurrencyLimiter
        from ray.tune.search.optuna import OptunaSearch

        return ConcurrencyLimiter(OptunaSearch(seed=search.opts.search_seed), max_concurrent=at_once)
    from ray.tune.search import BasicVariantGenerator

    return BasicVariantGenerator(random_state=search.opts.search_seed, max_concurrent=at_once)


def trial_errors(grid: Any) -> dict[str, str]:
    """trial folder -> the one-line error of each failed trial (Tune's record)."""
    errors = {}
    for result in grid:
        if result.error is not None:
            name = str(result.path).rstrip("/").rsplit("/", 1)[-1]
            lines = [ln for ln in str(result.error).splitlines() if ln.strip()]
            errors[name] = (lines[-1] if lines else type(result.error).__name__)[:300]
    return errors
