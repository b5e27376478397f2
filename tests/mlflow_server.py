"""A real MLflow tracking server for the tests: `mlflow server` with a SQLite backend, proxied
artifacts and MLflow's basic-auth app (so that credentials travel the way a site's server needs
them), on loopback, stopped by its PID. And `Gate`, a loopback TCP relay in front of it that a test
closes and opens again: the server becomes unreachable (connection refused) and comes back at once,
without the minute a restart of `mlflow server` takes on a busy machine.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from base64 import b64encode
from dataclasses import dataclass, field
from typing import Optional

from processes import stop_session

MLFLOW = os.path.join(os.path.dirname(sys.executable), "mlflow")
ADMIN = "admin"


def missing_requirement() -> Optional[str]:
    if not os.access(MLFLOW, os.X_OK):
        return f"no `mlflow` at {MLFLOW} (pip install -r requirements-dev.txt: mlflow[auth])"
    return None


def free_port(k: int = 0) -> int:
    """A free port above the ephemeral range (nothing else grabs it meanwhile)."""
    from ray_job.cluster.ports import free_block

    return free_block(1, 61000, 65535, slot=os.getpid() * 3 + 11 + k)


@dataclass
class MlflowServer:
    root: str                      # backend DB, artifacts, auth DB and config, log
    port: int = field(default_factory=free_port)
    password: str = field(default_factory=lambda: secrets.token_hex(12), repr=False)
    proc: Optional[subprocess.Popen] = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, uri: Optional[str] = None, **overrides: str) -> dict:
        """What a user of this server sets: the URI and the admin's credentials (MLflow's names)."""
        return {**dict(MLFLOW_TRACKING_URI=uri or self.uri, MLFLOW_TRACKING_USERNAME=ADMIN,
                       MLFLOW_TRACKING_PASSWORD=self.password, MLFLOW_DISABLE_TELEMETRY="true"), **overrides}

    @property
    def reader_uri(self) -> str:
        """For the tests' own MlflowClient: the credentials in the URL (requests sends them), so
        the test process's environment -- which Ray heads started later inherit -- holds none."""
        return f"http://{ADMIN}:{self.password}@127.0.0.1:{self.port}"

    def _auth_config(self) -> str:
        path = os.path.join(self.root, "auth.ini")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"[mlflow]\ndefault_permission = READ\ndatabase_uri = sqlite:///{self.root}/auth.db\n"
                    f"admin_username = {ADMIN}\nadmin_password = {self.password}\n"
                    f"authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
        return path

    def start(self, timeout: float = 240) -> MlflowServer:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        env.update(MLFLOW_AUTH_CONFIG_PATH=self._auth_config(), MLFLOW_DISABLE_TELEMETRY="true",
                   MLFLOW_FLASK_SERVER_SECRET_KEY=secrets.token_hex(16),
                   # no background job runner (GenAI jobs): a process less, and no temp dir in /dev/shm
                   MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        cmd = [MLFLOW, "server", "--app-name", "basic-auth", "--workers", "1",
               "--backend-store-uri", f"sqlite:///{self.root}/mlflow.db",
               "--artifacts-destination", f"{self.root}/art", "--host", "127.0.0.1", "--port", str(self.port)]
        with open(os.path.join(self.root, "server.log"), "a") as log:
            self.proc = subprocess.Popen(cmd, cwd=self.root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.answers():
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer in {timeout:.0f} s:\n{self.log_tail()}")

    def answers(self) -> bool:
        """Ready = an authenticated API call succeeds (the auth app has made its admin)."""
        token = b64encode(f"{ADMIN}:{self.password}".encode()).decode()
        req = urllib.request.Request(f"{self.uri}/api/2.0/mlflow/experiments/search?max_results=1",
                                     headers={"Authorization": f"Basic {token}"})
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def stop(self, timeout: float = 30) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_session(proc, timeout)

    def client(self):
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.reader_uri)

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(os.path.join(self.root, "server.log"), errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


class Gate:
    """127.0.0.1:<port> relayed to `target_port`; `close()` refuses new connections and cuts the
    open ones (the server is gone for its clients), `open()` lets them through again."""

    def __init__(self, target_port: int):
        self.target, self.port = target_port, free_port(1)
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.listener: Optional[socket.socket] = None
        self.open()

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def open(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def close(self) -> None:
        listener, self.listener = self.listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes its accept() (Linux)
            except OSError:
                pass
            listener.close()
        with self.lock:
            conns, self.conns = self.conns, []
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
