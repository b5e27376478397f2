"""One Ray node: `ray start --block` with the port layout, the environment defaults and the token.

Two ways to run it:
  step   in a SLURM step (slurm_ray_start.sh's srun): a private temp dir with the job's token (mode
         0600, passed in RJ_TOKEN), `ray start --block` in the foreground until SIGTERM, the temp
         dir removed on every way out;
  start  from cluster.yaml over SSH: stops this machine's previous node of ours (by its PID file,
         only if that PID is still a `ray start`), starts `ray start --block` detached from the SSH
         session, records its PID, and waits until it says it started (else prints its log, exit 1).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Optional

from . import ports, rayenv

STARTED = "Ray runtime started"


def ray_cli() -> str:
    return os.path.join(os.path.dirname(sys.executable), "ray")


def step_flags(ip: str, name: str, cpus: int, gpus: int, head_address: Optional[str], dashboard: bool,
               env: Mapping[str, str]) -> list[str]:
    """A SLURM step's `ray start` flags beside its ports: its address, name and resources; on the
    head the dashboard (on the head's address only) or none, on the others the head's address and
    RJ_WORKER_START_ARGS; then RJ_START_ARGS (every node), last so that the user's flags win."""
    flags = [f"--node-ip-address={ip}", f"--node-name={name}", f"--num-cpus={cpus}", f"--num-gpus={gpus}",
             "--disable-usage-stats"]
    if head_address:
        flags += [f"--address={head_address}", *shlex.split(env.get("RJ_WORKER_START_ARGS", ""))]
    else:
        flags += ["--include-dashboard=true", f"--dashboard-host={ip}"] if dashboard else ["--include-dashboard=false"]
    return flags + shlex.split(env.get("RJ_START_ARGS", ""))


def run_step(tmp: str, block: str, head: bool, args: list[str], slot: int = 0, keep_logs: str = "") -> int:
    """Runs a SLURM step's Ray node until it ends or is sent SIGTERM/SIGINT; its exit status. A
    node that ends by itself leaves a copy of its Ray logs in `keep_logs` (if given)."""
    os.umask(0o077)
    os.makedirs(tmp, exist_ok=True)
    token = os.path.join(tmp, "token")
    with open(token, "w") as f:
        f.write(os.environ.pop("RJ_TOKEN", ""))
    base = ports.free_block(ports.BLOCK, *ports.port_range(os.environ), slot=slot) if block == "probe" else int(block)
    env = {**os.environ, **rayenv.defaults(os.environ), **rayenv.auth_env(token)}
    cmd = [ray_cli(), "start", "--block", *(["--head"] if head else []), f"--temp-dir={tmp}",
           *ports.ray_start_flags(base, head), *args]
    print(" ".join(cmd), flush=True)  # to the node's log
    proc = subprocess.Popen(cmd, env=env)
    stopping: list[int] = []

    def stop(signum, frame):
        stopping.append(signum)
        proc.terminate()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        rc = proc.wait()
        if keep_logs and not stopping:
            try:
                shutil.copytree(os.path.join(tmp, "session_latest", "logs"), keep_logs, dirs_exist_ok=True)
                print(f"Ray's logs of this node: {keep_logs}", file=sys.stderr)
            except OSError as e:
                print(f"could not keep Ray's logs of this node: {e}", file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.listdir(os.path.dirname(tmp) or "."):
            os.rmdir(os.path.dirname(tmp))
    return 128 + stopping[0] if stopping else rc


def _is_ray_start(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"ray start" in f.read().replace(b"\0", b" ")
    except OSError:
        return False


def stop_previous(pid_file: str, timeout_s: float = 60) -> None:
    """SIGTERM to the node of ours this machine still runs (a second `ray up`); never `ray stop`."""
    try:
        pid = int(open(pid_file).read())
    except (OSError, ValueError):
        return
    if _is_ray_start(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
            time.sleep(1)
    os.remove(pid_file)


def read_env_file(path: str) -> dict[str, str]:
    """VAR=value lines (blank lines and # comments skipped), as `set -a; . FILE` would read them."""
    if not os.path.isfile(path):
        return {}
    env = {}
    for line in open(path).read().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            env[key.removeprefix("export ").strip()] = value.strip().strip("'\"")
    return env


def machine_resources() -> list[str]:
    """This machine's CPUs (all of them: `ray up` sets OMP_NUM_THREADS=1) and NVIDIA GPUs."""
    try:
        out = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True, timeout=30).stdout
        gpus = sum(line.startswith("GPU") for line in out.splitlines())
    except (OSError, subprocess.SubprocessError):
        gpus = 0
    return [f"--num-cpus={len(os.sched_getaffinity(0))}", f"--num-gpus={gpus}"]


def start_detached(state_dir: str, temp_dir: str, head_ip: Optional[str], extra: list[str],
                   wait_s: float = 120) -> int:
    """cluster.yaml's start command (see the module); 0 once the node runs. Every machine's block
    starts at RJ_PORT_BASE."""
    import ray.util

    base = ports.port_range(os.environ)[0]
    state_dir = os.path.expanduser(state_dir)
    pid_file, log_file = os.path.join(state_dir, "ray.pid"), os.path.join(state_dir, "ray.log")
    stop_previous(pid_file)
    node_ip = ray.util.get_node_ip_address()
    head = head_ip is None
    head_ip = node_ip if head else head_ip
    env = {**os.environ, **rayenv.DEFAULTS, **rayenv.auth_env(os.path.join(state_dir, "auth_token")),
           "RAY_API_SERVER_ADDRESS": f"http://{head_ip}:{ports.dashboard_port(base)}",
           **read_env_file(os.path.join(state_dir, "storage.env"))}
    env.pop("OMP_NUM_THREADS", None)
    where = (["--head", f"--dashboard-host={node_ip}", "--include-dashboard=true"] if head
             else [f"--address={head_ip}:{ports.gcs_port(base)}"])
    cmd = [ray_cli(), "start", "--block", *where, f"--temp-dir={temp_dir}",
           *ports.ray_start_flags(base, head), *machine_resources(),
           "--disable-usage-stats", *extra]
    with open(log_file, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    with open(pid_file, "w") as f:
        f.write(str(proc.pid))
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and proc.poll() is None:
        if STARTED in open(log_file, errors="replace").read():
            print(f"Ray node started (pid {proc.pid}, log {log_file})")
            return 0
        time.sleep(1)
    print("".join(open(log_file, errors="replace").readlines()[-40:]), file=sys.stderr)
    print(f"error: `ray start` did not start within {wait_s:g} s (exit {proc.poll()}); its log is above",
          file=sys.stderr)
    return 1
