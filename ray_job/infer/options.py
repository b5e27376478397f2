"""The flags of `export` and `predict` (dataclasses: one flag per field), parsed and checked without
Ray or torch, so that bad input fails in a second (and `slurm_plan` can check a job's flags)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.errors import UsageError
from ..core.flags import ArgumentParser, Formatter, add_dataclass_args, option

CHECKPOINT_HELP = ("which checkpoint of the run: best (summary.json's best_checkpoint), latest, or the "
                   "name of a checkpoint_* folder of the run")


@dataclass(frozen=True)
class ExportOptions:
    """Writes a run's checkpoint as a self-contained model: model.pt2 (a torch.export program taking
    uint8 NCHW RGB images at the run's image size, any batch size, normalisation inside, returning
    logits), labels.json (the class names in output order) and model.json (what it is and where it
    comes from). Loading it needs torch alone: torch.export.load("model.pt2").module()."""

    run: str = option("", "the run folder (<storage-path>/<name>, local or s3://)")
    out: str = option("", "the folder to write model.pt2, labels.json and model.json into (local or s3://)")
    checkpoint: str = option("best", CHECKPOINT_HELP)
    overwrite: bool = option(False, "replace the files of an --out folder that is not empty (otherwise: "
                                    "refused, nothing written)")


@dataclass(frozen=True)
class PredictOptions:
    """Classifies every image of a folder (any sizes: resized as the test split was) with Ray Data,
    one model copy per actor, GPUs when the cluster has them; writes one CSV row per image (path,
    predicted class, its probability, the top 5), prints images/s, and the accuracy when the folder
    has one subfolder per class."""

    model: str = option("", "an `export` folder (model.pt2, labels.json, model.json), or a run folder "
                            "(its --checkpoint is exported in memory first); local or s3://")
    images: str = option("", "the folder of images to classify, searched recursively (local or s3://); "
                             "with one subfolder per class named as the model's labels, accuracy is printed")
    out: str = option("predictions.csv", "the CSV to write: one row per image (local or s3://)")
    checkpoint: str = option("best", CHECKPOINT_HELP + " (when MODEL is a run folder)")
    actors: int = option(0, "model copies (Ray Data actors) classifying in parallel (default: one per GPU "
                            "of the cluster, or 1 without GPUs)")
    batch_size: int = option(64, "images per batch handed to one actor")
    cpus_per_actor: float = option(1.0, "CPUs each actor reserves (and its torch threads, on CPUs)")
    address: str = option("", "the Ray cluster to join (default: $RAY_ADDRESS, else a local cluster "
                              "started for the command, as `train` does)")
    overwrite: bool = option(False, "replace an existing --out (otherwise: refused, nothing written)")


def build_parser(cls: type, prog: str, positional: str) -> ArgumentParser:
    parser = ArgumentParser(prog=f"python -m ray_job {prog}", formatter_class=Formatter,
                            description=(cls.__doc__ or "").strip() or None)
    parser.add_argument(positional, metavar=positional.upper(),
                        help=dataclasses.fields(cls)[0].metadata["help"])
    add_dataclass_args(parser, cls, skip=(positional,))
    return parser


def build_export_parser() -> ArgumentParser:
    return build_parser(ExportOptions, "export", "run")


def build_predict_parser() -> ArgumentParser:
    return build_parser(PredictOptions, "predict", "model")


def parse_export_args(argv: Sequence[str]) -> ExportOptions:
    opts = ExportOptions(**vars(build_export_parser().parse_args(list(argv))))
    if not opts.out:
        raise UsageError("export needs --out DIR: the folder to write the model into")
    return opts


def parse_predict_args(argv: Sequence[str]) -> PredictOptions:
    opts = PredictOptions(**vars(build_predict_parser().parse_args(list(argv))))
    if not opts.images:
        raise UsageError("predict needs --images DIR: the folder of images to classify")
    if not opts.out:
        raise UsageError("predict needs --out FILE: the CSV to write")
    if opts.actors < 0 or opts.batch_size <= 0 or opts.cpus_per_actor <= 0:
        raise UsageError("--actors must not be negative; --batch-size and --cpus-per-actor must be positive")
    return opts
