"""`export`: a run's checkpoint as a self-contained model folder.

    model.pt2    torch.export program: uint8 (N, 3, S, S) RGB -> float logits (N, classes); N is
                 dynamic, the normalisation of training (data/augment.py) is inside
    labels.json  the class names in output order
    model.json   the model, its arguments, the image size, the run, the checkpoint, its test accuracy

Loading needs torch alone: `torch.export.load("model.pt2").module()(images)`.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch
from torch import nn

from .. import storage
from ..core.errors import UsageError
from ..core.jsonio import dumps
from ..data.augment import CIFAR10_MEAN, CIFAR10_STD
from ..model.zoo import model_args
from ..storage import Location, StorageError
from ..train.checkpoint import CHECKPOINT_FILE
from ..train.checkpointer import saved_checkpoints
from ..train.runfiles import SUMMARY_JSON
from ..train.trained import TrainedModel, trained_model
from .options import ExportOptions

MODEL_FILE, LABELS_FILE, META_FILE = "model.pt2", "labels.json", "model.json"
FORMAT = "ray_job.export/1"


class Normalised(nn.Module):
    """The trained model behind training's normalisation (DeviceAugment's, the same operations):
    uint8 NCHW in, logits out."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1) * 255)
        self.register_buffer("std", torch.tensor(CIFAR10_STD).view(1, 3, 1, 1) * 255)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model((images.float() - self.mean) / self.std)


@dataclass(frozen=True)
class Exported:
    """An export in memory: the program's bytes, the labels and model.json's fields."""

    program: bytes
    labels: tuple[str, ...]
    meta: dict


def pick_checkpoint(run: Location, which: str) -> Location:
    """The run's checkpoint folder: best, latest, or one by name (`run` may be a checkpoint folder
    itself); UsageError saying what exists."""
    if run.join(CHECKPOINT_FILE).exists():
        return run
    names = saved_checkpoints(run) if run.is_dir() else []
    if not names:
        raise UsageError(f"no checkpoint_* folder in {run.uri}. HINT: give a run folder, "
                         f"<storage-path>/<name>, of a run that saved a checkpoint")
    if which == "latest":
        return run.join(max(names))
    if which != "best":
        if which not in names:
            raise UsageError(f"no checkpoint {which!r} in {run.uri}; it has {', '.join(sorted(names))}")
        return run.join(which)
    try:
        best = storage.read_json(run.join(SUMMARY_JSON)).get("best_checkpoint")
    except FileNotFoundError:
        best = None
    if not best:
        raise UsageError(f"{run.uri} has no best checkpoint in its {SUMMARY_JSON} (a run still going, or "
                         f"stopped early). HINT: --checkpoint latest, or one of {', '.join(sorted(names))}")
    return run.join(storage.at(best, near=run).name)  # the run folder as given (it may have moved)


def export_program(trained: TrainedModel) -> bytes:
    """The torch.export program of `trained` behind its normalisation, batch size dynamic."""
    size = trained.cfg.image_size
    example = torch.zeros(2, 3, size, size, dtype=torch.uint8)
    program = torch.export.export(Normalised(trained.model).eval(), (example,),
                                  dynamic_shapes=({0: torch.export.Dim("batch", min=1)},))
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


def export_run(run: Location, which: str) -> Exported:
    """The export of the run's checkpoint `which` (best, latest or a name)."""
    checkpoint = pick_checkpoint(run, which)
    trained = trained_model(checkpoint, near=run)
    cfg = trained.cfg
    meta = dict(format=FORMAT, model=cfg.model,
                arguments={**model_args(cfg), **({"stem": cfg.stem_in_use} if cfg.stem_in_use != "none" else {})},
                image_size=trained.cfg.image_size, classes=len(trained.classes),
                input="uint8 RGB (N, 3, image_size, image_size), any N; normalised inside",
                output="logits (N, classes), in labels.json's order",
                normalisation=dict(mean=[m * 255 for m in CIFAR10_MEAN], std=[s * 255 for s in CIFAR10_STD]),
                run=named(checkpoint.parent()), checkpoint=named(checkpoint), epoch=trained.epoch,
                test_acc=trained.metrics.get("test_acc"), data=trained.cfg.data,
                torch=torch.__version__.split("+")[0])
    return Exported(export_program(trained), trained.classes, meta)


def named(where: Location) -> str:
    """A local folder's absolute path, or its URI."""
    return where.path if where.is_local else where.uri


def writable_folder(out: Location, overwrite: bool) -> None:
    """Refuses an --out that holds files (unless --overwrite) or is a file: nothing is written."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out.uri} is a file; give a folder")
    if out.exists() and out.files() and not overwrite:
        raise UsageError(f"--out {out.uri} is not empty; give another folder, or --overwrite to replace "
                         f"its {MODEL_FILE}, {LABELS_FILE} and {META_FILE}")


def write_export(exported: Exported, out: Location) -> None:
    """The three files into `out`, model.json last (a folder with it is complete)."""
    out.makedirs()
    out.join(MODEL_FILE).write_bytes(exported.program)
    out.join(LABELS_FILE).write_text(dumps(list(exported.labels), indent=1))
    out.join(META_FILE).write_text(dumps(exported.meta, indent=2, sort_keys=True))


def main(opts: ExportOptions) -> int:
    try:
        run, out = storage.at(opts.run), storage.at(opts.out)
        writable_folder(out, opts.overwrite)
        exported = export_run(run, opts.checkpoint)
        write_export(exported, out)
    except StorageError as e:
        raise UsageError(str(e)) from None
    meta = exported.meta
    acc = meta["test_acc"]
    print(f"exported {meta['checkpoint']} (epoch {meta['epoch']}, test accuracy "
          f"{'-' if acc is None else f'{acc:.4f}'}): {meta['model']}, {meta['classes']} classes, "
          f"uint8 (N, 3, {meta['image_size']}, {meta['image_size']}) -> logits")
    print(f"model: {out.uri} ({MODEL_FILE}, {LABELS_FILE}, {META_FILE}); load it with "
          f"torch.export.load('{MODEL_FILE}').module()")
    return 0
