"""The SLURM facts in Python: the allocation read from SLURM's environment (ray_job.cluster.slurm),
and the driver's flags composed from the user's with the driver's own parser
(ray_job.commands.slurm_plan). No SLURM needed: the environment is a dict."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ray_job.config import build_train_parser, config_from_args
from ray_job.core.errors import UsageError
from ray_job.cluster.slurm import Allocation, NodeRestarts
from ray_job.commands.slurm_plan import main, parser_for, plan_driver



ROOT = Path(__file__).resolve().parent.parent
GPU_JOB = {"SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": "/sub", "SLURM_GPUS_ON_NODE": "2",
           "SLURM_CPUS_PER_TASK": "8"}
CPU_JOB = {"SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": "/sub"}


def plan(argv: list[str], env: dict = GPU_JOB):
    return plan_driver(argv, Allocation.from_env(env))


def final_config(args):
    """What the driver will make of the composed flags (the script sets only RAY_ADDRESS)."""
    return config_from_args(build_train_parser(args).parse_args(list(args)))


def count(args, *flags: str) -> int:
    return sum(a in flags or a.split("=", 1)[0] in flags for a in args)


# ---- the allocation ---------------------------------------------------------------------------
@pytest.mark.parametrize("env, gpus", [
    ({}, 0),
    ({"SLURM_GPUS_ON_NODE": "4"}, 4),
    ({"SLURM_GPUS_PER_NODE": "2"}, 2),
    ({"SLURM_GPUS_PER_NODE": "a100:2"}, 2),
    ({"SLURM_GPUS_PER_NODE": "a100:1,v100:1"}, 2),
    ({"SLURM_GPUS_ON_NODE": "1", "SLURM_GPUS_PER_NODE": "a100:4"}, 1),  # what the node really got
])
def test_gpus_per_node_in_the_formats_slurm_writes(env, gpus):
    assert Allocation.from_env({**CPU_JOB, **env}).gpus_per_node == gpus


def test_an_unreadable_gpu_count_is_an_error_with_a_hint():
    with pytest.raises(UsageError, match=r"SLURM_GPUS_PER_NODE='a100:x'.*HINT"):
        Allocation.from_env({**CPU_JOB, "SLURM_GPUS_PER_NODE": "a100:x"})


def test_defaults_come_from_the_job_and_the_rj_knobs_override_them():
    alloc = Allocation.from_env(GPU_JOB)
    assert (alloc.job_id, alloc.cpus_per_node, alloc.restart_count) == ("7", 8, 0)
    assert (alloc.storage_path, alloc.run_name, alloc.log_dir) == (
        "/sub/ray_results", "slurm-7", "/sub/ray-logs/7")
    alloc = Allocation.from_env({**CPU_JOB, "SLURM_CPUS_ON_NODE": "3", "SLURM_RESTART_COUNT": "1",
                                 "RJ_STORAGE_PATH": "/shared/r", "RJ_RUN_NAME": "mine",
                                 "RJ_LOG_DIR": "/shared/logs"})
    assert (alloc.cpus_per_node, alloc.restart_count, alloc.storage_path, alloc.run_name,
            alloc.log_dir) == (3, 1, "/shared/r", "mine", "/shared/logs")


def test_a_lost_nodes_ray_is_started_again_later_each_time_until_none_is_left():
    restarts = NodeRestarts.from_env({**CPU_JOB, "RJ_NODE_RESTART_S": "45"})
    assert [restarts.next("n2", done)[0] for done in range(4)] == [45, 90, 180, -1]
    assert restarts.next("n2", 0)[1] == "starting Ray on n2 again in 45 s (restart 1 of 3)"
    assert restarts.next("n2", 3)[1] == "not starting Ray on n2 again: it was restarted 3 times (RJ_NODE_RESTARTS)"
    assert NodeRestarts.from_env({**CPU_JOB, "RJ_NODE_RESTARTS": "0"}).next("n2", 0)[0] == -1
    with pytest.raises(UsageError, match="RJ_NODE_RESTARTS='two' as a count: give a whole number"):
        Allocation.from_env({**CPU_JOB, "RJ_NODE_RESTARTS": "two"})  # when the job is planned


def test_outside_slurm_it_says_how_to_submit():
    with pytest.raises(UsageError, match="HINT: submit with 'sbatch slurm_ray_start.sh"):
        Allocation.from_env({})


# ---- the driver's flags -----------------------------------------------------------------------
def test_defaults_are_added_when_absent():
    p = plan(["--epochs", "3"])
    assert p.mode == "train" and p.args[-2:] == ("--epochs", "3")
    cfg = final_config(p.args)
    assert (cfg.storage_path, cfg.name, cfg.use_gpu, cfg.epochs) == ("/sub/ray_results", "slurm-7", True, 3)
    assert (p.storage_path, p.run_name, p.use_gpu) == ("/sub/ray_results", "slurm-7", True)


def test_no_gpus_from_slurm_adds_no_gpu():
    p = plan(["train"], CPU_JOB)
    assert "--no-gpu" in p.args and final_config(p.args).use_gpu is False and p.use_gpu is False


@pytest.mark.parametrize("flag", ["--no-use-gpu", "--no-gpu", "--no-use"])
def test_a_gpu_opt_out_survives_on_a_gpu_allocation(flag):
    p = plan(["train", flag])
    assert count(p.args, "--use-gpu") == 0 and p.use_gpu is False
    assert final_config(p.args).use_gpu is False


def test_an_explicit_use_gpu_is_kept_once():
    p = plan(["--use-gpu"])
    assert count(p.args, "--use-gpu") == 1 and final_config(p.args).use_gpu is True


@pytest.mark.parametrize("flags", [
    ["--storage-path", "/x", "--name", "foo"],
    ["--storage-path=/x", "--name=foo"],
    ["--storage", "/x", "--na", "foo"],      # abbreviations argparse accepts
    ["--stor=/x", "--nam=foo"],
])
def test_the_users_storage_path_and_name_win_in_any_form(flags):
    p = plan(["train", *flags])
    assert p.args == ("--use-gpu", *flags)  # nothing of ours added but the GPU flag
    cfg = final_config(p.args)
    assert (cfg.storage_path, cfg.name) == ("/x", "foo")
    assert (p.storage_path, p.run_name) == ("/x", "foo")


def test_a_relative_storage_path_is_passed_as_given_and_reported_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the driver runs in the submit dir, as this does
    p = plan(["--storage-path", "out"])
    assert "out" in p.args and p.storage_path == str(tmp_path / "out")


def test_use_gpu_without_gpus_fails_with_a_hint():
    with pytest.raises(UsageError, match=r"SLURM gave this job no GPUs.*HINT: submit with "
                                         r"sbatch --gpus-per-node=N.*--no-gpu"):
        plan(["train", "--use-gpu"], CPU_JOB)


@pytest.mark.parametrize("flags", [["--address", "10.0.0.1:6379"], ["--address=auto"], ["--addr", "x"]])
def test_address_is_the_scripts(flags):
    with pytest.raises(UsageError, match="--address is set by this script"):
        plan(["train", *flags])


@pytest.mark.parametrize("argv, message", [
    (["tarin"], "unknown mode 'tarin'. HINT"),
    (["--epochs", "0"], "--epochs must be a positive number"),   # the config's own checks
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--optimizer", "lamb"], "invalid choice: 'lamb'"),
    (["--name", ""], "--name need a value"),
    (["serve", "--epochs", "1"], "serve takes no flags"),
])
def test_bad_input_is_a_usage_error(argv, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        plan(argv)


def test_serve_mode_runs_no_driver():
    p = plan(["serve"])
    assert (p.mode, p.args, p.storage_path) == ("serve", (), "/sub/ray_results")


@pytest.mark.parametrize("command", [[], ["sweep"]])
def test_scale_mode_uses_the_scale_parser(command):
    p = plan(["scale", *command, "--workers", "1,2", "--no-gpu", "--stor", "/x"])
    assert p.mode == "scale" and count(p.args, "--storage-path", "--use-gpu", "--no-gpu") == 1
    assert list(p.args[:len(command)]) == command  # the subcommand stays first
    ns = parser_for("scale", p.args).parse_args(list(p.args[len(command):]))
    assert (list(ns.workers), ns.use_gpu, ns.storage_path, ns.name) == ([1, 2], False, "/x", "slurm-7")
    with pytest.raises(UsageError):
        plan(["scale", "--workers", "0"])


def test_predict_mode_passes_its_flags_as_given_and_uses_the_allocations_gpus(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the driver runs in the submit dir, as this does
    p = plan(["predict", "model", "--images", "imgs", "--out", "out/p.csv", "--actors", "2"])
    assert (p.mode, p.args) == ("predict", ("model", "--images", "imgs", "--out", "out/p.csv", "--actors", "2"))
    assert (p.storage_path, p.use_gpu) == (str(tmp_path / "out"), True)
    assert plan(["predict", "model", "--images", "imgs"], CPU_JOB).use_gpu is False
    for argv, message in ((["predict", "model"], "needs --images"),
                          (["predict", "m", "--images", "i", "--address", "x:1"], "--address is set by this script"),
                          (["predict", "m", "--images", "i", "--actors", "-1"], "--actors must not be negative")):
        with pytest.raises(UsageError, match=message):
            plan(argv)


# ---- the command line, as the script reads it -------------------------------------------------
def test_plan_prints_nul_terminated_records(capsys):
    assert main(["train", "--no-gpu", "--epochs", "2"], env=GPU_JOB) == 0
    out, err = capsys.readouterr()
    records = out.split("\0")
    assert records[-1] == ""  # every record is terminated
    sep = records.index("--")
    facts = dict(r.split("=", 1) for r in records[:sep])
    assert facts["MODE"] == "train" and facts["WANT_GPU"] == "0" and facts["GPUS_PER_NODE"] == "2"
    assert facts["RUN_NAME"] == "slurm-7" and facts["CPUS_PER_NODE"] == "8"
    assert records[sep + 1:-1][-3:] == ["--no-gpu", "--epochs", "2"]
    assert "warning: 2 GPU(s) per node allocated" in err


def test_bad_flags_print_one_error_line_and_exit_2(capsys):
    assert main(["--use-gpu"], env=CPU_JOB) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: --use-gpu was given")


def test_help_goes_to_the_log_and_there_is_nothing_to_run(capsys):
    assert main(["train", "--help"], env=CPU_JOB) == 0
    out, err = capsys.readouterr()
    assert out == "" and "--storage-path" in err


def test_bash_mapfile_reads_the_flags_back_exactly(tmp_path):
    name = "a b\nc*"  # spaces, a newline and a glob character survive
    script = ('mapfile -d "" -t plan < <("$0" -m ray_job.commands.slurm_plan --epochs 2 --name "$1"); '
              'wait $! || exit; printf "<%s>" "${plan[@]}"')
    out = subprocess.run(["bash", "-c", script, sys.executable, name], cwd=tmp_path, text=True,
                         capture_output=True, env={"PYTHONPATH": str(ROOT), **CPU_JOB}, check=True)
    assert f"<RUN_NAME={name}>" in out.stdout and f"<--name><{name}>" in out.stdout


def test_tune_mode_uses_the_tune_parser_and_checks_the_space():
    from ray_job.tune.options import parse_args as parse_tune_args

    p = plan(["tune", "--space", "lr=loguniform:0.01:1", "--num-samples", "4"], env=CPU_JOB)
    assert p.mode == "tune" and count(p.args, "--storage-path", "--name", "--no-gpu") == 3
    search = parse_tune_args(list(p.args))  # what the driver makes of them
    assert (search.base.name, search.base.use_gpu, search.opts.num_samples) == ("slurm-7", False, 4)
    assert [d.text for d in search.space] == ["lr=loguniform:0.01:1"]
    with pytest.raises(UsageError, match="cannot search 'momentun'"):
        plan(["tune", "--space", "momentun=uniform:0:1"], env=CPU_JOB)
