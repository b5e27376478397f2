"""`python -m ray_job prepare-data`: CIFAR-10 or an image folder into a prepared folder, or
CIFAR-10's download alone."""

from __future__ import annotations

import os
import time

from ...core.errors import UsageError
from ..errors import DataError
from .format import DEFAULT_SHARD_MB, describe
from .sources import cifar10_source, imagefolder_source
from .write import ensure_prepared


PREPARE_DESCRIPTION = """\
Turn CIFAR-10 or a folder of images into a prepared dataset (Arrow IPC shards + manifest.json)
that `train --data prepared --data-dir OUT` memory-maps. Without --from: download CIFAR-10's
cifar-10-batches-py into --data-dir (for `train --data cifar10`).

examples:
  python -m ray_job prepare-data --data-dir ./data                      # download CIFAR-10
  python -m ray_job prepare-data --from cifar10 --src ./data --out ./cifar10-prepared
  python -m ray_job prepare-data --from imagefolder --src ./my_images --out ./prepared
"""


def main(argv: list[str]) -> int:
    import argparse

    from ...core.flags import ArgumentParser, Formatter
    from ...core.paths import resolve_path
    from ..cifar10 import ensure_cifar10

    parser = ArgumentParser(prog="python -m ray_job prepare-data", formatter_class=Formatter,
                            description=PREPARE_DESCRIPTION)
    parser.add_argument("--from", dest="source", choices=("cifar10", "imagefolder"), default=None,
                        help="what to convert: cifar10 (cifar-10-batches-py under --src, downloaded "
                        "if missing) or imagefolder (SRC/train/<class>/*, SRC/test/<class>/*)")
    parser.add_argument("--src", default=None, help="the source folder (with --from)")
    parser.add_argument("--out", default=None, help="the prepared folder to write (with --from)")
    parser.add_argument("--layout", choices=("auto", "raw", "encoded"), default="auto",
                        help="imagefolder: raw uint8 when all images share a size (auto), or keep "
                        "each file's encoded bytes (encoded: smaller, decoded in the loader)")
    parser.add_argument("--shard-mb", type=float, default=DEFAULT_SHARD_MB,
                        help="size of each Arrow file in MiB")
    parser.add_argument("--data-dir", default="./data",
                        help="without --from: where CIFAR-10 is downloaded")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="progress bar while converting")
    ns = parser.parse_args(argv)
    if ns.source is None:
        if ns.src or ns.out:
            raise UsageError("--src and --out go with --from cifar10|imagefolder")
        ensure_cifar10(resolve_path(ns.data_dir), download=True)
        print(f"CIFAR-10 is ready under {ns.data_dir}")
        return 0
    if not ns.src or not ns.out:
        raise UsageError(f"--from {ns.source} needs --src DIR and --out DIR")
    if ns.shard_mb <= 0:
        raise UsageError("--shard-mb must be positive")
    src, out = resolve_path(ns.src), resolve_path(ns.out)
    if not os.path.isdir(src):
        raise DataError(f"--src {ns.src} is not a folder")
    if os.path.abspath(out) == os.path.abspath(src) or os.path.abspath(src).startswith(out + os.sep):
        raise DataError("--out must not be --src or a folder above it")
    if ns.source == "cifar10":
        ensure_cifar10(src, download=True)
        source = cifar10_source(src)
    else:
        source = imagefolder_source(src, ns.layout)
    started = time.perf_counter()
    manifest, written = ensure_prepared(source, out, ns.shard_mb, ns.progress)
    if written:
        print(f"wrote {ns.out} from {ns.src} in {time.perf_counter() - started:.1f} s: "
              f"{describe(manifest)}")
    else:
        print(f"{ns.out} is already prepared from {ns.src} (the manifest matches the source); "
              f"nothing to do: {describe(manifest)}")
    print(f"train with: python -m ray_job train --data prepared --data-dir {ns.out}")
    return 0
