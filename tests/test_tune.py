"""`python -m ray_job tune`: the search space and the flags without Ray (bad input fails in seconds,
before any trial), and one real search on the session's Ray head, run the way the docs say (the CLI
from a user's folder, relative paths): Ctrl-C while a trial trains, then the same command again --
the finished trials are not run again, the interrupted one resumes from its checkpoint, ASHA stops
the trial whose LR is orders of magnitude too small, and the table, the plot and the best trial's
`train` command come out. And `sbatch slurm_ray_start.sh tune` on the 2-node test SLURM cluster:
USR1 in the middle, requeue, the same search continues and completes. And a search on S3."""

from __future__ import annotations

import csv
import re
import signal
import time

import pytest

from conftest import (TINY, Running, assert_refused_before_ray, events, one_error_line, run_cli, strict_file,
                      user_env)
from processes import Hold
from ray_job.config import build_train_parser, config_from_args
from ray_job.core.errors import UsageError
from ray_job.train import stop
from ray_job.tune.options import parse_args, parse_dist, parse_space
from ray_job.tune.report import train_command
from ray_job.tune.trial import EpochResults

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --- the space and the flags, without Ray -------------------------------------------------------

@pytest.mark.parametrize("spec, kind, args", [
    ("lr=loguniform:0.001:1", "loguniform", (0.001, 1.0)),
    ("--weight-decay=uniform:0:1e-3", "uniform", (0.0, 1e-3)),
    ("batch_size=choice:64,128", "choice", (64, 128)),
    ("warmup_epochs=randint:0:3", "randint", (0, 3)),
])
def test_space_specs_are_read(spec, kind, args):
    d = parse_dist(spec)
    assert (d.kind, d.args) == (kind, args)
    assert parse_dist(d.text) == d  # the normalised text reads back the same


@pytest.mark.parametrize("spec, words", [
    ("lrr=uniform:0:1", "cannot search 'lrr'"),
    ("epochs=choice:1,2", "fixed for the whole search"),
    ("lr=gauss:0:1", "unknown distribution 'gauss'"),
    ("lr=uniform:1:0.1", "low bound must be below"),
    ("lr=loguniform:0:1", "bounds above 0"),
    ("batch_size=uniform:32:64", "takes whole numbers"),
    ("batch_size=choice:64,6.5", "not a whole number"),
    ("lr=uniform:0.1", "takes two bounds"),
    ("lr", "write NAME=DIST"),
    ("lr=choice:x", "not a number"),
])
def test_bad_space_specs_say_what_is_wrong(spec, words):
    with pytest.raises(UsageError, match=words):
        parse_space([spec])


def test_values_are_checked_against_the_train_config():
    with pytest.raises(UsageError, match="label_smoothing=1.5.*below 1"):
        parse_args(["--space", "label_smoothing=uniform:0:1.5"])
    with pytest.raises(UsageError, match="smaller than the 2 workers"):
        parse_args(["--space", "batch_size=choice:1,64", "--num-workers", "2"])
    with pytest.raises(UsageError, match="given and searched"):
        parse_args(["--lr", "0.1", "--space", "lr=uniform:0.1:1"])
    with pytest.raises(UsageError, match="more than once"):
        parse_args(["--space", "lr=uniform:0.1:1", "lr=uniform:0.2:1"])


