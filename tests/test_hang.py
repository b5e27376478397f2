"""A training worker that hangs (SIGSTOP: alive, holding its sockets, answering nothing).

What it stops: one `ray::RayTrainWorker` of a 2-worker CPU run started the way a user starts it
(`python -m ray_job train`, its own local Ray cluster), once epoch 2 is under way. Expects: the other
rank's all-reduce gives up after --collective-timeout-s (the process group's timeout that
TorchConfig(timeout_s) sets), the group restarts from the end-of-epoch-1 checkpoint, and the run
finishes; no process the run started is left. Only processes below the run's own PID are touched.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from processes import Hold, alive, train_workers

from conftest import ROOT, TINY_MODEL, events, strict_file
from ray_job.train.runfiles import Event

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
TIMEOUT_S = 15


def test_a_hung_worker_is_given_up_on_in_bounded_time_and_the_run_recovers(tmp_path):
    """Rank 1 is stopped while the run is held at epoch 2's first step (RJ_HOLD_FILE), then the
    hold is let go: rank 0 goes on into a collective that rank 1 never answers."""
    hold = Hold(tmp_path).at(2, 1)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env.update(PYTHONPATH=ROOT, **hold.env)
    run_dir = tmp_path / "results" / "hang"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ray_job", "train", "--data", "synthetic", *TINY_MODEL, "--batch-size", "64",
         "--synthetic-train-size", "1536", "--synthetic-test-size", "128", "--num-workers", "2", "--epochs", "2",
         "--log-every", "4",
         "--collective-timeout-s", str(TIMEOUT_S), "--storage-path", "results", "--name", "hang"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 400
        while not hold.waits_at(2, 1):
            assert proc.poll() is None and time.monotonic() < deadline, "epoch 2 never started"
            time.sleep(0.1)
        workers = train_workers(proc.pid)
        assert len(workers) == 2, workers
        # rank 1: rank 0 is left to finish writing epoch 1's checkpoint in the background
        (rank1,) = [w["pid"] for w in strict_file(run_dir / "topology.json")["workers"] if w["rank"] == 1]
        assert rank1 in [w.pid for w in workers], (rank1, workers)
        os.kill(rank1, signal.SIGSTOP)
        stopped = time.time()
        hold.release()
        out, _ = proc.communicate(timeout=500)
    finally:
        if proc.poll() is None:
            for p in psutil.Process(proc.pid).children(recursive=True):
                p.kill()
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    assert "Timed out" in out or "timed out" in out or "Timeout" in out, out[-3000:]
    restarted = [e["time"] for e in events(run_dir, Event.FIRST_STEP) if e["time"] > stopped]
    assert restarted, events(run_dir)
    assert [(e["epoch"], e["step"]) for e in events(run_dir, Event.RESUMED)] == [(1, 0)]
    summary = strict_file(run_dir / "summary.json")
    assert summary["finished"] and summary["epochs_completed"] == 2
    left = [p for p in workers if alive(p)]
    assert not left, left
    print(f"\nhung worker (SIGSTOP): training again {restarted[0] - stopped:.1f} s later "
          f"(--collective-timeout-s {TIMEOUT_S})")
