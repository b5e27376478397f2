"""The commands, the top layer: `python -m ray_job COMMAND ...` dispatches here, and the SLURM
script's plan (slurm_plan.py) parses any command's flags."""

from __future__ import annotations

import logging
import sys

from ..core.errors import UsageError

USAGE = """usage: python -m ray_job COMMAND [flags]

commands:
  train         train a ResNet on CIFAR-10 with Ray Train (local cluster, --address, or SLURM)
  tune          search hyperparameters: Ray Tune trials, each a `train` run
  prepare-data  download CIFAR-10 (--data-dir), or convert CIFAR-10 / an image folder into a
                prepared dataset (--from cifar10|imagefolder --src DIR --out DIR)
  scale         scaling: `scale sweep` runs the trainer for several --workers counts and reports
                speedup and efficiency
  export        a run's checkpoint as a self-contained model (torch.export, labels, model.json)
  predict       classify a folder of images with Ray Data (an export or a run's checkpoint)
  bench         measurements: bench step | data-path | vs-ddp | race | checkpoints | tracking

`python -m ray_job COMMAND --help` lists a command's flags with their defaults."""


def run(command: str, rest: list[str]) -> int:
    if command == "train":
        from ..config import parse_train_args

        cfg = parse_train_args(rest)  # the flags alone are checked before torch and Ray are imported
        from ..train.driver import run_training

        return run_training(cfg)
    if command == "tune":
        from ..tune import main as tune_main

        return tune_main(rest)
    if command == "prepare-data":
        from ..data.prepared.cli import main as prepare_main

        return prepare_main(rest)
    if command == "export":
        from ..infer import export_main

        return export_main(rest)
    if command == "predict":
        from ..infer import predict_main

        return predict_main(rest)
    if command == "bench":
        from ..bench import main as bench_main

        return bench_main(rest)
    if command == "scale":
        from ..scale import main as scale_main

        return scale_main(rest)
    raise UsageError(f"unknown command {command!r}; use one of train, tune, prepare-data, scale, export, "
                     f"predict, bench")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [driver] %(message)s", datefmt="%H:%M:%S")
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    try:
        return run(argv[0], argv[1:])
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
