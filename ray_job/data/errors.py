"""The data layer's error: missing or unreadable data, with what to do about it."""

from __future__ import annotations

from ..core.errors import UsageError


class DataError(UsageError):
    """Data that is missing or unreadable; the message says how to fix it."""
