"""Which reports are epoch results, and how an epoch's figures become MLflow metrics.

Ray Train's reports are not all epoch results (ray_job/train/worker.py also reports a checkpoint's
upload, with the metrics it was saved with, and timed/stop checkpoints with `{epoch, step, ...}`):
an epoch result carries `train_loss`, and each epoch is logged once, with step = epoch and the
epoch's own end time (so figures logged late, after an outage, sit where they belong).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

EPOCH_KEY = "train_loss"
# counts, times and sizes that are params or tags, not curves
NOT_METRICS = frozenset({"epoch", "epochs", "time", "train_images", "test_images", "grad_bytes"})


def is_epoch(row: dict) -> bool:
    return EPOCH_KEY in row and isinstance(row.get("epoch"), int)


def metric_values(rows: Iterable[dict], after: int = 0) -> list[tuple[str, float, int, int]]:
    """(key, value, timestamp ms, step) for the epochs of `rows` after epoch `after`, each once."""
    out, seen = [], set()
    for row in rows:
        epoch = row.get("epoch")
        if not is_epoch(row) or epoch <= after or epoch in seen:
            continue
        seen.add(epoch)
        stamp = int(float(row.get("time") or 0) * 1000)
        out += [(key, float(value), stamp, epoch) for key, value in sorted(row.items())
                if key not in NOT_METRICS and isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value)]
    return out
