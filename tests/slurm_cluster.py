"""A real two-node SLURM cluster on this machine, for tests that run `sbatch` for real.

munged, slurmctld and two slurmd daemons (node1, node2); Debian's slurmd is built with
MULTIPLE_SLURMD, so both nodes run on this host and share its /tmp. Two network layouts:

- "netns" (preferred): each slurmd in its own network namespace with its own IP (10.213.7.2, .3)
  on a bridge that lives in a third, private namespace holding slurmctld (10.213.7.1). Nothing
  is added to the machine's own network namespace, and the namespaces have no route anywhere
  else, so no job traffic can leave them. Client commands run in the controller's namespace.
- "loopback": both slurmd on 127.0.0.1 with their own ports (when namespaces cannot be made).

Every file (config, key, state, spool, logs) lives in one temporary folder; the daemons are
stopped by the PIDs recorded at start, then the namespaces are deleted. Root is required.

    with SlurmCluster() as cluster:
        job_id = cluster.sbatch(["--nodes=2", "job.sh"], cwd=repo)
        cluster.wait_for_state(job_id, {"COMPLETED"}, timeout=120)

Nodes advertise more CPUs than the machine has (SlurmdParameters=config_overrides) so that two
2-node jobs can run at once on a 2-core machine, and `gpus_per_node` GPUs that Slurm only counts
(gres.conf File=/dev/null,/dev/zero): enough to test how GPU requests reach a job, not CUDA.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

REQUIRED_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo",
                     "squeue")
FAKE_GPU_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/urandom")
SUBNET = "10.213.7"  # only ever configured inside the cluster's own network namespaces
APT_PACKAGES = "slurmctld slurmd slurm-client munge"
TERMINAL_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
    "DEADLINE", "PREEMPTED",
}


def missing_requirement() -> str | None:
    """Why a real SLURM cluster cannot be started here, or None when it can."""
    if os.geteuid() != 0:
        return "SLURM test cluster needs root (SlurmUser=root, munged key ownership)"
    missing = [b for b in REQUIRED_BINARIES if shutil.which(b) is None]
    if missing:
        return (f"SLURM/munge binaries not found: {', '.join(missing)} "
                f"(HINT: apt-get install --no-install-recommends {APT_PACKAGES})")
    return None


def free_tcp_port() -> int:
    """A port the kernel says is free now (ephemeral range, so it cannot meet Ray's ports)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_scontrol_record(text: str) -> dict[str, str]:
    """`scontrol show -o` output (one record, `Key=Value` pairs) as a dict."""
    record: dict[str, str] = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep:
            record[key] = value
    return record


class SlurmCluster:
    """munged + slurmctld + slurmd per node, all in a private folder, stopped by PID."""

    def __init__(self, nodes=("node1", "node2"), cpus_per_node: int = 4, gpus_per_node: int = 2,
                 memory_mb_per_node: int = 4096, root: str | None = None, network: str = "auto"):
        assert network in ("auto", "netns", "loopback")
        assert 0 <= gpus_per_node <= len(FAKE_GPU_DEVICES)
        self.nodes = tuple(nodes)
        self.cpus_per_node = cpus_per_node
        self.gpus_per_node = gpus_per_node
        self.memory_mb_per_node = memory_mb_per_node
        self.root = Path(root or tempfile.mkdtemp(prefix="slurm-"))
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.hostname = socket.gethostname().split(".")[0]
        self.procs: dict[str, subprocess.Popen] = {}
        self.network = network
        tag = os.urandom(3).hex()
        self.netns = {"ctl": f"rj{tag}c", **{n: f"rj{tag}{i}" for i, n in enumerate(self.nodes, 1)}}
        self.netns_made: list[str] = []

    def node_addr(self, node: str) -> str:
        if self.network == "loopback":
            return "127.0.0.1"
        return f"{SUBNET}.{self.nodes.index(node) + 2}"

    def _in_netns(self, who: str, argv: list[str]) -> list[str]:
        """argv run in the network namespace of `who` ("ctl" or a node), or as is on loopback."""
        if self.network == "loopback":
            return argv
        return ["nsenter", f"--net=/run/netns/{self.netns[who]}", *argv]

    # ---- public API -------------------------------------------------------------------------
    @property
    def env(self) -> dict[str, str]:
        """Environment for client commands (sbatch, scontrol, ...) and for jobs they submit."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def job_env(self) -> dict[str, str]:
        """Environment a job on this cluster needs on top of the usual one (which carries the
        tests' OMP_WAIT_POLICY=PASSIVE from tests/conftest.py: jobs get the submitter's environment)."""
        if self.network == "netns":
            # The nodes share this machine's hostname, which resolves to 127.0.0.1, so gloo
            # would advertise loopback to the other node; name the node's interface instead.
            return {"GLOO_SOCKET_IFNAME": "eth0"}
        return {}

    def start(self, timeout: float = 60) -> SlurmCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)  # munged insists its socket folder be reachable by all
        try:
            self._make_network()
            self._start_munge(timeout)
            self._write_config()
            self._spawn("slurmctld", self._in_netns("ctl", ["slurmctld", "-D", "-i"]))
            for node in self.nodes:
                self._spawn(f"slurmd-{node}", self._in_netns(node, ["slurmd", "-D", "-N", node]))
            self._wait_nodes_idle(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def cancel_jobs(self) -> None:
        """Cancel every job still queued or running and wait until none runs (a failed test's job
        must not go on loading the machine under the next test)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run(["scancel", "--full", "--quiet", "--user=root"], check=False, timeout=30)
            self._wait_no_running_jobs(timeout=60)

    def stop(self) -> None:
        """Cancel our jobs, stop every daemon we started (by PID), kill leftovers of our jobs."""
        try:
            self.cancel_jobs()
        finally:
            for name in reversed(list(self.procs)):
                self._terminate(self.procs[name])
            self.procs.clear()
            for pid in self.job_process_pids():
                _kill_quietly(pid, signal.SIGKILL)
            for ns in reversed(self.netns_made):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
            self.netns_made.clear()
            if os.environ.get("SLURM_TEST_KEEP_DIR") != "1":
                shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def run(self, args: list[str], check: bool = True, timeout: float = 60, where: str = "ctl",
            **kwargs) -> subprocess.CompletedProcess:
        """A command (e.g. a SLURM client) on the cluster's network: the controller's namespace,
        or a node's with where="node1"; stdout/stderr captured as text."""
        return subprocess.run(self._in_netns(where, args), env=kwargs.pop("env", self.env), capture_output=True,
                              text=True, check=check, timeout=timeout, **kwargs)

    def sbatch(self, args: list[str], cwd: str | Path, env: dict[str, str] | None = None) -> int:
        out = self.run(["sbatch", "--parsable", *args], cwd=cwd, env={**self.env, **(env or {})})
        return int(out.stdout.strip().split(";")[0])

    def job_info(self, job_id: int) -> dict[str, str]:
        out = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        return parse_scontrol_record(out.stdout) if out.returncode == 0 else {}

    def job_state(self, job_id: int) -> str:
        return self.job_info(job_id).get("JobState", "UNKNOWN")

    def wait_for(self, predicate, timeout: float, what: str, interval: float = 0.5):
        """Poll `predicate()` until it returns something truthy; return it, or fail naming `what`."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}\n"
                                   f"{self.diagnostics()}")
            time.sleep(interval)

    def wait_for_state(self, job_id: int, states: set[str], timeout: float) -> dict[str, str]:
        return self.wait_for(lambda: (lambda i: i if i.get("JobState") in states else None)(
            self.job_info(job_id)), timeout, f"job {job_id} to reach {sorted(states)}")

    def job_process_pids(self, job_id: int | None = None) -> list[int]:
        """PIDs of live processes started under this cluster (optionally by one job).

        Found by our unique SLURM_CONF (and SLURM_JOB_ID) in /proc/<pid>/environ: Ray daemons
        inherit the job's environment, so this finds exactly what our jobs left behind.
        """
        needles = [f"SLURM_CONF={self.conf}".encode()]
        if job_id is not None:
            needles.append(f"SLURM_JOB_ID={job_id}".encode())
        daemons = {p.pid for p in self.procs.values()}
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in (os.getpid(), *daemons):
                continue
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z" and all(n in environ for n in needles):
                pids.append(int(entry.name))
        return pids

    def diagnostics(self) -> str:
        """Queue, node states and daemon log tails, for failure messages."""
        parts = [self.run(["squeue", "-a"], check=False).stdout,
                 self.run(["sinfo", "-N", "-l"], check=False).stdout]
        for log in sorted(self.root.glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"--- {log.name} ---\n" + "\n".join(lines))
        return "\n".join(parts)

    # ---- bring-up ---------------------------------------------------------------------------
    def _make_network(self) -> None:
        """Namespaces + bridge (see the module docstring); falls back to loopback under "auto"."""
        if self.network == "loopback":
            return
        try:
            self._make_netns()
            self.network = "netns"
        except (subprocess.CalledProcessError, FileNotFoundError) as e:
            for ns in reversed(self.netns_made):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
            self.netns_made.clear()
            if self.network == "netns":
                raise RuntimeError(f"cannot create network namespaces: {e}") from e
            self.network = "loopback"

    def _make_netns(self) -> None:
        def ip(*args: str) -> None:
            subprocess.run(["ip", *args], check=True, capture_output=True, text=True)
        ctl = self.netns["ctl"]
        for ns in self.netns.values():
            ip("netns", "add", ns)
            self.netns_made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", ctl, "link", "add", "br0", "type", "bridge")
        ip("-n", ctl, "addr", "add", f"{SUBNET}.1/24", "dev", "br0")
        ip("-n", ctl, "link", "set", "br0", "up")
        for i, node in enumerate(self.nodes, 1):
            ns = self.netns[node]
            ip("-n", ctl, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("-n", ctl, "link", "set", f"v{i}", "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{self.node_addr(node)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")

    def _start_munge(self, timeout: float) -> None:
        munge_dir = self.munge_socket.parent
        munge_dir.mkdir(mode=0o755, exist_ok=True)
        key = munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self._spawn("munged", [
            "munged", "--foreground", "--force", f"--socket={self.munge_socket}",
            f"--key-file={key}", f"--pid-file={munge_dir / 'munged.pid'}",
            f"--seed-file={munge_dir / 'munged.seed'}", f"--log-file={self.root / 'munged.log'}",
        ])
        self.wait_for(self.munge_socket.exists, timeout, "the munge socket", interval=0.1)

    def _write_config(self) -> None:
        r = self.root
        for sub in ("state", *(f"spool-{n}" for n in self.nodes)):
            (r / sub).mkdir(exist_ok=True)
        lines = [
            "ClusterName=raytest",
            # job ids of their own: a job's node-local temp dir is /tmp/rj<job id> (slurm_ray_start.sh)
            f"FirstJobId={1000 + int(self.netns['ctl'][2:8], 16) % 900000}",
            f"SlurmctldHost={self.hostname}"
            f"({'127.0.0.1' if self.network == 'loopback' else SUBNET + '.1'})",
            f"SlurmctldPort={free_tcp_port()}",
            "SlurmUser=root",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r}/spool-%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r / 'slurmctld.log'}",
            f"SlurmdLogFile={r}/slurmd-%n.log",
            "SlurmctldDebug=info", "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
            "JobAcctGatherType=jobacct_gather/none", "MpiDefault=none",
            "ReturnToService=2", "KillWait=10", "MinJobAge=600", "InactiveLimit=0",
            "SchedulerParameters=batch_sched_delay=0",
            "SlurmdParameters=config_overrides",  # advertise more CPUs than this machine has
        ]
        if self.gpus_per_node:  # gpus_per_node=0: a CPU-only cluster, which knows no GPU type
            lines.append("GresTypes=gpu")
        if self.network == "loopback":  # bind NodeAddr; in a namespace, any address is private
            lines.append("CommunicationParameters=NoInAddrAny")
        for node in self.nodes:
            lines.append(
                f"NodeName={node} NodeHostname={self.hostname} NodeAddr={self.node_addr(node)} "
                f"Port={free_tcp_port()} CPUs={self.cpus_per_node} Sockets=1 "
                f"CoresPerSocket={self.cpus_per_node} ThreadsPerCore=1 "
                f"RealMemory={self.memory_mb_per_node} "
                + (f"Gres=gpu:{self.gpus_per_node} " if self.gpus_per_node else "") + "State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES "
                     "MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        # Slurm counts a GPU per character device in File=; harmless ones stand in for GPUs.
        devices = ",".join(FAKE_GPU_DEVICES[:self.gpus_per_node])
        (r / "gres.conf").write_text(f"AutoDetect=off\nNodeName={','.join(self.nodes)} Name=gpu "
                                     f"File={devices}\n" if self.gpus_per_node else "")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def _wait_nodes_idle(self, timeout: float) -> None:
        def all_idle() -> bool:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} during bring-up\n"
                                       f"{self.diagnostics()}")
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout.split()
            states = dict(zip(out[::2], out[1::2]))
            return all(states.get(n) == "idle" for n in self.nodes)
        self.wait_for(all_idle, timeout, "all nodes idle", interval=0.2)

    # ---- teardown ---------------------------------------------------------------------------
    def _wait_no_running_jobs(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run(["squeue", "-h", "-o", "%i"], check=False)
            if out.returncode != 0 or not out.stdout.strip():
                return
            time.sleep(0.5)

    @staticmethod
    def _terminate(proc: subprocess.Popen, timeout: float = 10) -> None:
        if proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


def _kill_quietly(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
