"""cluster.yaml (the `ray up` road): Ray's own cluster-launcher code accepts it, its commands are
valid bash, and `ray up` brings the head up for real over SSH (with ray_job/cluster/node.py's
start: the same port layout as SLURM jobs, token auth, dashboard on the head's address, stopped by
PID and never `ray stop`)."""

import copy
import getpass
import hashlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
import yaml

from conftest import RAY_CLI, ROOT, free_port_block

pytestmark = pytest.mark.timeout(60)

CONFIG = os.path.join(ROOT, "cluster.yaml")


def load() -> dict:
    with open(CONFIG) as f:
        return yaml.safe_load(f)


def test_ray_accepts_the_config():
    from ray_job.cluster import raypriv

    prepare_config, validate_config = raypriv.get("cluster_config_prepare"), raypriv.get("cluster_config_validate")
    raw = load()
    prepared = prepare_config(copy.deepcopy(raw))  # merges Ray's defaults for `type: local`
    validate_config(prepared)                       # Ray's JSON schema + its own checks
    assert prepared["provider"]["type"] == "local"
    node_type = prepared["available_node_types"][prepared["head_node_type"]]
    assert node_type["min_workers"] == node_type["max_workers"] == len(raw["provider"]["worker_ips"])
    assert raw["provider"]["head_ip"] not in raw["provider"]["worker_ips"]
    assert raw["auth"]["ssh_user"] and raw["auth"]["ssh_private_key"]
    # Our commands replace Ray's defaults (which begin with `ray stop`), none is added back.
    for key in ("head_start_ray_commands", "worker_start_ray_commands", "setup_commands"):
        assert prepared[key] == raw[key]
    everything = yaml.safe_dump(prepared)
    assert "ray stop" not in everything and "ray down" not in everything.replace("`ray down`", "")


def test_commands_are_valid_bash():
    cfg = load()
    commands = cfg["setup_commands"] + cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=os.path.dirname(sys.executable))
    for cmd in commands:
        check = subprocess.run(["bash", "-n", "-c", cmd], capture_output=True, text=True)
        assert check.returncode == 0, (cmd, check.stderr)
        if shellcheck:  # SC2016: the `bash -c '...'` body expands in the inner shell, on purpose
            lint = subprocess.run([shellcheck, "-s", "bash", "-e", "SC2016", "-"], input=cmd + "\n",
                                  capture_output=True, text=True)
            assert lint.returncode == 0, lint.stdout


# --- `ray up` for real, against an sshd on loopback ----------------------------------------------
# The config is brought up as written, except what must differ on one shared machine: the
# addresses (head 127.0.0.1 through a loopback sshd on a free port, no workers), the folders
# (a temp dir instead of ~/ray_job, ~/.ray_job, ~/ray_job_venv -> this venv, /tmp/ray_job) and
# the port block (free ports, through RJ_PORT_BASE, instead of the default block). Teardown is by
# PID: `ray down` would run `ray stop`, which kills every Ray process on the machine, other sessions' clusters included.


def _sshd_missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (an sshd that accepts ssh_user root)"
    missing = [t for t in ("sshd", "ssh", "ssh-keygen", "rsync")
               if not shutil.which(t, path="/usr/sbin:/usr/bin:/sbin:/bin")]
    return f"missing {', '.join(missing)} (apt-get install openssh-server rsync)" if missing else None


# ProxyCommand: stdin/stdout <-> 127.0.0.1:PORT; half-closes on EOF so that sshd's session ends
# with the ssh client (a `bash /dev/tcp` + `cat` proxy leaves both behind).
PROXY = """import os, socket, sys, threading
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
def up():
    while data := os.read(0, 65536):
        s.sendall(data)
    s.shutdown(socket.SHUT_WR)
threading.Thread(target=up, daemon=True).start()
while data := s.recv(65536):
    os.write(1, data)
"""


def _wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"sshd exited with {proc.returncode}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"sshd not listening on 127.0.0.1:{port}")