def test_same_flags_same_search_name():
    a = parse_args(["--space", "lr=loguniform:0.01:1", "--data", "synthetic"])
    b = parse_args(["--data", "synthetic", "--space", "lr=loguniform:0.010:1.0"])
    c = parse_args(["--space", "lr=loguniform:0.01:1", "--data", "synthetic", "--seed", "1"])
    assert a.base.name == b.base.name != c.base.name and a.base.name.startswith("tune_synthetic_")
    assert (a.opts.direction, parse_args(["--space", "lr=uniform:0:1", "--metric", "test_loss"]).opts.direction) \
        == ("max", "min")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("args, words", [
    (["--space", "lr=loguniform:0:1"], "--space 'lr=loguniform:0:1': loguniform needs bounds above 0"),
    (["--space", "nope=choice:1,2"], "cannot search 'nope'"),
    (["--space", "lr=uniform:0.1:1", "--metric", "accuracy"], "argument --metric: invalid choice"),
    (["--space", "lr=uniform:0.1:1", "--epochs", "2", "--grace-epochs", "3"], "--grace-epochs 3 is more than"),
    ([], "nothing to search"),
])
def test_bad_searches_fail_before_ray_with_one_line(tmp_path, args, words):
    out = run_cli("tune", *args, "--storage-path", "results", cwd=tmp_path)
    assert out.returncode == 2 and words in one_error_line(out.stderr), out.stderr
    assert_refused_before_ray(out)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_best_command_rebuilds_the_trial_config_exactly():
    cfg = parse_args(["--space", "lr=uniform:0.1:1", "--data", "synthetic", "--recipe", "fast",
                      "--no-decay-norm-bias", "--lr-ref-batch", "512"]).base
    trial = dict(cfg.to_dict(), lr=0.123456789012345, use_gpu=False, num_workers=2, decay_norm_bias=True)
    command = train_command(trial, "/runs/s", "trial_003")
    args = command.split()[4:]
    again = config_from_args(build_train_parser(args).parse_args(args)).to_dict()
    for key in ("address", "progress", "data_dir"):
        trial.pop(key), again.pop(key)
    assert again == {**trial, "storage_path": "/runs/s", "name": "trial_003"}


class _Queue(list):
    put = list.append


def test_only_epoch_results_reach_tune():
    """The worker loop reports epochs (with train_loss), finished background uploads (the epoch's
    metrics again, once), and timed / stop checkpoints (test_acc -1): Tune gets the epochs."""
    callback = object.__new__(EpochResults)
    callback._training_actor_item_queue = queue = _Queue()  # what TuneReportCallback puts results on
    epoch = {"epoch": 1, "train_loss": 2.0, "test_acc": 0.3}
    for metrics in ([epoch, {}], [{"epoch": 0, "step": 5, "preempted": True, "test_acc": -1.0}, {}], [{}, {}]):
        callback.after_report(None, metrics, checkpoint=object())
    assert queue == [epoch]  # and no checkpoint path: a trial's checkpoints are its run's



def test_the_end_lines_the_counts_and_the_table_say_what_the_trials_did(tmp_path, capsys):
    """3 trials of 2 short epochs: ASHA asked trial_001 and trial_002 to stop after epoch 1, but
    trial_002's last epoch was over before the request reached its run. The lines, the counts and
    the table all say what the run folders hold: trial_002 finished, one trial stopped early."""
    import json
    from types import SimpleNamespace

    from ray_job import storage
    from ray_job.tune import report
    from ray_job.tune.control import SearchProgress
    from ray_job.tune.trial import EARLY_STOPPED

    search = tmp_path / "search"
    ran = {0: dict(finished=True, epochs_completed=2), 1: dict(finished=False, epochs_completed=1,
           stopped=EARLY_STOPPED), 2: dict(finished=True, epochs_completed=2)}
    trials = []
    for n, summary in ran.items():
        folder = search / f"trial_{n:03d}"
        folder.mkdir(parents=True)
        (folder / "summary.json").write_text(json.dumps({**summary, "epochs": 2}))
        (folder / "config.json").write_text(json.dumps({"lr": 0.1}))
        if n:
            (folder / ".early_stop").write_text("1")  # ASHA's request (control.py)
        trials.append(SimpleNamespace(experiment_tag=f"{n}_lr=0.1", status="TERMINATED", config={"lr": 0.1},
                                      last_result={"epoch": summary["epochs_completed"]}, metric_analysis={}))
    progress = SearchProgress("test_acc", "max", 2, 3, str(search))
    for t in trials:
        progress.on_trial_complete(0, trials, t)
    said = dict(ENDED.findall(capsys.readouterr().out))
    rows = report.collect(storage.at(str(search)), ["lr"], "test_acc", "max")
    assert said == {r["trial"]: r["status"] for r in rows} == {
        "trial_000": "finished", "trial_001": "stopped early", "trial_002": "finished"}
    assert progress.counts(trials) == dict(running=0, finished=2, early=1, failed=0, waiting=0)


def test_rays_advice_for_a_continued_run_stays_out_of_the_terminal():
    """Ray Train's controller unpickles the run's callbacks before it reads its snapshot: from then on
    its "configure a new, unique RunConfig(name)" notice is a DEBUG record (Ray's log files keep it,
    its console handler drops it); other records stay as they are."""
    import logging
    import pickle

    from ray_job.train.notices import Quiet

    pickle.loads(pickle.dumps(Quiet()))
    make = logging.getLogger("ray.train.test").makeRecord
    notice = make("ray.train.test", logging.INFO, __file__, 1, "A run snapshot was found in storage folder "
                  "at: '/x'\n... please configure a new, unique `RunConfig(name)`", (), None)
    other = make("ray.train.test", logging.INFO, __file__, 1, "Started training worker group", (), None)
    assert (notice.levelno, other.levelno) == (logging.DEBUG, logging.INFO)


