"""A training worker that hangs (SIGSTOP: alive, holding its sockets, answering nothing).

What it stops: one `ray::RayTrainWorker` of a 2-worker CPU run started the way a user starts it
(`python -m ray_job train`, its own local Ray cluster), once epoch 2 is under way. Expects: the other
rank's all-reduce gives up after --collective-timeout-s (the process group's timeout that
TorchConfig(timeout_s) sets), the group restarts from the end-of-epoch-1 checkpoint, and the run
finishes; no process the run started is left. Only processes below the run's own PID are touched.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
TIMEOUT_S = 15


def descendants(pid: int) -> list[int]:
    """The PIDs below `pid` (children, grandchildren, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_a_hung_worker_is_given_up_on_in_bounded_time_and_the_run_recovers(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env["PYTHONPATH"] = ROOT
    run_dir = tmp_path / "results" / "hang"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ray_job", "train", "--data", "synthetic", "--model", "resnet18",
         "--stem", "imagenet", "--batch-size", "64", "--synthetic-train-size", "1536",
         "--synthetic-test-size", "128", "--num-workers", "2", "--epochs", "2", "--log-every", "4",
         "--collective-timeout-s", str(TIMEOUT_S), "--storage-path", "results", "--name", "hang"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def events():
            path = run_dir / "events.jsonl"
            return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

        deadline = time.monotonic() + 400
        while not any(e["event"] == "epoch_start" and e["epoch"] == 2 for e in events()):
            assert proc.poll() is None and time.monotonic() < deadline, "epoch 2 never started"
            time.sleep(0.5)
        time.sleep(3)  # a few steps into epoch 2
        workers = [p for p in descendants(proc.pid) if cmdline(p).startswith("ray::RayTrainWorker")]
        assert len(workers) == 2, [cmdline(p) for p in descendants(proc.pid)]
        os.kill(workers[-1], signal.SIGSTOP)
        stopped = time.time()
        out, _ = proc.communicate(timeout=500)
    finally:
        if proc.poll() is None:
            for pid in descendants(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    assert "Timed out" in out or "timed out" in out or "Timeout" in out, out[-3000:]
    restarted = [e["time"] for e in events() if e["event"] == "first_step" and e["time"] > stopped]
    assert restarted, events()
    assert [(e["epoch"], e["step"]) for e in events() if e["event"] == "resumed"] == [(1, 0)]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["finished"] and summary["epochs_completed"] == 2
    left = [p for p in workers if Path(f"/proc/{p}").exists()
            and (Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z")]
    assert not left, left
    print(f"\nhung worker (SIGSTOP): training again {restarted[0] - stopped:.1f} s later "
          f"(--collective-timeout-s {TIMEOUT_S})")