@pytest.fixture
def loopback_sshd():
    """sshd -D on 127.0.0.1:<free port>, key auth for root with a fresh key; stopped by PID."""
    if reason := _sshd_missing():
        pytest.skip(reason)
    tmp = tempfile.mkdtemp(prefix="rju", dir="/tmp")
    for key in ("host_key", "id_ed25519"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{tmp}/{key}"], check=True)
    shutil.copy(f"{tmp}/id_ed25519.pub", f"{tmp}/authorized_keys")
    with open(f"{tmp}/proxy.py", "w") as f:
        f.write(PROXY)
    port = free_port_block(1)
    with open(f"{tmp}/sshd_config", "w") as f:
        f.write(f"Port {port}\nListenAddress 127.0.0.1\nHostKey {tmp}/host_key\nPidFile {tmp}/sshd.pid\n"
                f"AuthorizedKeysFile {tmp}/authorized_keys\nPermitRootLogin prohibit-password\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                "StrictModes no\nSubsystem sftp internal-sftp\n")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
    with open(f"{tmp}/sshd.log", "w") as log:
        proc = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", f"{tmp}/sshd_config"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for_port(port, proc)
        yield dict(dir=tmp, port=port, key=f"{tmp}/id_ed25519", proxy=f"{tmp}/proxy.py")
    finally:
        sessions = psutil.Process(proc.pid).children(recursive=True)  # this sshd's logins only
        proc.terminate()
        proc.wait(10)
        for child in sessions:
            try:
                child.terminate()
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(tmp, ignore_errors=True)


def _loopback_config(sshd: dict, name: str, base: int) -> dict:
    cfg, tmp = load(), sshd["dir"]
    # Ray's auth config has no SSH port; a ProxyCommand reaches the sshd's port.
    proxy = f"{sys.executable} {sshd['proxy']} {sshd['port']}"
    cfg.update(cluster_name=name, provider=dict(type="local", head_ip="127.0.0.1", worker_ips=[]),
               auth=dict(ssh_user="root", ssh_private_key=sshd["key"], ssh_proxy_command=proxy))
    renames = [("/tmp/ray_job", f"{tmp}/t"), ("~/ray_job_venv", sys.prefix),
               ("$HOME/ray_job_venv", sys.prefix), ("~/.ray_job", f"{tmp}/state"),
               ("$HOME/.ray_job", f"{tmp}/state"), ("~/ray_job", f"{tmp}/code")]

    def local(cmd: str) -> str:
        for old, new in renames:
            cmd = cmd.replace(old, new)
        return cmd

    cfg["setup_commands"] = [local(c) for c in cfg["setup_commands"]]
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        cfg[key] = [f"export RJ_PORT_BASE={base} RJ_PORT_MAX=65535 && {local(c)}" for c in cfg[key]]
    with open(f"{tmp}/local_token", "w") as f:
        f.write(secrets.token_hex(32))
    os.chmod(f"{tmp}/local_token", 0o600)
    cfg["file_mounts"] = {local("~/ray_job"): ".", local("~/.ray_job/auth_token"): f"{tmp}/local_token"}
    return cfg


def _stop_by_pid_file(path: str, timeout: float = 60) -> None:
    try:
        pid = int(open(path).read())
    except (OSError, ValueError):
        return
    if "ray start" not in open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode():
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.5)
    try:
        os.killpg(pid, signal.SIGKILL)  # its own session (setsid): this head's stragglers only
    except ProcessLookupError:
        pass


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_ray_up_brings_the_head_up_over_ssh(loopback_sshd):
    import ray.util

    name = f"rjtest{secrets.token_hex(3)}"
    base = free_port_block(200)
    cfg = _loopback_config(loopback_sshd, name, base)
    state = f"{loopback_sshd['dir']}/state"
    path = f"{loopback_sshd['dir']}/cluster.yaml"
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    home_files = [os.path.expanduser(f"~/ray_bootstrap_{n}") for n in ("config.yaml", "key.pem")]
    ours = [p for p in home_files if not os.path.exists(p)]  # remove afterwards only if we made them
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    started = time.monotonic()
    try:
        up = subprocess.run([RAY_CLI, "up", "-y", "--no-config-cache", "--disable-usage-stats",
                             "--log-style", "record", path], cwd=ROOT, env=env, timeout=420,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        log = open(f"{state}/ray.log").read() if os.path.exists(f"{state}/ray.log") else ""
        assert up.returncode == 0, up.stdout[-5000:] + "\n--- ray.log ---\n" + log[-3000:]
        print(f"\nray up: head running after {time.monotonic() - started:.1f} s")

        # Code and token arrived; the token file is private.
        assert os.path.exists(f"{loopback_sshd['dir']}/code/ray_job/cluster/node.py")
        assert not os.path.exists(f"{loopback_sshd['dir']}/code/.venv")
        assert oct(os.stat(f"{state}/auth_token").st_mode & 0o777) == "0o600"
        # The job server on the head's address, with this cluster's token only.
        address = f"http://{ray.util.get_node_ip_address()}:{base + 1}"
        client = {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": f"{state}/auth_token"}
        job = subprocess.run([RAY_CLI, "job", "submit", "--address", address, "--", sys.executable,
                              "-c", "import ray; ray.init(); print('CPUS', ray.cluster_resources()['CPU'])"],
                             env=client, timeout=180, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        assert job.returncode == 0 and f"CPUS {float(os.cpu_count())}" in job.stdout, job.stdout[-3000:]
        refused = subprocess.run([RAY_CLI, "job", "list", "--address", address],
                                 env={**env, "HOME": loopback_sshd["dir"]}, timeout=60,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert refused.returncode != 0
    finally:
        _stop_by_pid_file(f"{state}/ray.pid")
        for p in ours + [f"/tmp/ray/cluster-{name}.state", f"/tmp/ray/cluster-{name}.lock"]:
            if os.path.exists(p):
                os.remove(p)
        sha = lambda text: hashlib.sha256(text.encode()).hexdigest()[:10]  # noqa: E731
        control = f"/tmp/ray_ssh_{sha(getpass.getuser())}"  # ray up's ssh ControlPath folder
        shutil.rmtree(f"{control}/{sha(name)}", ignore_errors=True)
        if os.path.isdir(control) and not os.listdir(control):
            os.rmdir(control)
