"""The private Ray APIs this project uses, behind one door.

Each is named in SYMBOLS with what it is for. They were written against Ray WRITTEN_FOR; another
Ray logs one warning at first use, and a symbol that moved raises PrivateAPIMoved naming it
(tests/test_raypriv.py resolves every one, so an upgrade fails there, loudly, in one place).
Public replacements are used wherever Ray 2.60 has one.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

WRITTEN_FOR = "2.60."
SYMBOLS = {
    # the readiness poll: one light GCS call per second (ray.nodes() needs a driver connected per
    # poll; ray.util.state and `ray list nodes` need the dashboard, which comes up after the GCS)
    "gcs_client": ("ray._raylet", "GcsClient"),
    "gcs_node_info": ("ray.core.generated.gcs_pb2", "GcsNodeInfo"),
    # the driver tells "the workers did not fit for --resource-wait-s" from other controller errors
    "worker_group_startup_timeout": ("ray.train.v2._internal.exceptions", "WorkerGroupStartupTimeoutError"),
    # the module whose logger prints every report's metrics dict from every rank (quieted)
    "train_context_module": ("ray.train.v2._internal.execution.context", None),
    # the ports a local ray.init() gives its components unless told otherwise (ours must differ)
    "ray_constants": ("ray._private.ray_constants", None),
    # the actor Ray Train's controller asks for its workers' resources (started early: see below)
    "autoscaling_coordinator": ("ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator",
                                "get_or_create_autoscaling_coordinator"),
    # Ray Train's callback that starts an actor to hand out Ray Datasets' shards (our runs pass
    # none: trainer_class leaves it out)
    "datasets_callback": ("ray.train.v2._internal.callbacks.datasets", "DatasetsCallback"),
    # tests only: Ray's own validation of cluster.yaml, as `ray up` runs it
    "cluster_config_prepare": ("ray.autoscaler._private.util", "prepare_config"),
    "cluster_config_validate": ("ray.autoscaler._private.util", "validate_config"),
}

log = logging.getLogger("ray_job.raypriv")
_warned = False


class PrivateAPIMoved(ImportError):
    """A private Ray symbol this project uses is not where it was in Ray WRITTEN_FOR."""


def get(key: str) -> Any:
    """The symbol (or module, when its name is None) registered under `key`."""
    global _warned
    module_name, name = SYMBOLS[key]
    import ray

    if not _warned and not ray.__version__.startswith(WRITTEN_FOR):
        log.warning("ray %s: ray_job's private Ray APIs were written for Ray %sx; see "
                    "ray_job/cluster/raypriv.py if something below fails", ray.__version__, WRITTEN_FOR)
        _warned = True
    try:
        module = importlib.import_module(module_name)
        return module if name is None else getattr(module, name)
    except (ImportError, AttributeError) as e:
        where = module_name + ("" if name is None else f".{name}")
        raise PrivateAPIMoved(f"ray {ray.__version__} has no {where} ({key}: written for Ray "
                              f"{WRITTEN_FOR}x): {e}") from None


def alive_nodes(address: str, timeout_s: float) -> list[tuple[str, float]]:
    """(node name, GPUs) of every alive node of the cluster whose GCS is at HOST:PORT."""
    client = get("gcs_client")(address=address)
    alive = get("gcs_node_info").ALIVE
    infos = client.get_all_node_info(timeout=timeout_s).values()
    return [(i.node_name, i.resources_total.get("GPU", 0)) for i in infos if i.state == alive]


def is_worker_group_startup_timeout(error: BaseException) -> bool:
    return isinstance(error, get("worker_group_startup_timeout"))


def train_context_logger_name() -> str:
    """Ray names that module's logger by its file path."""
    return get("train_context_module").__file__


def start_autoscaling_coordinator() -> None:
    """Starts Ray's autoscaling coordinator (a detached actor, one per cluster), without waiting.
    Ray Train's controller asks it for the workers' resources as it starts and waits at most 5 s
    for the answer; on a cluster where it does not run yet, the ask creates it, and its process
    takes longer than that to start: every run on a fresh cluster (a local one, each SLURM job)
    lost 5 s there and printed a traceback ("Failed to send resource request"). Started as the
    driver connects, it is up by the time the controller asks."""
    get("autoscaling_coordinator")()


def trainer_class():
    """TorchTrainer, less one actor per worker-group start. Ray Train 2.60 starts a DatasetManager
    actor (a process of its own importing Ray Data) every time a worker group starts, Ray Datasets
    passed or not; our workers read through `prepare_data_loader` and pass none. Without it a run,
    a resume and each elastic resize start one process fewer (on 2 CPU cores a 2-worker run
    started ~3 s sooner and used ~6.6 CPU-seconds less). A Ray whose trainer no longer adds that
    callback is left as it is (tests/test_cluster_facts.py checks that it still does)."""
    from ray.train.torch import TorchTrainer

    datasets_callback = get("datasets_callback")

    class Trainer(TorchTrainer):
        def _create_default_callbacks(self):
            callbacks = super()._create_default_callbacks()
            return callbacks if self.datasets else [c for c in callbacks
                                                     if not isinstance(c, datasets_callback)]

    return Trainer


def default_ports() -> set[int]:
    """The fixed ports of a local `ray.init()`: the GCS, the dashboard, the dashboard agent's HTTP
    (52365 in Ray 2.60). A dashboard port we choose must not be one of them: Ray refuses to start
    when two of its components would share a port."""
    c = get("ray_constants")
    return {c.DEFAULT_PORT, c.DEFAULT_DASHBOARD_PORT, c.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT}
