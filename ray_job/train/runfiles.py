"""What a run folder holds (`<storage-path>/<name>/`): the names of its files and of the events in
events.jsonl. Every module that writes or reads them uses these names."""

METRICS_JSONL = "metrics.jsonl"   # one EpochMetrics per line
METRICS_CSV = "metrics.csv"       # the same rows
EVENTS_JSONL = "events.jsonl"     # one event per line: {"event": NAME, "time": ..., ...}
TOPOLOGY_JSON = "topology.json"   # world size, nodes, backend, master, every worker
SUMMARY_JSON = "summary.json"     # the driver's account of the run (finished, best, checkpoints)
CONFIG_JSON = "config.json"       # the resolved config
TENSORBOARD = "tensorboard"       # TensorBoard's event files
STOP_FILE = ".preempt"            # a stop request (see stop.py)
MLFLOW_JSON = "mlflow.json"       # the run's MLflow run id and where it is tracked (train/tracked.py)
LEASE_FILE = ".lease.json"        # the one writer of this folder (see ray_job/storage/lease.py)
CHECKPOINT_PREFIX = "checkpoint_"  # Ray's checkpoint folders: checkpoint_<date and time>


class Event:
    """Names of the events in events.jsonl."""

    EPOCH_START = "epoch_start"                # epoch, step (where it starts)
    FIRST_STEP = "first_step"                  # time the first step of this start finished
    FIRST_STEP_MEMORY = "first_step_memory"    # rank 0's peak, after, activations and model-state bytes
    RESUMED = "resumed"                        # epoch, step of the checkpoint resumed from, world_size
    WORLD_SIZE_CHANGED = "world_size_changed"  # before, after, the batch rule's figures
    CHECKPOINT_SAVED = "checkpoint_saved"      # checkpoint (folder name), epoch, step, bytes, upload_s, cpu_s
    CHECKPOINT_FAILED = "checkpoint_failed"    # epoch, step, error
    CHECKPOINT_SKIPPED = "checkpoint_skipped"  # a damaged checkpoint passed over at resume: folder, why
