"""Shared fixtures: a real in-process Ray cluster, tiny configs, and a CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Small enough for 2 CPU cores: resnet18 with the ImageNet stem trains at ~300 img/s there.
TINY = ["--data", "synthetic", "--model", "resnet18", "--stem", "imagenet",
        "--synthetic-train-size", "512", "--synthetic-test-size", "256", "--batch-size", "64",
        "--log-every", "4"]


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

    ray.init(address="local", num_cpus=2, include_dashboard=True)
    yield ray
    ray.shutdown()
