"""What is prepared: CIFAR-10's batches or a folder of images, with a fingerprint of its files and
the geometry (raw uint8 when every image has one size, encoded bytes otherwise)."""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

from ..errors import DataError
from .format import IMAGE_EXTENSIONS, SPLITS


@dataclass
class Source:
    """What is to be prepared: per split, either raw arrays or a list of image files."""

    kind: str                   # cifar10 | imagefolder
    path: str
    classes: tuple
    fingerprint: str            # names and sizes of the source files
    files: dict                 # split -> [(path, label)] (imagefolder)
    geometry: Optional[dict] = None   # {"layout": "raw", "height", "width", "channels"} or encoded


def _fingerprint(entries: list) -> str:
    return hashlib.sha1(json.dumps(entries).encode()).hexdigest()


def cifar10_source(src: str) -> Source:
    from ..cifar10 import CIFAR10_CLASSES, CIFAR10_FOLDER, CIFAR10_TEST_FILES, CIFAR10_TRAIN_FILES

    folder = os.path.join(src, CIFAR10_FOLDER)
    names = CIFAR10_TRAIN_FILES + CIFAR10_TEST_FILES
    entries = [(n, os.path.getsize(os.path.join(folder, n))) for n in names]
    return Source("cifar10", src, CIFAR10_CLASSES, _fingerprint(entries), {},
                  dict(layout="raw", height=32, width=32, channels=3))


def imagefolder_source(src: str, layout: str = "auto") -> Source:
    """DIR/{train,test}/<class>/<image>: classes from train/, test classes must be among them."""
    splits, classes = {}, None
    for split in SPLITS:
        root = os.path.join(src, split)
        if not os.path.isdir(root):
            raise DataError(f"{src} needs {split}/<class>/<images> (e.g. {root}/cat/0001.jpg); "
                            f"{root} is missing")
        found = sorted(d.name for d in os.scandir(root) if d.is_dir())
        if classes is None:
            classes = tuple(found)
            if not classes:
                raise DataError(f"no class folders under {root}: put images in {root}/<class>/")
        elif set(found) - set(classes):
            raise DataError(f"{root} has classes that train/ lacks: {sorted(set(found) - set(classes))}")
        items = []
        for label, name in enumerate(classes):
            d = os.path.join(root, name)
            if os.path.isdir(d):
                items += [(os.path.join(d, f), label) for f in sorted(os.listdir(d))
                          if f.lower().endswith(IMAGE_EXTENSIONS)]
        if not items:
            raise DataError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {root}/<class>/")
        splits[split] = items
    entries = [(os.path.relpath(p, src), os.path.getsize(p), label)
               for split in SPLITS for p, label in splits[split]]
    source = Source("imagefolder", src, classes, _fingerprint(entries + [layout]), splits)
    source.geometry = decide_geometry(source, layout) if layout != "auto" else None
    return source


def _image_size(path: str) -> tuple:
    from PIL import Image

    try:
        with Image.open(path) as im:  # reads the header only
            return im.size
    except OSError as e:
        raise DataError(f"cannot read image {path} ({e}); delete or replace it") from None


def decide_geometry(source: Source, layout: str = "auto") -> dict:
    """raw when every image has one size (CIFAR-like uint8), else encoded bytes; `layout` encoded
    keeps the files' bytes even when they share a size (smaller files, decoded in the loader)."""
    if layout == "encoded":
        return dict(layout="encoded")
    paths = [p for split in SPLITS for p, _ in source.files[split]]
    with ThreadPoolExecutor(max_workers=8) as pool:
        sizes = set(pool.map(_image_size, paths, chunksize=64))
    if len(sizes) == 1:
        (w, h), = sizes
        return dict(layout="raw", height=h, width=w, channels=3)
    if layout == "raw":
        raise DataError(f"--layout raw needs images of one size; {source.path} has {len(sizes)} "
                        f"sizes (e.g. {sorted(sizes)[:3]}): use --layout auto or encoded")
    return dict(layout="encoded")