@pytest.mark.parametrize("how", ["random", "optuna"])
def test_the_searchers_propose_values_inside_the_space(how):
    """Both searchers, as the search builds them, take the space and propose values inside it
    (Optuna converts Tune's domains itself); no cluster needed."""
    from ray_job.tune.search import searcher_for

    search = parse_args(["--space", "lr=loguniform:0.001:1", "batch_size=choice:64,128", "warmup_epochs=randint:0:2",
                         "--search", how])
    searcher = searcher_for(search, at_once=2)
    space = {d.name: d.to_tune() for d in search.space}
    if how == "optuna":
        assert searcher.set_search_properties("test_acc", "max", space)
        configs = [searcher.suggest(f"t{i}") for i in range(2)]
        assert searcher.suggest("t2") is None  # at most 2 at once
    else:
        from ray.tune.experiment import Experiment

        searcher.add_configurations([Experiment("x", lambda config: None, config=space, num_samples=3)])
        configs = [searcher.next_trial().config for _ in range(2)]
        assert searcher.next_trial() is None  # at most 2 at once
    for c in configs:
        assert 0.001 <= c["lr"] <= 1 and c["batch_size"] in (64, 128) and c["warmup_epochs"] in (0, 1, 2)

# --- one search on the session's Ray head -------------------------------------------------------

# 32 steps an epoch. ASHA's decision on epoch 1 comes a few seconds after the epoch's report: the
# continued search is held in epoch 2 (RJ_HOLD_FILE, every trial) until it has stopped trial_002.
SEARCH = [*TINY, "--num-workers", "1", "--epochs", "3", "--synthetic-train-size", "2048",
          "--synthetic-test-size", "128", "--space", "lr=loguniform:0.00001:1", "--num-samples", "3",
          "--max-concurrent-trials", "2", "--reduction-factor", "2", "--storage-path", "results",
          "--name", "search", "--mlflow"]
ENDED = re.compile(r"^tune: (trial_\d+) (finished|stopped early)\b", re.M)


def _rows(search_dir):
    with open(search_dir / "tune.csv") as f:
        return {r["trial"]: r for r in csv.DictReader(f)}


