"""The CLI as a user runs it: from their own folder, with relative paths, reading what it prints.

Each test starts `python -m ray_job train` as a subprocess in a folder that is not the repository,
with relative --storage-path / --data-dir / --resume-from, and checks what a person would look at:
the printed progress and final table, and the files in ./results/<name>/ that the README lists.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from ray_job.data.cifar10 import write_cifar10
from ray_job.data.synthetic import make_synthetic
from ray_job.train.runfiles import Event

from conftest import (README_FILES, TINY_MODEL, Running, events, jpeg_folder, run_cli, strict_file, table_rows,
                      train, user_env)
from processes import Hold

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

MODEL = [*TINY_MODEL, "--batch-size", "64"]


@pytest.fixture
def user_dir(user_dir):
    """The user's folder (conftest's), holding a small CIFAR-10 in torchvision's format under ./data."""
    write_cifar10(str(user_dir / "data"), make_synthetic(512, 0, True), make_synthetic(128, 0, False))
    return user_dir


def test_relative_paths_land_in_the_users_folder_and_a_rerun_says_finished(user_dir, ray_cluster):
    data = ["--data", "cifar10", "--data-dir", "data", "--no-download", "--storage-path", "results",
            *MODEL]
    args = [*data, "--num-workers", "2", "--epochs", "1"]  # no --name, as in the README
    proc = train(user_dir, *args)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]

    # what the person reads: progress after the first step with speed and ETA, a filled table
    progress = [line for line in out.splitlines() if "Step [" in line]
    assert any("Step [1/8]" in line for line in progress), out[-3000:]
    assert all("img/s" in line and "ETA epoch" in line and "data" in line for line in progress)
    rows = table_rows(proc.stdout)
    assert len(rows) == 1 and float(rows[0][4]) > 0.2, proc.stdout[-2000:]  # test acc > chance
    (run_dir,) = (user_dir / "results").iterdir()  # the default name: ray_job_<data>_<model>_<hash>
    assert run_dir.name.startswith("ray_job_cifar10_VisionTransformer_")
    assert f"results: {run_dir}" in proc.stdout
    assert "(test accuracy 0." in proc.stdout

    # every file the README lists is in ./results/<name>/, and every JSON parses strictly
    for name in README_FILES:
        assert (run_dir / name).exists(), sorted(os.listdir(run_dir))
    assert list(run_dir.glob("checkpoint_*"))
    for path in [*run_dir.glob("*.json"), *run_dir.glob("*.jsonl")]:
        strict_file(path)
    config = strict_file(run_dir / "config.json")
    assert config["storage_path"] == str(user_dir / "results")
    assert config["data_dir"] == str(user_dir / "data")
    summary = strict_file(run_dir / "summary.json")
    assert summary["finished"] and summary["epochs_completed"] == 1
    assert summary["best_test_acc"] == pytest.approx(float(rows[0][4]), abs=1e-3)

    # the same command again (same default name): finished, says so, starts no Ray, trains nothing
    again = train(user_dir, *args, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "already finished 1 epochs" in again.stdout
    assert "config:" not in again.stdout
    assert len(strict_file(run_dir / "metrics.jsonl")) == 1

    # a new run from one of its checkpoints, named by a relative path; on the session's head (the
    # first run above is the README's own local cluster; this one is about the relative path)
    ckpt = os.path.relpath(summary["latest_checkpoint"], user_dir)
    assert not os.path.isabs(ckpt)
    other = train(user_dir, *data, "--name", "seat2", "--num-workers", "1", "--epochs", "2",
                  "--resume-from", ckpt, env=ray_cluster.user_env())
    assert other.returncode == 0, (other.stdout + other.stderr)[-3000:]
    assert [r["epoch"] for r in strict_file(user_dir / "results" / "seat2" / "metrics.jsonl")] == [2]
    assert strict_file(user_dir / "results" / "seat2" / "config.json")["resume_from"] == \
        str(user_dir / ckpt)


def _ours(proc, settle_s: float = 30) -> list:
    """The processes a run started (its local Ray cluster included: its session's) still there
    `settle_s` after it exited: the local cluster's processes end a moment after the driver, later
    on a loaded machine."""
    import psutil

    deadline = time.monotonic() + settle_s
    while True:
        found = []
        for p in psutil.process_iter(["pid"]):
            try:
                if p.pid != proc.pid and os.getsid(p.pid) == proc.pid:
                    found.append(p)
            except (ProcessLookupError, PermissionError, psutil.Error):
                pass
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


@pytest.mark.timeout(900)  # four runs of the README's command
def test_ctrl_c_checkpoints_where_it_is_and_the_same_command_continues(user_dir, ray_cluster):
    """Ctrl-C (SIGINT to the terminal's process group) during epoch 2 of the README's command: exit
    130 with the line that says what was kept, summary.json says interrupted, nothing left running;
    then Ctrl-C twice: aborted at once, the previous checkpoint intact; a stop request written by
    hand (.preempt, as the README says): exit 3; and the same command once more continues at the
    saved step and finishes.

    No step of this races the run: each Ctrl-C is sent while the run is held at a step
    (RJ_HOLD_FILE) and let go once the driver said it took it; the .preempt file is written right
    after the driver cleared the old one, before the first step."""
    # 512 images: 8 steps per epoch; the workers look for a stop request every 5 steps (and at an
    # epoch's end).
    args = ["train", "--data", "synthetic", "--synthetic-train-size", "512", "--synthetic-test-size", "128",
            "--storage-path", "results", "--name", "stopme", "--num-workers", "2", "--epochs", "3",
            *TINY_MODEL, "--batch-size", "64", "--log-every", "2"]
    run_dir = user_dir / "results" / "stopme"
    took = "Ctrl-C: asked the workers to checkpoint and stop"
    hold = Hold(user_dir.parent / "hold").at(2, 3)
    # its own local cluster, as the README's command starts
    first = Running(*args, cwd=user_dir, env=user_env(**hold.env))
    first.wait_for(lambda: hold.waits_at(2, 3), timeout=400)
    first.signal_group(signal.SIGINT)
    interrupted = time.monotonic()
    first.wait_for(lambda: took in first.out, every=0.1)
    hold.release()
    assert first.finish() == 130, first.out[-4000:]
    stopped = re.search(r"stopped at epoch (\d+) step (\d+) \(Ctrl-C\); checkpoint saved. Run the same "
                        r"command again to continue.", first.out)
    assert stopped, first.out[-3000:]
    position = (int(stopped[1]) - 1, int(stopped[2]))  # as the checkpoint holds it: epoch 0-based
    assert (1, 3) < position <= (2, 0), position  # at a poll after step 3 of epoch 2, or at its end
    print(f"\nCtrl-C: exit 130 {time.monotonic() - interrupted:.1f} s later, at epoch {stopped[1]} step {stopped[2]}")
    summary = strict_file(run_dir / "summary.json")
    assert not summary["finished"] and summary["stopped"] == "Ctrl-C" and summary["latest_checkpoint"]
    assert load_state(summary["latest_checkpoint"])[:2] == position
    assert not _ours(first.proc) and not (run_dir / ".lease.json").exists()

    hold.at(2, 1)  # at the first step it takes: the stop the first Ctrl-C asks for cannot come before the second
    second = Running(*args, cwd=user_dir, env=user_env(**hold.env))
    held = second.wait_for(hold.where, timeout=400)
    second.signal_group(signal.SIGINT)
    # the second once the driver took the first (two before its handler runs would count as one)
    second.wait_for(lambda: took in second.out, every=0.05)
    second.signal_group(signal.SIGINT)
    assert second.finish(timeout=60) == 130, second.out[-3000:]
    hold.release()
    assert "aborted by a second Ctrl-C" in second.out and summary["latest_checkpoint"] in second.out
    assert not _ours(second.proc)
    assert load_state(summary["latest_checkpoint"])[:2] == position, held  # intact

    third = Running(*args, cwd=user_dir, env=ray_cluster.user_env())
    # "config:" follows the driver's clearing of an old request: the file is there before any step
    third.wait_for(lambda: "config:" in third.out, timeout=400, every=0.1)
    (run_dir / ".preempt").write_text("asked by hand, as the README says")  # relative to me
    assert third.finish() == 3, third.out[-3000:]
    assert "Run the same command again to continue" in third.out

    again = run_cli(*args, cwd=user_dir, env=ray_cluster.user_env())
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    resumed = events(run_dir, Event.RESUMED)
    assert resumed[0] == {**resumed[0], "epoch": position[0], "step": position[1]}  # at the exact step
    assert [r["epoch"] for r in strict_file(run_dir / "metrics.jsonl")] == [1, 2, 3]
    assert not (run_dir / ".preempt").exists()


def load_state(path) -> tuple:
    from ray_job.train.checkpoint import load_checkpoint

    state = load_checkpoint(path)
    return state["epoch"], state["step"]


def test_bad_data_only_the_workers_read_ends_the_run_at_once(user_dir, ray_cluster):
    """The driver checks the small test file; a corrupt train file is found by every worker.
    That is bad input, not a fault: one line, exit 2, no worker-group restarts."""
    (user_dir / "data" / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"not a pickle")
    start = time.time()
    proc = run_cli("train", "--data", "cifar10", "--data-dir", "data", "--no-download",
                   "--storage-path", "results", "--name", "bad", "--num-workers", "2",
                   "--max-failures", "3", "--epochs", "1", *MODEL, cwd=user_dir, env=ray_cluster.user_env())
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "data_batch_3" in errors[0] and "HINT" in errors[0], proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr.split("error:")[-1]
    assert out.count("Attempting to start training worker group") == 1, out[-3000:]  # no restart
    print(f"bad data found by the workers: exit 2 after {time.time() - start:.1f} s")


def test_own_jpegs_of_any_size_prepare_then_train_from_the_users_folder(tmp_path, ray_cluster):
    """The README's "Your own data" road: a folder of JPEGs of random sizes (100-500 px) ->
    prepare-data (twice: the second finds it ready) -> train --data prepared at --image-size 64."""
    home = tmp_path / "me"
    jpeg_folder(home / "my_images", 240, 60, classes=4, lo=100, hi=500)

    def cli(*args, timeout=600):
        return run_cli(*args, cwd=home, timeout=timeout)

    prep = ["prepare-data", "--from", "imagefolder", "--src", "my_images", "--out", "prepared"]
    first = cli(*prep)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "wrote prepared from my_images" in first.stdout and "encoded (sizes differ)" in first.stdout
    assert "train 240 images" in first.stdout and "4 classes" in first.stdout
    assert "preparing prepared" in first.stderr  # the progress bar
    again = cli(*prep)
    assert again.returncode == 0 and "already prepared" in again.stdout and "nothing to do" in again.stdout
    assert sorted(os.listdir(home / "prepared")) == ["manifest.json", "test-00000.arrow", "train-00000.arrow"]

    proc = run_cli("train", "--data", "prepared", "--data-dir", "./prepared", "--image-size", "64",
                   "--stem", "imagenet", "--model", "resnet18", "--batch-size", "48", "--lr", "0.05",
                   "--num-workers", "2", "--epochs", "2", "--storage-path", "results", "--log-every", "2",
                   cwd=home, env=ray_cluster.user_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "data: prepared, decoded and resized to 64 px in the loader" in out
    rows = table_rows(proc.stdout)
    assert len(rows) == 2 and float(rows[-1][4]) > 0.5, proc.stdout[-2000:]  # chance is 0.25
    (run_dir,) = (home / "results").iterdir()
    assert run_dir.name.startswith("ray_job_prepared_resnet18_") and f"results: {run_dir}" in proc.stdout
    config = strict_file(run_dir / "config.json")
    assert config["data_dir"] == str(home / "prepared") and config["image_size"] == 64
    assert [r["epoch"] for r in strict_file(run_dir / "metrics.jsonl")] == [1, 2]

    bad = train(home, "--data", "prepared", "--data-dir", "my_images", "--storage-path", "results")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: --data-dir")
    assert "looks like a folder of images" in bad.stderr and "--data imagefolder" in bad.stderr
