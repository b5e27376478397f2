"""Where a run is tracked and with which credentials: decided once, on the driver.

The URI: --mlflow-uri, else $MLFLOW_TRACKING_URI, else the local default `sqlite:///<storage-path>/
mlflow.db` (artifacts beside it in `mlartifacts/`; no server). Credentials follow MLflow's own
conventions (MLFLOW_TRACKING_USERNAME/PASSWORD, MLFLOW_TRACKING_TOKEN, ~/.mlflow/credentials); a
`user:password@` inside $MLFLOW_TRACKING_URI is moved into those variables. The config, config.json,
every printed line and MLflow's own params hold the bare URI only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Optional

from ..config import TrainConfig
from ..core.errors import UsageError
from ..core.paths import is_uri, join_path, split_userinfo

# MLflow reads these in the process that talks to the server (the driver, Ray Train's controller).
CREDENTIAL_VARS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
                   "MLFLOW_TRACKING_INSECURE_TLS", "MLFLOW_TRACKING_CLIENT_CERT_PATH",
                   "MLFLOW_TRACKING_SERVER_CERT_PATH", "MLFLOW_TRACKING_AUTH")
LOCAL_DB, LOCAL_ARTIFACTS = "mlflow.db", "mlartifacts"
# The client's HTTP behaviour: at start a dead server must cost seconds (no retries); during and
# after training a call may wait a little, but never for MLflow's default minutes of retries.
QUICK = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
PATIENT = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
USER_HTTP = frozenset(k for k in QUICK if k in os.environ)  # the user's own settings, left alone


@dataclass(frozen=True)
class Settings:
    """How to reach the tracking store; `credentials` never printed (repr=False) or saved."""

    uri: str                            # bare: no user:password@
    experiment: str
    register: str = ""                  # model registry name, or "" for none
    artifact_location: Optional[str] = None  # for a new experiment in the local default store
    credentials: dict = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, cfg: TrainConfig, env: Optional[Mapping[str, str]] = None) -> Settings:
        """From a config whose mlflow_uri is resolved (see `resolve_uri`) and the environment."""
        env = os.environ if env is None else env
        creds = {k: env[k] for k in CREDENTIAL_VARS if env.get(k)}
        artifacts = None
        if cfg.mlflow_uri == local_default(cfg.storage_path):
            artifacts = join_path(cfg.storage_path, LOCAL_ARTIFACTS)
        return cls(cfg.mlflow_uri, cfg.mlflow_experiment, cfg.mlflow_register, artifacts, creds)


def local_default(storage_path: str) -> str:
    return "sqlite:///" + join_path(storage_path, LOCAL_DB)


def resolve_uri(cfg: TrainConfig, env: Optional[dict] = None) -> TrainConfig:
    """The config with mlflow_uri decided (bare); credentials from a URI in $MLFLOW_TRACKING_URI
    go into MLFLOW_TRACKING_USERNAME/PASSWORD of `env` (default: this process's)."""
    env = os.environ if env is None else env
    uri = cfg.mlflow_uri or env.get("MLFLOW_TRACKING_URI", "")
    if not uri:
        if is_uri(cfg.storage_path):
            raise UsageError(f"--mlflow with --storage-path {cfg.storage_path} needs a tracking server: "
                             f"give --mlflow-uri or set MLFLOW_TRACKING_URI (the local default, "
                             f"sqlite:///<storage-path>/{LOCAL_DB}, needs a local folder)")
        uri = local_default(cfg.storage_path)
    bare, user, password = split_userinfo(uri)
    if user:
        env.setdefault("MLFLOW_TRACKING_USERNAME", user)
        if password:
            env.setdefault("MLFLOW_TRACKING_PASSWORD", password)
    return dataclasses.replace(cfg, mlflow_uri=bare)


def client_defaults() -> None:
    """What every process of ours that talks to MLflow sets before importing it (the user's own
    settings win): no usage telemetry sent out, HTTP calls that give up in seconds."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    for key, value in PATIENT.items():
        if key not in USER_HTTP:
            os.environ[key] = value


@contextlib.contextmanager
def http_settings(values: Mapping[str, str]) -> Iterator[None]:
    """MLflow's HTTP settings (read at each request) set to `values` for the block, except those
    the user set."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items() if k not in USER_HTTP})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def apply_credentials(credentials: Mapping[str, str]) -> None:
    """In the controller's process: exactly the driver's credentials (not what its env holds)."""
    for key in CREDENTIAL_VARS:
        if key in credentials:
            os.environ[key] = credentials[key]
        else:
            os.environ.pop(key, None)
