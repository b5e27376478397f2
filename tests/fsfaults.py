"""pyarrow filesystems with faults, for checkpoint tests without a server: a local folder whose
reads are slow (an object store under load), whose writes lose their end (a cut-off upload) or fail
midway (a full disk), or that records the order in which files are written.
Being `PyFileSystem`s, not `LocalFileSystem`s, they take Ray's remote-checkpoint code paths."""

from __future__ import annotations

import errno
import os
import time

import pyarrow
import pyarrow.fs as pafs

CHUNK = 1 << 20


class LocalFaults(pafs.FileSystemHandler):
    """LocalFileSystem, but each read of up to CHUNK bytes first sleeps `read_delay_s`, each CHUNK
    written takes `write_delay_s`, each file written loses its last `drop_bytes` bytes, and a write
    past `full_after` bytes of a file fails as on a full disk. `opened`: the files written, in order."""

    def __init__(self, read_delay_s: float = 0.0, drop_bytes: int = 0, write_delay_s: float = 0.0,
                 full_after: int = 0):
        self.fs, self.read_delay_s, self.drop_bytes = pafs.LocalFileSystem(), read_delay_s, drop_bytes
        self.write_delay_s, self.full_after, self.opened = write_delay_s, full_after, []

    def __eq__(self, other):
        return isinstance(other, LocalFaults)

    def __ne__(self, other):
        return not self == other

    def get_type_name(self):
        return "local-with-faults"

    def normalize_path(self, path):
        return path

    def get_file_info(self, paths):
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.fs.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.fs.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.fs.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise OSError("not here")

    def delete_file(self, path):
        self.fs.delete_file(path)

    def move(self, src, dest):
        self.fs.move(src, dest)

    def copy_file(self, src, dest):
        self.fs.copy_file(src, dest)

    def open_input_stream(self, path):
        return pyarrow.PythonFile(_SlowReader(self.fs, path, self.read_delay_s), mode="r")

    def open_input_file(self, path):
        return self.open_input_stream(path)

    def open_output_stream(self, path, metadata):
        self.opened.append(path)
        return pyarrow.PythonFile(_ShortWriter(path, self.drop_bytes, self.write_delay_s, self.full_after),
                                  mode="w")

    def open_append_stream(self, path, metadata):
        raise OSError("no appends")


class _SlowReader:
    def __init__(self, fs, path, delay_s):
        self.f, self.delay_s, self.closed = fs.open_input_stream(path), delay_s, False

    def read(self, n=-1):
        time.sleep(self.delay_s)
        return self.f.read(CHUNK if n is None or n < 0 else min(n, CHUNK))

    def readable(self):
        return True

    def close(self):
        self.f.close()
        self.closed = True


class _ShortWriter:
    def __init__(self, path, drop_bytes, delay_s=0.0, full_after=0):
        self.path, self.drop_bytes, self.delay_s, self.parts, self.closed = path, drop_bytes, delay_s, [], False
        self.full_after, self.written = full_after, 0

    def write(self, data):
        time.sleep(self.delay_s * len(data) / CHUNK)
        self.written += len(data)
        if self.full_after and self.written > self.full_after:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.parts.append(bytes(data))
        return len(data)

    def writable(self):
        return True

    def flush(self):
        pass

    def close(self):
        if not self.closed:
            data = b"".join(self.parts)
            with open(self.path, "wb") as f:
                f.write(data[:max(0, len(data) - self.drop_bytes)])
            self.closed = True


def slow(read_delay_s: float) -> pafs.PyFileSystem:
    return pafs.PyFileSystem(LocalFaults(read_delay_s=read_delay_s))


def short_writes(drop_bytes: int) -> pafs.PyFileSystem:
    return pafs.PyFileSystem(LocalFaults(drop_bytes=drop_bytes))


def slow_writes(write_delay_s: float) -> pafs.PyFileSystem:
    return pafs.PyFileSystem(LocalFaults(write_delay_s=write_delay_s))


def full_after(nbytes: int) -> pafs.PyFileSystem:
    return pafs.PyFileSystem(LocalFaults(full_after=nbytes))


def write_order() -> pafs.PyFileSystem:
    """A local folder that records the files written (`.handler.opened`)."""
    return pafs.PyFileSystem(LocalFaults())


# --- processes for the shared-download test (spawned: top-level functions) ---

def watch_ray_download(checkpoint, got_it, done, results) -> None:
    """Opens the checkpoint with Ray's as_directory() and watches its file's size until the
    other process has opened it too: the smallest size seen, and the size it had at first."""
    with checkpoint.as_directory() as d:
        path = os.path.join(d, "checkpoint.pt")
        first = os.path.getsize(path)
        got_it.set()
        smallest, deadline = first, time.monotonic() + 30
        while not done.is_set() and time.monotonic() < deadline:
            smallest = min(smallest, os.path.getsize(path))
            time.sleep(0.005)
        results.put((first, smallest))


def open_after(checkpoint, got_it, done) -> None:
    got_it.wait(60)
    with checkpoint.as_directory():
        pass
    done.set()


def load_ours(location, results) -> None:
    from ray_job.train.checkpoint import load_checkpoint

    results.put(load_checkpoint(location)["epoch"])
