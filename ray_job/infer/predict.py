"""`predict`: every image of a folder classified with Ray Data. The driver lists the files (local or
s3://) and hands their paths to `map_batches` over an actor pool: each actor holds one copy of the
exported model (on a GPU when the cluster has them), reads, decodes and resizes its batch
(data/views.py, as the test split was), and returns the top classes. The driver shows progress,
writes the CSV (one row per image, sorted by path) and prints images/s and, with one subfolder per
class, the accuracy."""

from __future__ import annotations

import csv
import io
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from .. import storage
from ..core.errors import UsageError
from ..core.jsonio import loads
from ..data.prepared.format import IMAGE_EXTENSIONS
from ..storage import Location, StorageError
from .export import LABELS_FILE, META_FILE, MODEL_FILE, Exported, export_run
from .options import PredictOptions

TOP = 5


@dataclass(frozen=True)
class Images:
    """The image files under `root` (paths relative to it), and each one's class index when the
    folder has one subfolder per class named as the model's labels."""

    root: Location
    paths: list[str]
    truth: Optional[dict[str, int]]


def load_model(where: Location, checkpoint: str) -> Exported:
    """An export folder as it is, or a run folder's checkpoint exported in memory."""
    if where.join(MODEL_FILE).exists():
        labels = loads(where.join(LABELS_FILE).read_text())
        return Exported(where.join(MODEL_FILE).read_bytes(), tuple(labels), loads(where.join(META_FILE).read_text()))
    if not where.exists():
        raise UsageError(f"no model at {where.uri}. HINT: give a folder written by `python -m ray_job export`, "
                         f"or a run folder <storage-path>/<name>")
    print(f"predict: {where.uri} has no {MODEL_FILE}: exporting its {checkpoint} checkpoint first", flush=True)
    return export_run(where, checkpoint)


def list_images(root: Location, labels: tuple[str, ...]) -> Images:
    """Every image file below `root` (hidden files and folders left out); UsageError if none."""
    if not root.is_dir():
        raise UsageError(f"--images {root.uri} is not a folder")
    sep = os.sep if root.is_local else "/"
    paths = [p for p in root.files() if p.lower().endswith(IMAGE_EXTENSIONS)
             and not any(part.startswith(".") for part in p.split(sep))]
    if not paths:
        raise UsageError(f"no images under --images {root.uri} (looked for {', '.join(IMAGE_EXTENSIONS)})")
    index = {name: i for i, name in enumerate(labels)}
    parts = [p.split(sep) for p in paths]
    by_class = all(len(x) == 2 and x[0] in index for x in parts)
    return Images(root, paths, {p: index[x[0]] for p, x in zip(paths, parts)} if by_class else None)


class Classifier:
    """One Ray Data actor: the exported program, once, on this actor's device."""

    def __init__(self, program: list, root: Location, size: int, top: int, threads: int):
        import ray
        import torch

        if not torch.cuda.is_available():
            torch.set_num_threads(threads)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = torch.export.load(io.BytesIO(ray.get(program[0]))).module().to(self.device)
        self.root, self.size, self.top = root, size, top

    def __call__(self, batch: dict) -> dict:
        import torch

        from ..data.views import decode, test_view

        images = np.stack([test_view(decode(self.root.join(p).read_bytes(), self.size), self.size)
                           for p in batch["path"]])
        x = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous().to(self.device)
        with torch.no_grad():
            probs = torch.softmax(self.model(x).float(), dim=1)
        p, i = probs.topk(self.top, dim=1)
        return {"path": batch["path"], "top_index": i.cpu().numpy(), "top_prob": p.cpu().numpy()}


def classify(opts: PredictOptions, exported: Exported, images: Images) -> tuple[list[dict], float]:
    """Every image's row (unsorted), and the seconds from the start of the dataset to the last row."""
    import ray

    from ..config import TrainConfig
    from ..train.trainer import connect

    connect(TrainConfig(address=opts.address or None))  # as `train`: --address, $RAY_ADDRESS, or local
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # ours counts images; Ray Data's counts blocks per operator
    gpus = int(ray.cluster_resources().get("GPU", 0))
    actors = opts.actors or max(gpus, 1)
    top = min(TOP, len(exported.labels))
    print(f"predict: {len(images.paths)} images, {actors} actor(s) on {'GPUs' if gpus else 'CPUs'}, "
          f"batch {opts.batch_size}, model {exported.meta.get('model')} at {exported.meta['image_size']} px",
          flush=True)
    ds = ray.data.from_items([{"path": p} for p in images.paths]).map_batches(
        Classifier, batch_size=opts.batch_size, compute=ray.data.ActorPoolStrategy(size=actors),
        num_cpus=opts.cpus_per_actor, num_gpus=1 if gpus else None, batch_format="numpy",
        fn_constructor_kwargs=dict(program=[ray.put(exported.program)], root=images.root,
                                   size=exported.meta["image_size"], top=top,
                                   threads=max(1, int(opts.cpus_per_actor))))
    rows, started = [], time.monotonic()
    with progress(len(images.paths)) as bar:
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
            for path, idx, prob in zip(batch["path"], batch["top_index"], batch["top_prob"]):
                rows.append(dict(path=str(path), top=[(exported.labels[int(i)], float(q)) for i, q in zip(idx, prob)]))
            bar.update(len(batch["path"]))
    return rows, time.monotonic() - started


def progress(total: int) -> Any:
    """A live bar with images/s on a terminal; a line every 10% of the images in a log."""
    from tqdm import tqdm

    live = sys.stderr.isatty()
    return tqdm(total=total, unit="img", desc="predict", disable=None if live else False, file=sys.stderr,
                mininterval=0.5 if live else 10, miniters=None if live else max(1, total // 10))


def csv_text(rows: list[dict], top: int) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    header = ["path", "predicted", "probability"]
    writer.writerow(header + [f"{what}_{k}" for k in range(1, top + 1) for what in ("class", "prob")])
    for row in sorted(rows, key=lambda r: r["path"]):
        (best, p) = row["top"][0]
        writer.writerow([row["path"], best, f"{p:.6f}"] + [v for c, q in row["top"] for v in (c, f"{q:.6f}")])
    return out.getvalue()


def accuracy(rows: list[dict], images: Images, labels: tuple[str, ...]) -> Optional[float]:
    if images.truth is None:
        return None
    return sum(r["top"][0][0] == labels[images.truth[r["path"]]] for r in rows) / len(rows)


def main(opts: PredictOptions) -> int:
    try:
        out = storage.at(opts.out)
        if out.exists() and not opts.overwrite:
            raise UsageError(f"--out {out.uri} exists; give another file, or --overwrite to replace it")
        exported = load_model(storage.at(opts.model), opts.checkpoint)
        images = list_images(storage.at(opts.images), exported.labels)
        rows, seconds = classify(opts, exported, images)
        out.write_text(csv_text(rows, min(TOP, len(exported.labels))))
    except StorageError as e:
        raise UsageError(str(e)) from None
    print(f"predict: {len(rows)} images in {seconds:.1f} s: {len(rows) / max(seconds, 1e-9):.1f} images/s "
          f"(the actors' start and model load included)")
    acc = accuracy(rows, images, exported.labels)
    if acc is not None:
        print(f"accuracy: {acc:.4f} ({len(rows)} images in {len(set(images.truth.values()))} class folders)")
    print(f"predictions: {out.uri}")
    return 0
