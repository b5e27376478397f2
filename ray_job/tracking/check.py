"""The driver's preflight for --mlflow: the URI decided, the store reached and the experiment there,
in seconds and before any worker starts. A store that cannot be reached or that refuses the
credentials is one `error:` line (UsageError, exit 2): a typo must not cost an allocation."""

from __future__ import annotations

import re
import time

from ..config import TrainConfig
from ..core.errors import UsageError
from .settings import QUICK, Settings, apply_credentials, client_defaults, http_settings, resolve_uri

UNREACHABLE = ("Connection refused", "NewConnectionError", "timed out", "Name or service not known",
               "Temporary failure in name resolution", "No route to host", "Max retries exceeded",
               "RemoteDisconnected", "Connection reset")


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
    """A client of the store, in any process of ours (the driver, a Tune trial's actor): the
    settings' credentials set as MLflow reads them."""
    apply_credentials(settings.credentials)
    client_defaults()
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=settings.uri, registry_uri=settings.uri)


def problem(settings: Settings, error: Exception, waited_s: float) -> str:
    """What went wrong, in one line without credentials, and what to do."""
    text = scrub(" ".join(str(error).split()), settings)
    refused = re.search(r"\b(401|403)\b|UNAUTHENTICATED|PERMISSION_DENIED|Unauthorized|Forbidden", text)
    if refused:
        what = f"HTTP {refused[1]}" if refused[1] else refused[0]
        return (f"the MLflow tracking server at {settings.uri} refused the credentials ({what}); "
                f"set MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN")
    if any(s in text for s in UNREACHABLE):
        return (f"cannot reach the MLflow tracking server at {settings.uri} ({reason(text)}, "
                f"{waited_s:.1f} s); check --mlflow-uri / MLFLOW_TRACKING_URI and that the server runs")
    return f"MLflow at {settings.uri}: {short(text)}; check --mlflow-uri / MLFLOW_TRACKING_URI"


def reason(text: str) -> str:
    for s in UNREACHABLE:
        if s in text and s not in ("NewConnectionError", "Max retries exceeded"):
            return s.lower()
    return "no connection"


def short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def scrub(text: str, settings: Settings) -> str:
    for value in settings.credentials.values():
        if len(value) >= 4:
            text = text.replace(value, "***")
    return text
