"""Strict JSON for every file the project writes: NaN/Infinity become null when writing, and are
refused when reading."""

from __future__ import annotations

import json
import math
from typing import Any


def finite(obj: Any) -> Any:
    """`obj` with every NaN/Infinity replaced by None, so it can be written as strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, **kw: Any) -> str:
    """Strict JSON (no NaN/Infinity: they become null), readable by any JSON parser."""
    return json.dumps(finite(obj), allow_nan=False, default=str, **kw)


def _no_constants(name: str) -> Any:
    raise ValueError(f"not strict JSON: {name}")


def loads(text: str) -> Any:
    """Parses strict JSON only: a NaN/Infinity in the file is an error, not a float."""
    return json.loads(text, parse_constant=_no_constants)
