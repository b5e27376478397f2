"""Strict JSON files on any storage (local folder or object store), replaced as a whole."""

from __future__ import annotations

from typing import Any

from ..core.jsonio import dumps, loads
from .location import Where, at


def read_json(path: Where) -> Any:
    return loads(at(path).read_text())


def read_jsonl(path: Where) -> list[dict]:
    try:
        text = at(path).read_text()
    except FileNotFoundError:
        return []
    return [loads(line) for line in text.splitlines() if line.strip()]


def write_json(path: Where, obj: Any) -> None:
    """Strict JSON, replacing the file as a whole (local folder or object store)."""
    at(path).write_text(dumps(obj, indent=2, sort_keys=True))
