"""`ray job submit` against a real `ray start --head --block` cluster with token authentication
(the session's `ray_cluster` in conftest.py): a tiny training job succeeds and leaves its results in
the storage path, the upload holds only code, a failing job is FAILED with a non-zero exit, a
running job can be stopped, and a client without the cluster's token is refused.

The entrypoint's python is this venv's (`sys.executable`): the one with ray and torch installed.
"""

import json
import os
import secrets
import shutil
import sys
import time
import urllib.error

import pytest

from conftest import ROOT, TINY

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

# Prints every file the job sees in its working directory (the unpacked upload).
LIST_FILES = ("import json, os; print('FILES ' + json.dumps(sorted(os.path.relpath(os.path.join(d, f))"
              " for d, _, fs in os.walk('.') for f in fs)))")


def _job_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


def _submit(head, job_id, *entrypoint, working_dir=ROOT, wait=True, env=None, timeout=240):
    args = ["--submission-id", job_id, "--working-dir", working_dir]
    return head.job("submit", *args, *([] if wait else ["--no-wait"]), "--", *entrypoint, env=env,
                    timeout=timeout)


def _unpacked_upload(head, job_id) -> str:
    """The folder the cluster unpacked this job's working_dir package into."""
    uri = head.api(f"/api/jobs/{job_id}")["runtime_env"]["working_dir"]  # gcs://_ray_pkg_<h>.zip
    name = uri.rsplit("/", 1)[-1].removesuffix(".zip")
    return os.path.join(head.temp_dir, "session_latest", "runtime_resources", "working_dir_files", name)


def _tree(root) -> tuple[set, int]:
    files = {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}
    return files, sum(os.path.getsize(os.path.join(root, f)) for f in files)


def test_client_without_the_cluster_token_is_refused(ray_cluster, tmp_path):
    assert isinstance(ray_cluster.api("/api/jobs/"), list)  # with the token: answered
    for token, code in ((None, 401), (secrets.token_hex(32), 403)):
        with pytest.raises(urllib.error.HTTPError) as e:
            ray_cluster.api("/api/jobs/", token=token)
        assert e.value.code == code
    assert oct(os.stat(ray_cluster.token_file).st_mode & 0o777) == "0o600"

    # The CLI as a user without the token meets it: no token anywhere (not even ~/.ray).
    env = {k: v for k, v in ray_cluster.client_env().items() if not k.startswith("RAY_AUTH")}
    proc = ray_cluster.job("list", env={**env, "HOME": str(tmp_path)}, timeout=60)
    assert proc.returncode != 0
    assert "401" in proc.stdout or "nauthorized" in proc.stdout, proc.stdout[-2000:]


