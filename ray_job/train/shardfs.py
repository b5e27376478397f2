"""Torch Distributed Checkpoint (DCP) files on a `Location`: a local folder or s3:// through the
project's pyarrow filesystem, so a sharded checkpoint goes wherever the run's other files go.

DCP's own FileSystemWriter/Reader take a local path (or fsspec); here its `FileSystemBase` is
implemented over pyarrow instead, and every rank's writer still opens only its own files
(`__<rank>_<n>.distcp`; rank 0 also `.metadata`). Each file is counted and hashed (SHA-256) on its
way out, so a rank knows what it wrote without reading it back: the figures of its manifest entries.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterator
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystemBase

from ..storage import Location, faults

WRITE_BUFFER = 8 * 2**20  # bytes handed to the store at a time


class _Hashed:
    """A write-only stream that counts and hashes what passes through to `sink`. DCP asks its
    position (`tell`) for each item's offset; closing it closes the sink once (an S3 upload ends)."""

    def __init__(self, sink: Any, on_close):
        self.sink, self.on_close, self.bytes, self.sha256, self.closed = sink, on_close, 0, hashlib.sha256(), False

    def write(self, data: Any) -> int:
        self.sink.write(data)
        view = memoryview(data)
        self.sha256.update(view)
        self.bytes += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self.bytes

    def flush(self) -> None:
        self.sink.flush()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sink.close()
            self.on_close(self)


class LocationFS(FileSystemBase):
    """DCP's filesystem calls on `root.fs`; `written` holds (bytes, SHA-256) of every file this
    process wrote, by fs path (renames followed: DCP writes `.metadata.tmp`, then renames it)."""

    def __init__(self, root: Location):
        self.root = root
        self.written: dict[str, dict] = {}
        self._lock = threading.Lock()  # DCP may write with several threads

    def _at(self, path: Any) -> Location:
        return self.root.at_path(str(path))

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        where = self._at(path)
        if "w" not in mode:
            with faults("read", where), self.root.fs.open_input_file(where.path) as f:
                yield f
            return

        def record(stream: _Hashed) -> None:
            with self._lock:
                self.written[where.path] = dict(bytes=stream.bytes, sha256=stream.sha256.hexdigest())

        with faults("write", where):
            stream = _Hashed(self.root.fs.open_output_stream(where.path, compression=None,
                                                             buffer_size=WRITE_BUFFER), record)
            try:
                yield stream
            finally:
                stream.close()

    def concat_path(self, path: Any, suffix: str) -> str:
        return self._at(path).join(suffix).path

    def init_path(self, path: Any) -> str:
        return str(path)

    def rename(self, path: Any, new_path: Any) -> None:
        with faults("rename", self._at(path)):
            self.root.fs.move(str(path), str(new_path))
        with self._lock:
            if str(path) in self.written:
                self.written[str(new_path)] = self.written.pop(str(path))

    def mkdir(self, path: Any) -> None:
        self._at(path).makedirs()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def exists(self, path: Any) -> bool:
        return self._at(path).exists()

    def rm_file(self, path: Any) -> None:
        self._at(path).delete()


class LocationWriter(FileSystemWriter):
    """DCP's FileSystemWriter into the folder `root` (one file per rank). No fsync: the streams are
    pyarrow's (an S3 upload has no file descriptor); the sizes are checked after the write instead."""

    def __init__(self, root: Location):
        super().__init__(root.path, single_file_per_rank=True, sync_files=False)
        self.fs = LocationFS(root)
        self.path = root.path


class LocationReader(FileSystemReader):
    """DCP's FileSystemReader from the folder `root`: each file opened for random access."""

    def __init__(self, root: Location):
        super().__init__(root.path)
        self.fs = LocationFS(root)
        self.path = root.path
