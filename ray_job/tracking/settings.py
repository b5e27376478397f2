"""Where a run is tracked and with which credentials: decided once, on the driver.

The URI: --mlflow-uri, else $MLFLOW_TRACKING_URI, else the local default `sqlite:///<storage-path>/
mlflow.db` (artifacts beside it in `mlartifacts/`; no server). Credentials follow MLflow's own
conventions (MLFLOW_TRACKING_USERNAME/PASSWORD, MLFLOW_TRACKING_TOKEN, ~/.mlflow/credentials); a
`user:password@` inside $MLFLOW_TRACKING_URI is moved into those variables. The config, config.json,
every printed line and MLflow's own params hold the bare URI only.

The driver's preflight (`check`): the store reached and the experiment there, in seconds and before
any worker starts. A store that cannot be reached or that refuses the credentials is one `error:` line
(UsageError, exit 2): a typo must not cost an allocation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import time
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
UNREACHABLE = ("Connection refused", "NewConnectionError", "timed out", "Name or service not known",
               "Temporary failure in name resolution", "No route to host", "Max retries exceeded",
               "RemoteDisconnected", "Connection reset")


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


@contextlib.contextmanager
def http_settings(values: Mapping[str, str]) -> Iterator[None]:
    """MLflow's HTTP settings (read at each request) set to `values` for the block, except those
    the user set."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items() if k not in USER_HTTP})
    try:
        yield
    finally:
        set_env(saved)


def set_env(values: Mapping[str, Optional[str]]) -> None:
    """Sets these environment variables of this process; None unsets one."""
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def check(cfg: TrainConfig) -> TrainConfig:
    """The config with its tracking URI decided (bare), after one round trip to the store that
    finds or creates the experiment. Without --mlflow: the config as it is, and MLflow not imported."""
    if not cfg.mlflow:
        return cfg
    cfg = resolve_uri(cfg)
    settings = Settings.of(cfg)
    make_client(settings)  # imports MLflow (seconds on a busy machine): not the store's time
    started = time.monotonic()
    with http_settings(QUICK):
        try:
            experiment_id(settings)
        except UsageError:
            raise
        except Exception as e:  # MlflowException, OSError, SQLAlchemy's errors: one line
            raise UsageError(problem(settings, e, time.monotonic() - started)) from None
    return cfg


def experiment_id(settings: Settings) -> str:
    """The experiment's id, created (with the local default's artifact folder) when missing."""
    client = make_client(settings)
    exp = client.get_experiment_by_name(settings.experiment)
    if exp is None:
        return client.create_experiment(settings.experiment, artifact_location=settings.artifact_location)
    if exp.lifecycle_stage == "deleted":
        raise UsageError(f"the MLflow experiment {settings.experiment!r} at {settings.uri} is deleted; "
                         f"restore it (`mlflow experiments restore`) or give another --mlflow-experiment")
    return exp.experiment_id


def make_client(settings: Settings):
    """A client of the store, in any process of ours (the driver, a Tune trial's actor, Ray Train's
    controller): exactly the settings' credentials set as MLflow reads them (not the env's), and before
    MLflow is imported (the user's own settings win): no usage telemetry, HTTP calls that give up in seconds."""
    set_env({k: settings.credentials.get(k) for k in CREDENTIAL_VARS})
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.update({k: v for k, v in PATIENT.items() if k not in USER_HTTP})
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=settings.uri, registry_uri=settings.uri)


def problem(settings: Settings, error: Exception, waited_s: float) -> str:
    """What went wrong, in one line without credentials, and what to do."""
    text = " ".join(str(error).split())
    for value in settings.credentials.values():  # never a credential in the line
        if len(value) >= 4:
            text = text.replace(value, "***")
    refused = re.search(r"\b(401|403)\b|UNAUTHENTICATED|PERMISSION_DENIED|Unauthorized|Forbidden", text)
    if refused:
        what = f"HTTP {refused[1]}" if refused[1] else refused[0]
        return (f"the MLflow tracking server at {settings.uri} refused the credentials ({what}); "
                f"set MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN")
    if any(s in text for s in UNREACHABLE):
        why = next((s.lower() for s in UNREACHABLE
                    if s in text and s not in ("NewConnectionError", "Max retries exceeded")), "no connection")
        return (f"cannot reach the MLflow tracking server at {settings.uri} ({why}, "
                f"{waited_s:.1f} s); check --mlflow-uri / MLFLOW_TRACKING_URI and that the server runs")
    text = text if len(text) <= 200 else text[:200] + "..."
    return f"MLflow at {settings.uri}: {text}; check --mlflow-uri / MLFLOW_TRACKING_URI"