def test_submitted_training_job_succeeds_with_results_in_storage_path(ray_cluster, tmp_path):
    job_id, storage = _job_id("train"), tmp_path / "results"
    started = time.monotonic()
    proc = _submit(ray_cluster, job_id, sys.executable, "-m", "ray_job", "train", *TINY,
                   "--num-workers", "1", "--epochs", "1", "--storage-path", str(storage),
                   "--name", "submitted", wait=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    status = ray_cluster.wait_for_job(job_id, timeout=240)
    elapsed = time.monotonic() - started
    logs = ray_cluster.job("logs", job_id).stdout
    assert status == "SUCCEEDED", logs[-4000:]

    summary = json.loads((storage / "submitted" / "summary.json").read_text())
    print(f"\nray job submit -> SUCCEEDED: {elapsed:.1f} s (driver wall {summary['wall_s']:.1f} s, "
          f"first step after {summary['time_to_first_step_s']:.1f} s)")
    assert summary["finished"] and summary["epochs_completed"] == 1
    assert len((storage / "submitted" / "metrics.jsonl").read_text().splitlines()) == 1
    assert any(p.name.startswith("checkpoint_") for p in (storage / "submitted").iterdir())
    assert "results:" in logs and "Found multiple active Ray instances" not in logs
    # `ray job logs` is not a terminal: plain progress lines, then the filled final table
    assert "Step [1/" in logs and "ETA epoch" in logs, logs[-4000:]
    assert "    1 " in logs.split("epoch train loss")[-1], logs[-3000:]
    assert f"Job '{job_id}' succeeded" in ray_cluster.job("status", job_id).stdout

    # What was uploaded from the real repo: the code, a few hundred KiB, no venv/results/git.
    files, size = _tree(_unpacked_upload(ray_cluster, job_id))
    print(f"uploaded working_dir: {len(files)} files, {size / 1024:.0f} KiB")
    assert "ray_job/train/driver.py" in files and "requirements.txt" in files
    assert size < 2 * 2**20
    assert not {f.split("/")[0] for f in files} & {".venv", ".git", "results", "data", ".pytest_cache"}


def test_rayignore_alone_keeps_the_upload_to_code(ray_cluster, tmp_path):
    """A copy of the code with decoys beside it; Ray's default excludes and .gitignore are off,
    so only .rayignore stands between the decoys and the cluster."""
    work = tmp_path / "wd"
    shutil.copytree(os.path.join(ROOT, "ray_job"), work / "ray_job",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in (".rayignore", "requirements.txt"):
        shutil.copy(os.path.join(ROOT, name), work / name)
    code = _tree(work)[0]
    decoys = [".venv/lib/python3.11/site-packages/torch/lib/libtorch.so", ".git/objects/ab/cdef",
              "results/run/checkpoint_000001/model.pt", "ray_results/run/events.jsonl",
              "checkpoint_000002/state.bin", "data/cifar-10-batches-py/data_batch_1",
              ".data/cifar.npz", "dist/ray_job-0.1-py3-none-any.whl", "ray_job/__pycache__/x.pyc",
              "ray-logs/42/node1.log", "ray_job-42.out", "cifar-10-python.tar.gz", ".env",
              "tensorboard/events.out.tfevents.1"]
    for rel in decoys:
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_bytes(os.urandom(256 * 1024))  # incompressible: size would show it

    env = ray_cluster.client_env(RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES="",
                              RAY_RUNTIME_ENV_IGNORE_GITIGNORE="1")
    job_id = _job_id("files")
    proc = _submit(ray_cluster, job_id, sys.executable, "-c", LIST_FILES, working_dir=str(work),
                   env=env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("FILES "))
    assert set(json.loads(line[len("FILES "):])) == code
    files, size = _tree(_unpacked_upload(ray_cluster, job_id))
    assert files == code and size < 2**20


def test_failing_job_is_failed_and_submit_exits_nonzero(ray_cluster, tmp_path):
    job_id = _job_id("fail")
    proc = _submit(ray_cluster, job_id, sys.executable, "-m", "ray_job", "train", *TINY, "--epochs", "0",
                   "--storage-path", str(tmp_path / "results"), "--name", "bad")
    assert proc.returncode != 0
    assert "error: " in proc.stdout and "failed" in proc.stdout, proc.stdout[-3000:]
    assert ray_cluster.job_status(job_id) == "FAILED"
    status = ray_cluster.job("status", job_id).stdout
    assert f"Job '{job_id}' failed" in status and "exit code 2" in status, status[-2000:]


def test_relative_storage_path_in_a_submitted_job_is_refused(ray_cluster):
    """The job runs in a temporary copy of --working-dir: ./results there would be lost."""
    job_id = _job_id("rel")
    proc = _submit(ray_cluster, job_id, sys.executable, "-m", "ray_job", "train", *TINY,
                   "--storage-path", "results", "--name", "lost")
    assert proc.returncode != 0
    # `ray job submit` shows the driver's output twice: while tailing and in the status message
    errors = {line for line in proc.stdout.splitlines() if line.startswith("error:")}
    assert len(errors) == 1 and "--storage-path results is relative" in errors.pop(), proc.stdout[-3000:]
    assert ray_cluster.job_status(job_id) == "FAILED"


def test_running_job_can_be_stopped(ray_cluster):
    job_id = _job_id("stop")
    proc = _submit(ray_cluster, job_id, sys.executable, "-c", "import time; time.sleep(600)",
                   working_dir=os.path.join(ROOT, "ray_job"), wait=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    running = ray_cluster.wait_for_job(job_id, timeout=120,
                                    until=("RUNNING", "SUCCEEDED", "FAILED", "STOPPED"))
    assert running == "RUNNING"
    stop = ray_cluster.job("stop", job_id)
    assert stop.returncode == 0, stop.stdout[-2000:]
    assert ray_cluster.wait_for_job(job_id, timeout=60) == "STOPPED"
