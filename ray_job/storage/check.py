"""The driver's check before anything starts: the storage takes a write, or one line says why
(endpoint unreachable, credentials refused, bucket missing, no write permission), in seconds.

    python -m ray_job.storage check s3://bucket/prefix
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import time
from typing import Any

import pyarrow
import pyarrow.fs as pafs

from .faults import StorageError, reason
from .location import Location, S3Settings, _safe, _scheme, at, check_uri, filesystem, fs_path


def check_writable(where: str) -> Location:
    """Fails in seconds, with one StorageError line saying what to fix, unless this storage takes a write."""
    local = "://" not in where
    if not local and _scheme(where) in ("s3", "s3a"):
        check_uri(where)
        _check_s3(where)
        return at(where)
    loc = at(where)
    probe = loc.join(f".write_test_{socket.gethostname()}_{os.getpid()}")
    try:
        if local:
            loc.makedirs()
        probe.write_bytes(b"")
        probe.delete()
    except OSError as e:
        name, hint = (where, "; choose a folder you can write to") if local else (_safe(where), "")
        raise StorageError(f"--storage-path {name} is not writable ({reason(e)}){hint}") from None
    return loc


def _check_s3(uri: str) -> None:
    settings = S3Settings.from_env()
    path = fs_path(uri)
    bucket = path.split("/", 1)[0]
    fs = filesystem(uri, checking=True)
    head = f"--storage-path {uri}"
    try:
        kind = fs.get_file_info(bucket).type
    except (OSError, pyarrow.ArrowException) as e:
        raise StorageError(_s3_refusal(head, settings, fs, path, e)) from None
    if kind == pafs.FileType.NotFound:
        try:  # some failures read as "not found" to HEAD: a listing tells them apart
            fs.get_file_info(pafs.FileSelector(f"{bucket}/.rj-probe"))
        except FileNotFoundError:
            pass
        except (OSError, pyarrow.ArrowException) as e:
            if _code(e) != "NO_SUCH_BUCKET":
                raise StorageError(_s3_refusal(head, settings, fs, path, e)) from None
        raise StorageError(f"{head}: bucket {bucket!r} does not exist at {settings.where()}; create "
                           f"it, or fix the bucket name or the endpoint")
    probe = f"{path}/.write_test_{socket.gethostname()}_{os.getpid()}"
    try:
        with fs.open_output_stream(probe) as f:
            f.write(b"")
    except (OSError, pyarrow.ArrowException) as e:
        if _code(e) in ("ACCESS_DENIED", "AccessDenied"):
            raise StorageError(f"{head}: no permission to write there ({reason(e)}) with the "
                               f"credentials from {settings.credentials()}; use credentials that may "
                               f"write to the bucket, or another prefix") from None
        raise StorageError(_s3_refusal(head, settings, fs, path, e)) from None
    with contextlib.suppress(OSError, pyarrow.ArrowException):
        fs.delete_file(probe)


def _code(e: BaseException) -> str:
    m = re.search(r"AWS Error (\w+)", str(e))
    return m[1] if m else ""


UNREACHABLE = ("NETWORK_CONNECTION", "REQUEST_TIMEOUT", "SERVICE_UNAVAILABLE", "INTERNAL_FAILURE")
REFUSED = ("SIGNATURE_DOES_NOT_MATCH", "INVALID_ACCESS_KEY_ID", "EXPIRED_TOKEN",
           "INVALID_CLIENT_TOKEN_ID", "MISSING_AUTHENTICATION_TOKEN", "UNRECOGNIZED_CLIENT")


def _s3_refusal(head: str, settings: S3Settings, fs: Any, path: str, e: BaseException) -> str:
    """The one line for a failed first look at the bucket."""
    code = _code(e)
    if code == "ACCESS_DENIED":  # an answer to HEAD has no body: a listing says why
        try:
            fs.get_file_info(pafs.FileSelector(f"{path}/.rj-probe", allow_not_found=True))
        except (OSError, pyarrow.ArrowException) as listing:
            e, code = listing, _code(listing) or code
    if code in UNREACHABLE:
        return (f"{head}: cannot reach {settings.where()} ({reason(e)}); check the endpoint and "
                f"that the server is up and reachable from here")
    if code in REFUSED:
        return (f"{head}: {settings.where()} refused the credentials from {settings.credentials()} "
                f"({reason(e)}); check the key id and the secret (or the profile)")
    if code == "ACCESS_DENIED":
        return (f"{head}: access denied by {settings.where()} with the credentials from "
                f"{settings.credentials()} ({reason(e)}); check them and the bucket's policy")
    if code == "NO_SUCH_BUCKET":
        return f"{head}: bucket {path.split('/')[0]!r} does not exist at {settings.where()}"
    return f"{head}: {settings.where()} failed ({reason(e)})"


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "check":
        print("usage: python -m ray_job.storage check URI", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        loc = check_writable(argv[1])
    except StorageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{loc.uri}: writable ({time.monotonic() - started:.2f} s)")
    return 0