@pytest.mark.timeout(900)
def test_search_interrupted_and_continued(ray_cluster, tmp_path):
    home = tmp_path / "user"
    home.mkdir()
    search_dir = home / "results" / "search"
    env = ray_cluster.user_env()
    started = time.monotonic()
    first = Running("tune", *SEARCH, cwd=home, env=env)
    # Ctrl-C once trial_002's run holds its folder (config.json), before its workers start: the stop
    # request is there before its first step, so it checkpoints within its first epoch on any machine
    # (its 3 epochs are left), whatever the speed; no race with the run.
    first.wait_for(lambda: (search_dir / "trial_002" / "config.json").exists(), timeout=600)
    first.signal_group(signal.SIGINT)
    assert first.finish(timeout=300) == 130, first.out[-4000:]
    first_s = time.monotonic() - started
    assert "search stopped on request" in first.out and "every running trial has checkpointed" in first.out
    rows = _rows(search_dir)
    # trial_002 starts when one of the first two has ended (2 at once): finished its 3 epochs, or
    # stopped early by ASHA at epoch 1 when it reached the rung second and behind (which one does
    # depends on which trial gets there first: both happen)
    done = [t for t in ("trial_000", "trial_001") if rows[t]["status"] in ("finished", "stopped early")]
    assert done, rows
    assert {t for t in done if f"tune: {t} {rows[t]['status']}" in first.out} == set(done)
    interrupted = [t for t, r in rows.items() if r["status"] == "interrupted"]
    assert "trial_002" in interrupted, rows  # asked to stop before its first step
    before = {t: (search_dir / t / "metrics.jsonl").read_text() for t in done}

    hold = Hold(tmp_path).at(2, 1)
    again = Running("tune", *SEARCH, cwd=home, env={**env, **hold.env})
    again.wait_for(lambda: hold.where() and [e for e in events(search_dir / "trial_002", "checkpoint_saved")
                                            if e["epoch"] == 1], timeout=600)
    # epoch 1's checkpoint, written, is reported with its metrics (to ASHA) at the next poll (step 5);
    # ASHA's stop is a stop request in the trial's folder, which the trial reads at its next poll
    hold.at(2, 6)
    again.wait_for(lambda: stop.requested(str(search_dir / "trial_002")), timeout=600)
    hold.release()
    assert again.finish(timeout=600) == 0, again.out[-4000:]
    out = again.out
    assert "A run snapshot was found" not in out  # Ray's advice for RunConfig users
    for t in done:  # finished trials are not run again
        assert f"tune: {t} started" not in out and (search_dir / t / "metrics.jsonl").read_text() == before[t]
    for t in interrupted:  # interrupted ones resume from the checkpoint taken at the stop
        assert events(search_dir / t, "resumed"), t
    rows = _rows(search_dir)
    assert set(rows) == {"trial_000", "trial_001", "trial_002"}
    early = [t for t, r in rows.items() if r["status"] == "stopped early"]
    assert early and all(rows[t]["stopped_early"] == "True" and int(rows[t]["epochs"]) < 3 for t in early), rows
    assert float(rows["trial_002"]["lr"]) < 1e-4 and "trial_002" in early  # 1.6e-5: clearly bad
    for t, r in rows.items():
        run = strict_file(search_dir / t / "summary.json")
        assert int(r["epochs"]) == run["epochs_completed"] == len(strict_file(search_dir / t / "metrics.jsonl"))
        assert float(r["best_test_acc"]) == run["best_test_acc"]
    table = (search_dir / "tune.md").read_text()
    assert "| trial_002 |" in table and "stopped early" in table and table.strip()[:40] in out
    # What the lines said is what happened: each trial's last end line, the counts and the table agree.
    said = dict(ENDED.findall(first.out + "\n" + out))
    assert said == {t: r["status"] for t, r in rows.items()}, (said, rows)
    assert f"; {len(early)} trial(s) stopped early," in table and f" {len(early)} stopped early," in out
    assert (search_dir / "tune.png").read_bytes()[:8] == PNG_MAGIC
    best = max(rows.values(), key=lambda r: float(r["best_test_acc"]))
    command = next(line.strip() for line in out.splitlines() if line.strip().startswith("python -m ray_job train"))
    assert f"--name {best['trial']}" in command and f"--storage-path {search_dir}" in command
    rerun = run_cli(*command.split()[3:], cwd=home, env=user_env())  # the best trial's own run, as printed
    assert rerun.returncode == 0 and f"run '{best['trial']}' already finished 3 epochs" in rerun.stdout, rerun
    _assert_tracked(home / "results", rows)
    print(f"\ntune: 3 trials x 3 epochs: interrupted after {first_s:.0f} s, continued in "
          f"{time.monotonic() - started - first_s:.0f} s")


