"""User paths: the one place a path becomes absolute, and URIs (s3://...) that never do."""

from __future__ import annotations

import os
from typing import Optional


def is_uri(path: str) -> bool:
    """s3://bucket/key and other pyarrow.fs URIs: never resolved against a local directory."""
    return "://" in path


def resolve_path(path: str, cwd: Optional[str] = None) -> str:
    """The one place a path given by the user becomes absolute ('' and URIs stay as they are)."""
    if not path or is_uri(path):
        return path
    path = os.path.expanduser(path)
    return os.path.normpath(os.path.join(cwd or os.getcwd(), path))


def join_path(base: str, *parts: str) -> str:
    """os.path.join for local paths, '/'-join for URIs."""
    if is_uri(base):
        return "/".join([base.rstrip("/"), *parts])
    return os.path.join(base, *parts)


def split_userinfo(uri: str) -> tuple[str, str, str]:
    """(`uri` without its `user:password@`, the user, the password): credentials in a URL must
    never be printed or saved, only handed to the client that needs them."""
    from urllib.parse import unquote, urlsplit, urlunsplit

    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri, "", ""
    userinfo, host = parts.netloc.rsplit("@", 1)
    user, _, password = userinfo.partition(":")
    return urlunsplit(parts._replace(netloc=host)), unquote(user), unquote(password)
