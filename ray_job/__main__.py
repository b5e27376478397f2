"""python -m ray_job {train,prepare-data,bench,scale} ... : a thin dispatcher.

    python -m ray_job train --data synthetic --num-workers 2 --epochs 2
"""

from __future__ import annotations

import logging
import sys

from .config import UsageError

USAGE = """usage: python -m ray_job COMMAND [flags]

commands:
  train         train a ResNet on CIFAR-10 with Ray Train (local cluster, --address, or SLURM)
  prepare-data  download CIFAR-10 (--data-dir), or convert CIFAR-10 / an image folder into a
                prepared dataset (--from cifar10|imagefolder --src DIR --out DIR)
  bench         images/s of the seed's pipeline vs this project's step, with and without Ray
  scale         run the trainer for several --workers counts and report speedup and efficiency

`python -m ray_job COMMAND --help` lists a command's flags with their defaults."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [driver] %(message)s",
                        datefmt="%H:%M:%S")
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    try:
        if command == "train":
            from .cli import parse_train_args
            from .launch import run_training

            return run_training(parse_train_args(rest))
        if command == "prepare-data":
            from .prepared import main as prepare_main

            return prepare_main(rest)
        if command == "bench":
            from .bench import main as bench_main

            return bench_main(rest)
        if command == "scale":
            from .scale import main as scale_main

            return scale_main(rest)
        raise UsageError(f"unknown command {command!r}; use one of train, prepare-data, bench, scale")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