def _assert_tracked(storage_path, rows: dict) -> None:
    """--mlflow, local default: the search is one parent run with its table and plot, each trial one
    child (the interrupted one continued, not doubled) with an epoch metric per epoch it ran, and the
    early-stopped ones tagged so."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{storage_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("ray_job").experiment_id])
    by_name = {}
    for r in runs:
        assert r.data.tags["mlflow.runName"] not in by_name, "a run tracked twice"
        by_name[r.data.tags["mlflow.runName"]] = r
    assert sorted(by_name) == ["search", *sorted(rows)]
    parent = by_name["search"]
    assert parent.info.status == "FINISHED" and parent.data.params["space"] == "lr=loguniform:1e-05:1"
    assert sorted(a.path for a in client.list_artifacts(parent.info.run_id)) == ["tune.csv", "tune.md", "tune.png"]
    for trial, row in rows.items():
        child = by_name[trial]
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        history = client.get_metric_history(child.info.run_id, "test_acc")
        assert [m.step for m in history] == list(range(1, int(row["epochs"]) + 1)), (trial, history)
        assert child.data.tags["ray_job.early_stopped"] == ("true" if row["status"] == "stopped early" else "false")


@pytest.mark.timeout(600)
def test_a_search_wider_than_the_cluster_fails_before_any_trial(ray_cluster, tmp_path):
    out = run_cli("tune", *TINY, "--num-workers", "1", "--max-concurrent-trials", "3", "--space",
                  "lr=uniform:0.1:1", "--storage-path", "results", cwd=tmp_path, env=ray_cluster.user_env())
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--max-concurrent-trials 3 x --num-workers 1 = 3 workers of 1 CPU each, but the cluster holds at most 2" \
        in one_error_line(out.stderr)
    assert not list((tmp_path / "results").glob("*/trial_*"))




@pytest.mark.timeout(600)
def test_a_search_on_object_storage(ray_cluster, s3, tmp_path):
    """--storage-path s3://...: Tune's state, the trials' run folders and the report all in the
    bucket (the head's processes have no AWS variables: the trials get the driver's); the same
    command again continues the search from the bucket and runs nothing. The trial trains sharded
    (--strategy fsdp): its checkpoint's shards go to the bucket through the trial's own storage."""
    env = {**ray_cluster.user_env(), **s3.aws_vars()}
    args = [*TINY, "--num-workers", "1", "--epochs", "1", "--space", "lr=choice:0.05,0.1", "--num-samples", "1",
            "--scheduler", "none", "--strategy", "fsdp", "--storage-path", s3.uri("searches"), "--name", "s"]
    out = run_cli("tune", *args, cwd=tmp_path, env=env)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    keys = s3.keys("searches/s")
    for key in ("search.json", "tune.csv", "tune.md", "tune.png", "tuner.pkl", "trial_000/summary.json",
                "trial_000/metrics.jsonl", "trial_000/config.json"):
        assert key in keys, keys
    assert [k for k in keys if k.startswith("trial_000/checkpoint_") and k.endswith(".distcp")], keys
    row = next(csv.DictReader(s3.read("searches/s/tune.csv").decode().splitlines()))
    assert (row["trial"], row["status"], row["epochs"]) == ("trial_000", "finished", "1")
    again = run_cli("tune", *args, cwd=tmp_path, env=env)
    assert again.returncode == 0 and "continuing the search" in again.stdout, again.stderr[-3000:]
    assert "trial_000 started" not in again.stdout
    assert not list(tmp_path.iterdir())  # nothing written locally

# --- the whole search in one SLURM allocation ---------------------------------------------------

@pytest.mark.timeout(900)
def test_sbatch_tune_survives_usr1_and_requeue(slurm_cluster, tmp_path):
    """Two trials at once, one per node (1 worker of 2 CPUs each); USR1 while they train: both
    checkpoint, the job requeues itself, and the same search continues them to the end."""
    from slurm_jobs import TINY as SLURM_TINY
    from slurm_jobs import Job

    job = Job(slurm_cluster, tmp_path, ["tune", *SLURM_TINY, "--num-workers", "1", "--epochs", "2",
                                        "--space", "lr=loguniform:0.01:0.5", "--num-samples", "2",
                                        "--scheduler", "none"])
    trials = [job.run_dir / "trial_000", job.run_dir / "trial_001"]
    # USR1 once both trials' runs hold their folders (config.json, written after a run clears an old
    # request and before its workers start): the request reaches them before their first step, so
    # both stop mid-epoch 1 on any machine, never after their last epoch.
    job.wait_for(lambda: all((t / "config.json").exists() for t in trials), timeout=500,
                 what="both trials to start")
    job.cluster.run(["scancel", "--batch", "--signal=USR1", str(job.id)])
    info = job.wait_for(lambda: (lambda i: i if i.get("JobState") == "PENDING" else None)(job.info()),
                        timeout=300, what="the job to be requeued")
    assert info["Restarts"] == "1" and "search stopped on request" in job.output, job.tail()
    assert "requeueing job" in job.output
    stopped = {t.name: strict_file(t / "summary.json").get("stopped") for t in trials}
    job.cluster.run(["scontrol", "update", f"JobId={job.id}", "StartTime=now+2"])  # skip the hold

    info = job.wait_done(timeout=500)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.tail()
    assert "continuing the search" in job.output
    rows = _rows(job.run_dir)
    assert {r["status"] for r in rows.values()} == {"finished"} and set(rows) == {t.name for t in trials}
    for t in trials:
        if stopped[t.name] == "the search was asked to stop":  # stopped mid-epoch: resumed there
            assert events(t, "resumed"), t
        assert [m["epoch"] for m in strict_file(t / "metrics.jsonl")] == [1, 2]
    job.assert_cleaned_up()
