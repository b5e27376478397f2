"""Ray's environment for every process of a job we start (SLURM, cluster.yaml, local clusters,
the tests' heads), and the job's auth token.

Token authentication: Ray 2.60 turns it on only when a token already exists, so every cluster we
start sets RAY_AUTH_MODE=token explicitly, with a fresh token per cluster in a file of mode 0600
(RAY_AUTH_TOKEN_PATH); ~/.ray/auth_token plays no part.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping

# No usage-stats upload; no 30 s drain on shutdown (nothing runs on a node once the driver is gone);
# no PreemptionWatcher actor (it only logs a harmless error line where nodes are not drained); no
# idle Python workers started ahead for the first driver (Ray's head start for a driver's first
# tasks: a run's actors never used them; two on a 2-CPU node, ~0.8 CPU-seconds each, started as the
# run's own processes start and ended unused).
DEFAULTS = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_prestart_worker_first_driver": "0",
}
# glibc's malloc in the processes of a run (the training workers): Ray Train runs the training loop
# in a thread of the worker, not in its main thread, so the loop's memory comes from a thread
# arena, and glibc unmaps a thread arena's heap as soon as it is empty, whatever the trim
# threshold (malloc/arena.c, heap_trim): each step's activations and gradients were handed back
# to the kernel at its end and page-faulted in again by the next (thousands of faults per step on
# CPU; `bench vs-ddp` counts them). A top pad of one heap (64 MiB) keeps them; setting it turns off
# glibc's dynamic mmap threshold, so that is fixed at its dynamic ceiling (32 MiB).
WORKER_MALLOC = {"MALLOC_TOP_PAD_": str(64 << 20), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}


def defaults(env: Mapping[str, str]) -> dict[str, str]:
    """The defaults that `env` does not set already (a user's own value wins)."""
    return {k: v for k, v in DEFAULTS.items() if k not in env}


def worker_malloc(env: Mapping[str, str]) -> dict[str, str]:
    """WORKER_MALLOC where `env` sets neither variable (a user's own malloc settings win)."""
    return {} if any(k in env for k in WORKER_MALLOC) else dict(WORKER_MALLOC)


def apply_defaults(env=None) -> None:
    env = os.environ if env is None else env
    for k, v in defaults(env).items():
        env[k] = v


def auth_env(token_path: str) -> dict[str, str]:
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path}


def write_token(path: str) -> str:
    """A fresh token in a new file only its owner can read; refuses to overwrite one."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def write_access_files(folder: str, token_path: str, head_ip: str, dashboard_port: int, gcs: str) -> list[str]:
    """What a client needs to reach a SLURM job's cluster (dashboard login, `ray job submit`), in a
    folder on the shared file system: a copy of the token (0600) and cluster.env to `source`. The
    paths written (the job removes them when it ends)."""
    token_copy, env_file = os.path.join(folder, "auth_token"), os.path.join(folder, "cluster.env")
    with open(token_path) as f:
        token = f.read()
    fd = os.open(token_copy, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    exports = {"RAY_ADDRESS": f"http://{head_ip}:{dashboard_port}", **auth_env(token_copy)}
    with open(env_file, "w") as f:
        f.write("".join(f"export {k}={v}\n" for k, v in exports.items()))
        f.write(f"# GCS address (python -m ray_job train --address): {gcs}\n")
    return [token_copy, env_file]
