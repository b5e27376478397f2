"""Submitting slurm_ray_start.sh to the test SLURM cluster (tests/slurm_cluster.py) and looking at
the job as a user would: its `scontrol` record, its output file, the run folder the driver wrote,
and the processes it left (found by PID through their SLURM_JOB_ID)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SLOW_MODEL, TINY_MODEL

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "slurm_ray_start.sh"

_SMALL = ["--data", "synthetic",
          "--num-workers", "2", "--cpus-per-worker", "2",  # 2 CPUs per node: one worker per node
          "--synthetic-train-size", "512", "--synthetic-test-size", "128", "--batch-size", "64",
          "--log-every", "4"]
TINY = [*_SMALL, *TINY_MODEL]
SLOW = [*_SMALL, *SLOW_MODEL]  # resnet18 (conftest.SLOW_MODEL)
SBATCH = ["--nodes=2", "--gpus-per-node=0", "--cpus-per-task=2", "--time=30"]
STATE_EVERY_S = 2.0  # how often wait_for asks slurmctld for the job's state


# ---- helpers ----------------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Job:
    """One sbatch submission of slurm_ray_start.sh from its own submit dir."""

    def __init__(self, cluster, submit_dir: Path, args: list[str], sbatch: list[str] = (),
                 env: dict[str, str] | None = None):
        self.cluster, self.dir = cluster, submit_dir
        submit_dir.mkdir(parents=True, exist_ok=True)
        job_env = {
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(ROOT),  # `python -m ray_job` from the submit dir
            "RJ_PYTHON": sys.executable,
            "RJ_START_ARGS": "--object-store-memory=300000000",  # 4+ Ray nodes share this machine
            **cluster.job_env(), **(env or {}),
        }
        self.submitted = time.time()
        self.id = cluster.sbatch([*SBATCH, f"--output={submit_dir}/job-%j.out", *sbatch,
                                  str(SCRIPT), *args], cwd=submit_dir, env=job_env)
        self.run_dir = submit_dir / "ray_results" / f"slurm-{self.id}"  # the script's defaults

    @property
    def output(self) -> str:
        path = self.dir / f"job-{self.id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def info(self) -> dict[str, str]:
        return self.cluster.job_info(self.id)

    def events(self) -> list[dict]:
        return read_jsonl(self.run_dir / "events.jsonl")

    def wait_for(self, predicate, timeout: float, what: str):
        """Poll `predicate()` (files: cheap) twice a second; ask slurmctld whether the job died
        meanwhile every STATE_EVERY_S (a `scontrol` in the controller's namespace each time)."""
        deadline = time.monotonic() + timeout
        asked = 0.0
        while not (value := predicate()):
            now = time.monotonic()
            if now - asked >= STATE_EVERY_S or now > deadline:
                asked, state = now, self.info().get("JobState")
                if state in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                    pytest.fail(f"job {self.id} {state} while waiting for {what}\n{self.tail()}")
                if now > deadline:
                    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; job {self.id} "
                                f"{state}\n{self.tail()}\n{self.cluster.diagnostics()}")
            time.sleep(0.5)
        return value

    def wait_done(self, timeout: float) -> dict[str, str]:
        """Wait until the job has finished for good; returns its final `scontrol` record."""
        deadline = time.monotonic() + timeout
        while (info := self.info()).get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED",
                                                           "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            if time.monotonic() > deadline:
                pytest.fail(f"job {self.id} still {info.get('JobState')} after {timeout:.0f}s\n"
                            f"{self.tail()}")
            time.sleep(1)
        self.ended = time.time()
        return info

    def tail(self, n: int = 60) -> str:
        lines = [ln for ln in self.output.splitlines() if "PlacementGroupCleaner" not in ln]
        return f"--- last lines of job {self.id}'s output ---\n" + "\n".join(lines[-n:])

    def assert_cleaned_up(self) -> None:
        """Nothing of the job left: no processes (Ray daemons included), no temp dir."""
        deadline = time.monotonic() + 30
        while (pids := self.cluster.job_process_pids(self.id)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not pids, f"job {self.id} left processes behind: {ps(pids)}"
        assert not Path(f"/tmp/rj{self.id}").exists(), "the job's Ray temp dir was not removed"


def ps(pids: list[int]) -> str:
    return subprocess.run(["ps", "-o", "pid,ppid,etime,args", "-p", ",".join(map(str, pids))],
                          capture_output=True, text=True).stdout


def assert_two_node_run(job: Job, epochs: int) -> None:
    """The run trained on both SLURM nodes, reached its last epoch and saved checkpoints."""
    assert "Ray cluster up: 2 node(s)" in job.output
    topo = json.loads((job.run_dir / "topology.json").read_text())
    assert topo["world_size"] == 2
    if job.cluster.network == "netns" or all("node_id" in w for w in topo["workers"]):
        # One IP per node in the namespace cluster (on loopback both nodes share one IP).
        assert topo["num_nodes"] == 2, topo
        assert len({w.get("node_id") or w["node_ip"] for w in topo["workers"]}) == 2, topo
    assert [m["epoch"] for m in read_jsonl(job.run_dir / "metrics.jsonl")] == list(range(1, epochs + 1))
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert summary["finished"] is True and summary["epochs_completed"] == epochs
    assert list(job.run_dir.glob("checkpoint_*")), "no checkpoint in the run folder"
    for node in job.cluster.nodes:  # one Ray node started per SLURM node, each with its log
        assert (job.dir / "ray-logs" / str(job.id) / f"{node}.log").exists()


def kill_job_processes(job: Job, node: str | None = None, match: str = "", sig: int = signal.SIGKILL) -> list[int]:
    """Send `sig` (SIGKILL) to the job's processes on `node` (all nodes if None) whose command line
    contains `match`; returns their PIDs. Ray daemons and workers inherit SLURMD_NODENAME from their
    step."""
    pids = []
    for pid in job.cluster.job_process_pids(job.id):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if node is not None and f"SLURMD_NODENAME={node}".encode() not in environ:
            continue
        if match in cmdline:
            pids.append(pid)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids
