"""How one image file becomes what the model sees, for the test split of an image folder and for
`predict` alike: decoded to RGB, then taken as it is at S x S, or its short side resized to S / 0.875
and center-cropped to S (EVAL_RESIZE)."""

from __future__ import annotations

import io

import numpy as np

EVAL_RESIZE = 0.875  # test images: resize the short side to S / 0.875, then center-crop S


def decode(data: bytes, size: int, train: bool = False):
    """An encoded image as an RGB PIL image; a JPEG decoded at the smallest 1/2^k scale that still
    leaves `size` pixels (4x that for training's random resized crops)."""
    from PIL import Image

    im = Image.open(io.BytesIO(data))
    im.draft("RGB", (size * 4, size * 4) if train else (size, size))
    return im.convert("RGB")


def test_view(im, size: int) -> np.ndarray:
    """A PIL image as the test split holds it: uint8 (size, size, 3)."""
    im = im.convert("RGB")
    if im.size != (size, size):
        from torchvision import transforms as T

        im = T.Compose([T.Resize(round(size / EVAL_RESIZE)), T.CenterCrop(size)])(im)
    return np.asarray(im)
