"""Storage failures as one line each: StorageError, the useful part of a pyarrow/AWS error, and
retrying for a while (a short outage of the object store or the shared file system), also inside the
filesystem given to Ray (RunConfig.storage_filesystem) on object storage."""

from __future__ import annotations

import contextlib
import io
import logging
import re
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pyarrow
import pyarrow.fs as pafs

log = logging.getLogger("ray_job.storage")
T = TypeVar("T")


class StorageError(OSError):
    """A storage operation failed (unreachable, refused, disk full): one line, no credentials."""


def reason(e: BaseException) -> str:
    """The useful part of a pyarrow/AWS error, on one line."""
    text = " ".join(str(e).split())
    text = re.sub(r"\s*\(Request ID: [^)]*\)", "", text)
    text = text.split("; Details:")[0]
    m = re.search(r"AWS Error (\w+) during (\w+) operation: ?(.*)", text)
    if m:
        detail = m[3].strip() if m[3].strip() not in ("", "No response body.") else ""
        text = f"{m[1]} on {m[2]}" + (f": {detail}" if detail else "")
    return text[:240]


@contextlib.contextmanager
def faults(action: str, loc: Any) -> Iterator[None]:
    """Turns a filesystem failure into one StorageError line (FileNotFoundError passes through)."""
    try:
        yield
    except (FileNotFoundError, StorageError):
        raise
    except (OSError, pyarrow.ArrowException) as e:
        raise StorageError(f"cannot {action} {loc.uri}: {reason(e)}") from None


def retrying(fn: Callable[[], T], wait_s: float, what: str = "") -> T:
    """fn(), tried again (every 2 s) on StorageError until `wait_s` seconds have passed (0: once)."""
    deadline = time.monotonic() + wait_s
    announced = False
    while True:
        try:
            return fn()
        except StorageError as e:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            if not announced and what:
                log.warning("storage: %s failed (%s); trying again for up to %.0f s", what, e, left)
                announced = True
            time.sleep(min(2.0, left))


def for_ray(root: Any, wait_s: float) -> Any:
    """On object storage, every call of Ray's controller retried for up to `wait_s` seconds, so a
    short outage does not end the run with a controller error."""
    if root.is_local:
        return root.fs
    return pafs.PyFileSystem(RetryingHandler(root.fs, wait_s))


def unwrap(fs: Any) -> Any:
    """The filesystem under `for_ray`'s retries (rank 0's own files keep their own policy)."""
    handler = getattr(fs, "handler", None)
    return handler.fs if isinstance(handler, RetryingHandler) else fs


class RetryingHandler(pafs.FileSystemHandler):
    """A pyarrow filesystem that retries the calls of another one on I/O errors (not on "not
    found"). Writes are buffered and written whole when closed, so a write is retried as a whole:
    meant for Ray's small files (snapshot, markers), not for checkpoints."""

    def __init__(self, fs: Any, wait_s: float):
        self.fs, self.wait_s = fs, wait_s

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RetryingHandler) and self.fs.equals(other.fs)

    def __hash__(self) -> int:
        return hash(self.fs.type_name)

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        def once() -> T:
            try:
                return fn()
            except (FileNotFoundError, StorageError):
                raise
            except OSError as e:
                raise StorageError(f"{what}: {reason(e)}") from None
        return retrying(once, self.wait_s, what)

    def get_type_name(self) -> str:
        return "retrying+" + self.fs.type_name

    def normalize_path(self, path: str) -> str:
        return self.fs.normalize_path(path)

    def get_file_info(self, paths: list) -> list:
        return self._retry(f"look at {paths}", lambda: self.fs.get_file_info(paths))

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list:
        return self._retry(f"list {selector.base_dir}", lambda: self.fs.get_file_info(selector))

    def create_dir(self, path: str, recursive: bool) -> None:
        self._retry(f"create {path}", lambda: self.fs.create_dir(path, recursive=recursive))

    def delete_dir(self, path: str) -> None:
        self._retry(f"delete {path}", lambda: self.fs.delete_dir(path))

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self._retry(f"empty {path}",
                    lambda: self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok))

    def delete_root_dir_contents(self) -> None:
        raise OSError("refusing to empty the root of the storage")

    def delete_file(self, path: str) -> None:
        self._retry(f"delete {path}", lambda: self.fs.delete_file(path))

    def move(self, src: str, dest: str) -> None:
        self._retry(f"move {src}", lambda: self.fs.move(src, dest))

    def copy_file(self, src: str, dest: str) -> None:
        self._retry(f"copy {src}", lambda: self.fs.copy_file(src, dest))

    def open_input_stream(self, path: str) -> Any:
        return self._retry(f"read {path}", lambda: self.fs.open_input_stream(path))

    def open_input_file(self, path: str) -> Any:
        return self._retry(f"read {path}", lambda: self.fs.open_input_file(path))

    def open_output_stream(self, path: str, metadata: Any) -> Any:
        return pyarrow.PythonFile(_WholeWrite(self, path), mode="w")

    def open_append_stream(self, path: str, metadata: Any) -> Any:
        raise OSError(f"cannot append to {path} on object storage")


class _WholeWrite(io.RawIOBase):
    """Collects what is written; on close writes it as one object, retried as a whole."""

    def __init__(self, handler: RetryingHandler, path: str):
        self.handler, self.path, self.buffer = handler, path, io.BytesIO()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return self.buffer.write(data)

    def close(self) -> None:
        if self.closed:
            return
        data = self.buffer.getvalue()
        super().close()

        def put() -> None:
            with self.handler.fs.open_output_stream(self.path) as f:
                f.write(data)
        self.handler._retry(f"write {self.path}", put)
