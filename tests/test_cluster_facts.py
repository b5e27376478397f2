"""The cluster facts that bash and YAML ask Python for (ray_job.cluster): the port layout, Ray's
environment, the token, node addresses, readiness, what an exit status means to SLURM, and the
private Ray APIs behind one door. No cluster needed."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys

import pytest

from conftest import ROOT
from ray_job.cluster import node, ports, rayenv, raypriv, readiness, slurm
from ray_job.cluster.ports import free_port
from ray_job.core.errors import UsageError
from ray_job.core.exits import ExitCode, slurm_action

# Port ranges for the block searches: below Linux's ephemeral range (32768-60999), where every
# connection of the other tests running meanwhile takes a port and a block of 200 is rarely all free.
QUIET_LO = 10000 + os.getpid() % 5000


def cluster_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ray_job.cluster", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def flags(lines: list[str]) -> dict[str, int]:
    return {f.split("=")[0][2:]: int(f.split("=")[1]) for f in lines}


def test_the_port_layout_of_a_head_and_a_worker():
    head, worker = flags(ports.ray_start_flags(20000, head=True)), flags(ports.ray_start_flags(20000, head=False))
    assert head["port"] == 20000 and head["dashboard-port"] == 20001 and head["ray-client-server-port"] == 20002
    assert not {"port", "dashboard-port", "ray-client-server-port"} & set(worker)
    assert {k: v for k, v in head.items() if k in worker} == worker  # same layout on every node
    assert worker["min-worker-port"] == 20010 and worker["max-worker-port"] == 20199
    used = sorted(head.values())
    assert len(set(used)) == len(used) and used[-1] == 20199  # nothing outside the block, nothing twice
    with pytest.raises(ValueError):
        ports.ray_start_flags(20000, True, size=10)


def test_the_ports_command_prints_the_flags_of_the_block_at_rj_port_base():
    out = cluster_cli("ports", "--head", env={"RJ_PORT_BASE": "30000"})
    assert out.returncode == 0 and out.stdout.split() == ports.ray_start_flags(30000, True)
    assert cluster_cli("ports").stdout.split() == ports.ray_start_flags(ports.BASE, False)


@pytest.mark.parametrize("env, expected", [
    ({}, (20000, 32767)), ({"RJ_PORT_BASE": "25000"}, (25000, 32767)),
    ({"RJ_PORT_BASE": "40000", "RJ_PORT_MAX": "49999"}, (40000, 49999)),
])
def test_the_port_range_is_rj_port_base_to_rj_port_max(env, expected):
    assert ports.port_range(env) == expected


@pytest.mark.parametrize("env", [{"RJ_PORT_BASE": "2e4"}, {"RJ_PORT_BASE": "32700"},
                                 {"RJ_PORT_MAX": "70000"}, {"RJ_PORT_BASE": "80"}])
def test_a_port_range_without_room_for_a_block_is_refused_with_one_line(env):
    with pytest.raises(UsageError, match="RJ_PORT_BASE=.* e.g. RJ_PORT_BASE=20000"):
        ports.port_range(env)
    out = cluster_cli("head-block", "--job-id", "3", env=env)
    assert out.returncode == ExitCode.BAD_INPUT and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("error: RJ_PORT_BASE=")


def test_a_jobs_port_is_in_the_range_and_the_same_for_every_task():
    assert ports.job_port({}, 1234) == 21234 == ports.job_port({}, 1234)
    assert ports.job_port({}, 12768) == 20000  # wraps round inside the range
    assert ports.job_port({"RJ_PORT_BASE": "40000", "RJ_PORT_MAX": "40999"}, 1234) == 40234


def test_head_block_is_free_and_its_ports_follow_the_layout():
    lo = QUIET_LO
    out = cluster_cli("head-block", "--job-id", "12", env={"RJ_PORT_BASE": str(lo), "RJ_PORT_MAX": str(lo + 999)})
    base, gcs, dash = map(int, out.stdout.split())
    assert lo <= base <= lo + 800 and (gcs, dash) == (base, base + 1)
    assert all(ports.is_free(p) for p in range(base, base + ports.BLOCK))
    held = [socket.create_server(("", p)) for p in range(lo, lo + 2 * ports.BLOCK, ports.BLOCK)]
    try:  # a port held in each block of the range
        full = cluster_cli("head-block", "--job-id", "1",
                           env={"RJ_PORT_BASE": str(lo), "RJ_PORT_MAX": str(lo + 2 * ports.BLOCK - 1)})
    finally:
        for s in held:
            s.close()
    assert full.returncode == ExitCode.CLUSTER_DOWN and full.stderr.startswith("error: no free ports")


def test_a_node_started_again_looks_for_ports_past_its_old_block():
    lo = QUIET_LO
    first = ports.free_block(200, lo, lo + 999, slot=ports.slot(12, 1))
    again = ports.free_block(200, lo, lo + 999, slot=ports.slot(12, 1, restarts=1))
    assert first != again  # both free: the lost node's block is free again once its processes died


def test_env_prints_only_the_defaults_not_already_set():
    out = cluster_cli("env", env={"RAY_USAGE_STATS_ENABLED": "1"})
    assert "RAY_USAGE_STATS_ENABLED" not in out.stdout
    assert "export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0" in out.stdout.splitlines()


# A training step's memory pattern, in a thread as Ray Train runs the loop: more than one thread
# arena heap (64 MiB) allocated, touched and freed per step; prints minor page faults per step.
_STEPS_IN_A_THREAD = """
import resource, threading
def step():
    bufs = [bytearray(8 << 20) for _ in range(10)]
    for b in bufs:
        b[::4096] = bytes(len(b) // 4096)  # a write to every page
def loop(out):
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        step()
    out.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
out = []
t = threading.Thread(target=loop, args=(out,))
t.start()
t.join()
print(out[0])
"""


@pytest.mark.skipif(not os.confstr("CS_GNU_LIBC_VERSION"), reason="glibc's malloc only")
def test_worker_malloc_keeps_a_threads_step_memory_instead_of_faulting_it_in_again():
    def faults_per_step(env: dict) -> float:
        clean = {k: v for k, v in os.environ.items() if k not in rayenv.WORKER_MALLOC}
        return float(subprocess.run([sys.executable, "-c", _STEPS_IN_A_THREAD], env={**clean, **env},
                                    capture_output=True, text=True, check=True, timeout=60).stdout)

    default, kept = faults_per_step({}), faults_per_step(rayenv.worker_malloc({}))
    assert default > 5_000  # of the step's 20,480 pages: a freed heap's faulted in again
    assert kept < default / 20, (default, kept)
    assert rayenv.worker_malloc({"MALLOC_TOP_PAD_": "0"}) == {}  # a user's own malloc settings win


def test_token_is_private_and_never_overwritten(tmp_path):
    path = tmp_path / "token"
    assert cluster_cli("token", str(path)).returncode == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(path.read_text()) == 64
    before = path.read_text()
    assert cluster_cli("token", str(path)).returncode != 0 and path.read_text() == before


@pytest.mark.parametrize("rc, stop, expected", [
    (0, False, "exit 0"), (1, False, "exit 1"), (2, True, "exit 2"), (0, True, "exit 0"),
    (3, True, "requeue 3"), (1, True, "requeue 3"), (130, True, "requeue 3"),
    (5, False, "requeue 5"), (None, True, "requeue 3"), (137, False, "exit 137"), (130, False, "exit 130"),
])
def test_what_each_exit_status_means_to_slurm(rc, stop, expected):
    action, status, why = slurm_action(rc, stop, "r1")
    killed = rc == 137  # SIGKILL, e.g. the OOM killer; 130 and 143 are the driver's own stops
    assert f"{action} {status}" == expected and (why != "") == (action == "requeue" or killed)


def test_exit_action_command():
    assert cluster_cli("exit-action", "5", "0").stdout.startswith("requeue 5 the cluster lost the resources")
    killed = cluster_cli("exit-action", "137", "0", "--run-name", "slurm-7").stdout
    assert killed.startswith("exit 137 ERROR: the driver was killed by signal 9 (KILL)")
    assert "resubmit with RJ_RUN_NAME=slurm-7 to continue" in killed
    unknown = cluster_cli("exit-action", "200", "0").stdout
    assert unknown.startswith("exit 200 ERROR: the driver was killed by signal 72 (?)")
    assert cluster_cli("exit-action", "none", "1").stdout.split()[:2] == ["requeue", "3"]
    assert cluster_cli("exit-action", "0", "0").stdout.split() == ["exit", "0"]


def test_node_restart_command(tmp_path):
    out = cluster_cli("node-restart", "n2", "1", env={"RJ_NODE_RESTART_S": "5", "RJ_NODE_RESTARTS": "2"})
    assert out.stdout == "10 starting Ray on n2 again in 10 s (restart 2 of 2)\n" and out.stderr == ""
    (tmp_path / "n2.log").write_text("".join(f"line {i}\n" for i in range(40)))
    out = cluster_cli("node-restart", "n2", "3", "--log-dir", str(tmp_path))
    assert out.stdout.startswith("-1 not starting Ray on n2 again")
    assert f"last lines of {tmp_path}/n2.log" in out.stderr and "line 39\n" in out.stderr
    assert "line 24\n" not in out.stderr  # its end only


def test_a_slurm_steps_ray_start_flags():
    env = {"RJ_START_ARGS": "--object-store-memory=300000000 --labels='a b'", "RJ_WORKER_START_ARGS": "--address=x:1"}
    head = node.step_flags("10.0.0.1", "n1", 8, 2, None, True, env)
    assert head[:5] == ["--node-ip-address=10.0.0.1", "--node-name=n1", "--num-cpus=8", "--num-gpus=2",
                        "--disable-usage-stats"]
    assert head[5:] == ["--include-dashboard=true", "--dashboard-host=10.0.0.1",  # the head's address only
                        "--object-store-memory=300000000", "--labels=a b"]
    assert node.step_flags("10.0.0.1", "n1", 8, 0, None, False, {})[5:] == ["--include-dashboard=false"]
    worker = node.step_flags("10.0.0.2", "n2", 8, 0, "10.0.0.1:20000", False, env)
    # the user's flags last, so that they win (a worker's own --address too)
    assert worker[5:] == ["--address=10.0.0.1:20000", "--address=x:1", "--object-store-memory=300000000",
                          "--labels=a b"]


def test_node_addresses_refuse_a_mix_of_loopback_and_routable(monkeypatch):
    addrs = {"n1": "127.0.0.1", "n2": "10.1.2.3"}
    monkeypatch.setattr(slurm, "node_addr", lambda node: node)
    monkeypatch.setattr(slurm, "ipv4", lambda host: addrs.get(host))
    with pytest.raises(slurm.NodeError, match="mix loopback and routable.*RJ_HEAD_IP"):
        slurm.node_addresses(["n1", "n2"])
    assert slurm.node_addresses(["n1", "n2"], head_ip="10.1.2.2") == ["10.1.2.2", "10.1.2.3"]
    assert slurm.node_addresses(["n1"]) == ["127.0.0.1"]
    with pytest.raises(slurm.NodeError, match="cannot resolve an address for node n3"):
        slurm.node_addresses(["n3"])


def test_readiness_waits_for_every_node_and_gpu(tmp_path):
    seen = iter([readiness.Status(False, 0, ()), readiness.Status(True, 0, ("a",)),
                 readiness.Status(True, 1, ("a", "b")), readiness.Status(True, 2, ("a", "b"))])
    lines = []
    readiness.POLL_S, old = 0.0, readiness.POLL_S
    try:
        status = readiness.wait_for_nodes("x:1", ["a", "b"], 2, 30, {}, str(tmp_path), lines.append,
                                          status=lambda address: next(seen))
    finally:
        readiness.POLL_S = old
    assert status.alive == ("a", "b") and status.gpus == 2
    assert lines[0] == "cluster: alive=[] missing=[a b] GPUs=0/2" and len(lines) == 4


def test_readiness_fails_at_once_when_a_nodes_step_has_ended(tmp_path):
    done = subprocess.Popen(["true"])
    done.wait()
    (tmp_path / "n2.log").write_text("raylet crashed\n")
    with pytest.raises(readiness.NotReady) as e:
        readiness.wait_for_nodes("x:1", ["n1", "n2"], 0, 30, {"n2": done.pid}, str(tmp_path), print,
                                 status=lambda address: readiness.Status(True, 0, ("n1",)))
    assert "missing Ray node(s): n2" in str(e.value) and "raylet crashed" in str(e.value)
    assert f"{tmp_path}/n2.log" in str(e.value)


def test_wait_counts_the_gpus_of_every_node_it_waits_for(tmp_path):
    """The script gives GPUs per node; the GPUs to wait for are that times the nodes given."""
    out = cluster_cli("wait", f"127.0.0.1:{free_port()}", "--nodes", "a", "b", "--gpus-per-node", "4",
                      "--timeout", "0", "--log-dir", str(tmp_path))
    assert out.returncode == ExitCode.CLUSTER_DOWN, out.stderr
    assert "missing Ray node(s): a b (GPUs 0/8)" in out.stderr


def test_cluster_status_is_down_when_nothing_listens():
    assert not readiness.cluster_status(f"127.0.0.1:{free_port()}").up
    assert not readiness.cluster_status("not-an-address").up


@pytest.mark.parametrize("key", sorted(raypriv.SYMBOLS))
def test_every_private_ray_symbol_is_where_it_was(key):
    """An upgrade that moves one fails here, naming it."""
    assert raypriv.get(key) is not None


def test_the_local_dashboard_port_is_never_one_of_rays_own_defaults(monkeypatch):
    """A kernel-chosen port once was 52365, where a local ray.init() puts the dashboard agent:
    Ray refused to start ("trying to use a port number 52365 that is used by other components")."""
    assert {6379, 8265, 52365} <= raypriv.default_ports()
    picks = iter([52365, 8265, 40123])

    class Socket:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            self.port = next(picks)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(ports.socket, "socket", Socket)
    assert ports.free_port(avoid=raypriv.default_ports()) == 40123


def test_the_trainer_starts_no_ray_datasets_actor_for_a_run_that_passes_none():
    """Ray Train adds a callback that starts a DatasetManager actor at every worker-group start;
    ours leaves it out when no Ray Dataset is passed, and keeps every other callback."""
    from ray.train.torch import TorchTrainer

    def names(trainer):
        return [type(c).__name__ for c in trainer._create_default_callbacks()]

    rays, ours = names(TorchTrainer(lambda: None)), names(raypriv.trainer_class()(lambda: None))
    assert "DatasetsCallback" in rays and "DatasetsCallback" not in ours
    assert [n for n in rays if n != "DatasetsCallback"] == ours


def test_a_moved_private_symbol_is_named(monkeypatch):
    monkeypatch.setitem(raypriv.SYMBOLS, "gone", ("ray.train", "NoSuchThing"))
    with pytest.raises(raypriv.PrivateAPIMoved, match=r"has no ray.train.NoSuchThing \(gone"):
        raypriv.get("gone")


def test_access_files_for_clients_hold_the_token_copy_and_the_addresses(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret")
    proc = cluster_cli("access", "--log-dir", str(tmp_path), "--token", str(token), "--head-ip", "10.0.0.5",
                       "--dashboard-port", "20001", "--gcs", "10.0.0.5:20000")
    assert proc.returncode == 0, proc.stderr
    copy, env_file = proc.stdout.split()
    assert open(copy).read() == "s3cret" and stat.S_IMODE(os.stat(copy).st_mode) == 0o600
    text = open(env_file).read()
    assert "export RAY_ADDRESS=http://10.0.0.5:20001\n" in text and f"RAY_AUTH_TOKEN_PATH={copy}" in text
    assert "export RAY_AUTH_MODE=token\n" in text and "10.0.0.5:20000" in text
