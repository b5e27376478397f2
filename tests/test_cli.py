"""The command line as a user meets it: bad input fails in seconds with one line, and a worker
that is killed mid-run is replaced without losing more than the current epoch."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from processes import Hold, train_workers

from conftest import (RAY_STARTED, ROOT, TINY, WORKERS_STARTED, assert_refused_before_ray, events, run_cli,
                      tiny_args)
from ray_job.config import parse_train_args
from ray_job.config.run import RECIPES
from ray_job.storage import read_jsonl
from ray_job.train.runfiles import Event

pytestmark = pytest.mark.timeout(600)


def _sentinel_run(tmp_path):
    """An earlier run's folder whose files must survive every failed start."""
    run_dir = tmp_path / "results" / "keep"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"epoch": 1}\n')
    return run_dir


def _assert_one_line_error(proc, words):
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and words in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("extra, words", [
    (["--data", "cifar10", "--data-dir", "/nonexistent/cifar", "--no-download"], "prepare-data"),
    (["--data", "imagefolder", "--data-dir", "/nonexistent/images"], "does not exist"),
    (["--batch-size", "0"], "--batch-size must be a positive"),
    (["--model", "resnet9000"], "is not a torchvision image classifier"),
    (["--resume-from", "/nonexistent/checkpoint"], "no checkpoint at"),
])
def test_bad_input_fails_before_ray_with_one_line(tmp_path, extra, words):
    run_dir = _sentinel_run(tmp_path)
    proc = run_cli("train", *tiny_args(tmp_path, "keep"), *extra)
    _assert_one_line_error(proc, words)
    assert_refused_before_ray(proc)
    assert (run_dir / "metrics.jsonl").read_text() == '{"epoch": 1}\n'
    assert not (run_dir / "config.json").exists()


def test_data_dir_that_is_a_file_and_corrupt_checkpoint(tmp_path):
    bad = tmp_path / "file"
    bad.write_text("x")
    _assert_one_line_error(run_cli("train", *tiny_args(tmp_path, "k"), "--data", "cifar10",
                                   "--data-dir", str(bad)), "is a file")
    corrupt = tmp_path / "ckpt"
    corrupt.mkdir()
    (corrupt / "checkpoint.pt").write_bytes(b"PK\x03\x04 truncated")
    _assert_one_line_error(run_cli("train", *tiny_args(tmp_path, "k"), "--resume-from", str(corrupt)),
                           "corrupt")
    _assert_one_line_error(run_cli("train", *TINY, "--storage-path", str(bad / "sub")), "not writable")


@pytest.mark.ray
def test_more_workers_than_the_machine_fails_before_waiting(tmp_path):
    run_dir = _sentinel_run(tmp_path)
    proc = run_cli("train", *tiny_args(tmp_path, "keep"), "--num-workers", "64")
    _assert_one_line_error(proc, "cannot fit")
    # a local cluster starts, is asked, and we leave: no worker group waits for CPUs that never come
    out = proc.stdout + proc.stderr
    assert RAY_STARTED[0] in out and WORKERS_STARTED not in out, out[-3000:]
    assert (run_dir / "metrics.jsonl").read_text() == '{"epoch": 1}\n'


def help_entries(text: str) -> dict[str, str]:
    """Each option of a --help text: its flag -> its entry (the lines it spans, joined)."""
    entries, flag = {}, None
    for line in text.split("options:", 1)[1].splitlines():
        if start := re.match(r"  (--[a-z0-9-]+)", line):
            flag = start[1]
            entries[flag] = line
        elif flag and line.startswith("    "):
            entries[flag] += " " + line.strip()
        else:
            flag = None
    return entries


@pytest.mark.parametrize("recipe", RECIPES)
def test_help_shows_every_setting_with_the_value_a_run_gets(recipe):
    """`train --help` (with a --recipe: its values) lists a flag for every setting, and the default
    it shows is the value a run without that flag gets (a setting decided at run time, None or ""
    here, says in words what it becomes)."""
    entries = help_entries(run_cli("train", "--recipe", recipe, "--help").stdout)
    cfg = parse_train_args(["--recipe", recipe])
    for field in dataclasses.fields(cfg):
        if field.name == "recipe":
            continue
        flag = "--" + field.name.replace("_", "-")
        assert flag in entries, f"{flag} is not in `train --help`"
        shown = re.findall(r"\(default: ([^)]*)\)", entries[flag])
        value = getattr(cfg, field.name)
        in_words = value in (None, "", ()) and " " in shown[0] if shown else False
        assert len(shown) == 1 and (shown[0] == str(value) or in_words), (flag, entries[flag])
    assert run_cli("--help").returncode == 0


def _checkpoint_registered(run_dir) -> bool:
    """Epoch 1's checkpoint is in Ray's run snapshot (reported and registered) and epoch 2 runs."""
    snapshot = run_dir / "checkpoint_manager_snapshot.json"
    return snapshot.exists() and '"epoch": 1' in snapshot.read_text().replace('"epoch":1', '"epoch": 1') \
        and any(e["epoch"] == 2 for e in events(run_dir, Event.EPOCH_START))


@pytest.mark.ray
def test_killed_worker_is_replaced_and_training_continues(tmp_path):
    """SIGKILL a real Ray Train worker process mid-epoch; the group restarts from the checkpoint."""
    args = tiny_args(tmp_path, "kill", "--num-workers", "2", "--epochs", "3", "--max-failures", "1",
                     "--synthetic-train-size", "1536")
    hold = Hold(tmp_path).at(2, 1)  # killed while held mid-epoch 2
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | hold.env
    proc = subprocess.Popen([sys.executable, "-m", "ray_job", "train", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = tmp_path / "results" / "kill"

    def wait_for(what):
        deadline = time.time() + 400
        while not what():
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.time() < deadline, "timed out"
            time.sleep(0.2)
    try:
        wait_for(lambda: hold.waits_at(2, 1) and events(run_dir, Event.CHECKPOINT_SAVED))
        # epoch 1's checkpoint, written, is reported to Ray at the next poll (step 5, answered at 7)
        hold.at(2, 8)
        wait_for(lambda: hold.waits_at(2, 8) and _checkpoint_registered(run_dir))
        victims = train_workers(proc.pid)
        assert len(victims) == 2
        victims[-1].send_signal(signal.SIGKILL)
        hold.release()  # the new group goes on past the step
        out, _ = proc.communicate(timeout=500)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    rows = read_jsonl(str(run_dir / "metrics.jsonl"))
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    starts = [e["epoch"] for e in events(run_dir, Event.EPOCH_START)]
    assert len(starts) <= 4 and starts[-1] == 3  # at most one epoch recomputed
    assert events(run_dir, Event.RESUMED)
    assert json.load(open(run_dir / "summary.json"))["finished"]
