"""Where a run's files live: a local folder or an object store, behind one pyarrow.fs filesystem.

`--storage-path` is a local path or a URI: `s3://BUCKET/PREFIX` (AWS S3 or any S3-compatible store:
Ceph RGW, MinIO, SeaweedFS) or another URI that `pyarrow.fs` understands (gs://, hdfs://, file://).
Everything the driver and rank 0 write or read there -- config.json, summary.json, metrics, events,
topology, TensorBoard files, checkpoints, the stop request, the scaling outputs -- goes through a
`Location` (a filesystem object and a path on it), never through `open()` on a path that might be a URI.

S3 settings come from the variables the AWS tools use: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and
AWS_SESSION_TOKEN, else AWS_PROFILE (and the rest of the AWS default credential chain);
AWS_REGION / AWS_DEFAULT_REGION; AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL, for S3-compatible
stores. The `S3FileSystem` is built here, not by `FileSystem.from_uri` (which asks AWS for the
bucket's region and fails against other endpoints). Credentials are never written into a message,
a log line, config.json or a URI.

    python -m ray_job.storage check s3://bucket/prefix   # the driver's fail-fast check, alone
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import re
import socket
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional, TypeVar, Union

import pyarrow
import pyarrow.fs as pafs

log = logging.getLogger("ray_job.storage")
T = TypeVar("T")

# Training: a stalled transfer is given up after REQUEST_TIMEOUT_S without progress (not a cap on a
# transfer's length), each request is tried up to ATTEMPTS times.
CONNECT_TIMEOUT_S, REQUEST_TIMEOUT_S, ATTEMPTS = 5.0, 30.0, 4
# The driver's check before anything starts: seconds, not minutes, when the endpoint is dead.
CHECK_CONNECT_TIMEOUT_S, CHECK_REQUEST_TIMEOUT_S, CHECK_ATTEMPTS = 2.0, 5.0, 2
CHUNK = 64 * 2**20  # copy buffer for checkpoint uploads
CREDENTIAL_WORDS = ("secret", "key", "token", "password", "credential")


class StorageError(OSError):
    """A storage operation failed (unreachable, refused, disk full): one line, no credentials."""


# --- S3 settings from the AWS environment -----------------------------------------------------

@dataclass(frozen=True)
class S3Settings:
    """The S3 client settings that the AWS variables give; secrets are kept out of repr()."""

    endpoint: Optional[str]        # host:port of an S3-compatible store; None = AWS
    scheme: str                    # http or https
    region: Optional[str]
    key_id: Optional[str] = dataclasses.field(default=None, repr=False)
    secret: Optional[str] = dataclasses.field(default=None, repr=False)
    token: Optional[str] = dataclasses.field(default=None, repr=False)
    profile: Optional[str] = None
    endpoint_var: Optional[str] = None  # which variable named the endpoint (for messages)

    @classmethod
    def from_env(cls, env: Optional[dict] = None) -> S3Settings:
        env = os.environ if env is None else env
        var = next((v for v in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL") if env.get(v)), None)
        endpoint, scheme = None, "https"
        if var:
            url = env[var] if "://" in env[var] else "https://" + env[var]
            parts = urllib.parse.urlsplit(url)
            endpoint, scheme = parts.netloc, parts.scheme or "https"
            if not endpoint or scheme not in ("http", "https"):
                raise StorageError(f"{var}={env[var]} is not an http(s)://HOST[:PORT] URL")
        key_id, secret = env.get("AWS_ACCESS_KEY_ID") or None, env.get("AWS_SECRET_ACCESS_KEY") or None
        if bool(key_id) != bool(secret):
            raise StorageError("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY must be set together")
        return cls(endpoint=endpoint, scheme=scheme,
                   region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None,
                   key_id=key_id, secret=secret, token=env.get("AWS_SESSION_TOKEN") or None,
                   profile=env.get("AWS_PROFILE") or None, endpoint_var=var)

    def where(self) -> str:
        """The endpoint, as a user would recognise it."""
        if self.endpoint:
            return f"{self.scheme}://{self.endpoint} ({self.endpoint_var})"
        return "AWS S3 (no AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL set)"

    def credentials(self) -> str:
        """Where the credentials come from: the variables' names, never their values."""
        if self.key_id:
            return "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
        if self.profile:
            return f"AWS_PROFILE={self.profile}"
        return "the AWS default chain (no AWS_ACCESS_KEY_ID or AWS_PROFILE set)"


def s3_filesystem(settings: S3Settings, bucket: str, checking: bool = False) -> pafs.S3FileSystem:
    """An S3FileSystem for this endpoint; short timeouts and one retry when `checking`."""
    region = settings.region
    if region is None:
        region = "us-east-1" if settings.endpoint else _aws_region(bucket)
    connect, request, attempts = ((CHECK_CONNECT_TIMEOUT_S, CHECK_REQUEST_TIMEOUT_S, CHECK_ATTEMPTS)
                                  if checking else (CONNECT_TIMEOUT_S, REQUEST_TIMEOUT_S, ATTEMPTS))
    kw: dict[str, Any] = dict(region=region, scheme=settings.scheme, connect_timeout=connect,
                              request_timeout=request,
                              retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=attempts))
    if settings.endpoint:
        kw["endpoint_override"] = settings.endpoint
    if settings.key_id:  # explicit, so that workers on other nodes need no copy of the variables
        kw.update(access_key=settings.key_id, secret_key=settings.secret,
                  session_token=settings.token)
    return pafs.S3FileSystem(**kw)


def _aws_region(bucket: str) -> str:
    try:
        return pafs.resolve_s3_region(bucket)
    except (OSError, pyarrow.ArrowException) as e:
        raise StorageError(f"cannot find the AWS region of bucket {bucket!r} ({reason(e)}); set "
                           f"AWS_REGION, or AWS_ENDPOINT_URL_S3 for an S3-compatible store") from None


# --- locations ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Location:
    """A file or folder: `path` on `fs` (no scheme), and `uri` as the user names it."""

    fs: Any
    path: str
    uri: str

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def join(self, *parts: str) -> Location:
        sep = self._sep
        return Location(self.fs, sep.join([self.path.rstrip(sep), *parts]),
                        sep.join([self.uri.rstrip(sep), *parts]))

    @property
    def name(self) -> str:
        """The last part of the path (a file's or folder's own name)."""
        return self.path.rstrip(self._sep).rsplit(self._sep, 1)[-1]

    def parent(self) -> Location:
        """The folder that holds this file or folder."""
        return Location(self.fs, self.path.rstrip(self._sep).rsplit(self._sep, 1)[0],
                        self.uri.rstrip(self._sep).rsplit(self._sep, 1)[0])

    @property
    def _sep(self) -> str:
        return os.sep if self.is_local else "/"

    def at_path(self, fs_path: str) -> Location:
        """Another path on the same filesystem (e.g. a checkpoint that Ray reports)."""
        if fs_path.startswith(self.path):
            return Location(self.fs, fs_path, self.uri + fs_path[len(self.path):])
        return Location(self.fs, fs_path, fs_path)

    # reading
    def info(self) -> pafs.FileInfo:
        with faults("look at", self):
            return self.fs.get_file_info(self.path)

    def exists(self) -> bool:
        return self.info().type != pafs.FileType.NotFound

    def is_dir(self) -> bool:
        return self.info().type == pafs.FileType.Directory

    def read_bytes(self) -> bytes:
        """The file's bytes; FileNotFoundError when there is none."""
        with faults("read", self):
            with self.fs.open_input_stream(self.path) as f:
                return f.read()

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def files(self) -> list[str]:
        """Paths of every file below this folder, relative to it (recursive)."""
        with faults("list", self):
            infos = self.fs.get_file_info(pafs.FileSelector(self.path, recursive=True,
                                                            allow_not_found=True))
        root = self.path.rstrip("/" if not self.is_local else os.sep)
        return sorted(i.path[len(root) + 1:] for i in infos if i.type == pafs.FileType.File)

    # writing
    def makedirs(self) -> None:
        with faults("create", self):
            self.fs.create_dir(self.path, recursive=True)

    def write_bytes(self, data: bytes) -> None:
        """Replaces the file as a whole: readers see the old or the new content, never a part."""
        with faults("write", self):
            if not self.is_local:  # an object appears only once its upload is complete
                with self.fs.open_output_stream(self.path) as f:
                    f.write(data)
                return
            self.fs.create_dir(os.path.dirname(self.path), recursive=True)
            tmp = f"{self.path}.tmp{os.getpid()}"
            try:
                with self.fs.open_output_stream(tmp) as f:
                    f.write(data)
                self.fs.move(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    self.fs.delete_file(tmp)
                raise

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def append_text(self, text: str) -> None:
        """Object stores cannot append: read, add, write back (for small files only)."""
        try:
            old = self.read_text()
        except FileNotFoundError:
            old = ""
        self.write_text(old + text)

    def delete(self) -> None:
        """Deletes the file or folder; nothing there is fine."""
        kind = self.info().type
        with faults("delete", self):
            if kind == pafs.FileType.Directory:
                self.fs.delete_dir(self.path)
            elif kind == pafs.FileType.File:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.delete_file(self.path)

    def upload_dir(self, local_dir: str) -> None:
        """Copies a local folder here; a failed copy is removed (best effort), never left half."""
        self.upload_files(local_dir, sorted(os.listdir(local_dir)))

    def upload_files(self, local_dir: str, names: list[str]) -> None:
        """Copies these files of a local folder into this folder, one after the other, in order;
        if one fails, the folder is removed (best effort), never left half."""
        try:
            self.fs.create_dir(self.path, recursive=True)
            for name in names:
                # pyarrow's threaded uploads to S3 are unsafe (apache/arrow#32372), as Ray notes
                pafs.copy_files(os.path.join(local_dir, name), self.join(name).path,
                                source_filesystem=pafs.LocalFileSystem(), destination_filesystem=self.fs,
                                chunk_size=CHUNK, use_threads=False)
        except (OSError, pyarrow.ArrowException) as e:
            with contextlib.suppress(OSError):
                self.delete()
            raise StorageError(f"cannot upload to {self.uri}: {reason(e)}") from None

    def move_to(self, dest: Location) -> None:
        """Renames a folder (local) or copies and deletes it (object stores have no rename)."""
        with faults("move", self):
            if self.is_local:
                self.fs.move(self.path, dest.path)
                return
            pafs.copy_files(self.path, dest.path, source_filesystem=self.fs,
                            destination_filesystem=dest.fs, chunk_size=CHUNK, use_threads=False)
            self.fs.delete_dir(self.path)


Where = Union[str, Location]
_FILESYSTEMS: dict = {}  # one filesystem per (scheme, settings) in this process


def at(where: Where, near: Optional[Location] = None) -> Location:
    """The Location of a local path or URI. `near`: a Location whose filesystem serves URIs of the
    same scheme (a worker reuses the run's filesystem for --resume-from s3://...)."""
    if isinstance(where, Location):
        return where
    if "://" not in where:
        return Location(pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(where)), where)
    if near is not None and not near.is_local and _scheme(where) == _scheme(near.uri):
        return Location(near.fs, fs_path(where), where)
    return Location(filesystem(where), fs_path(where), where)


def _scheme(uri: str) -> str:
    return uri.split("://", 1)[0].lower()


def fs_path(uri: str) -> str:
    """The path on the filesystem for a URI: s3://bucket/key -> bucket/key."""
    scheme = _scheme(uri)
    if scheme in ("s3", "s3a"):
        return uri.split("://", 1)[1].strip("/")
    return pafs.FileSystem.from_uri(uri)[1]


def check_uri(uri: str) -> None:
    """Refuses URIs that cannot work or would put a credential into config.json and the logs."""
    parts = urllib.parse.urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme in ("s3", "s3a"):
        if parts.query or "@" in parts.netloc:
            raise StorageError(f"{_safe(uri)}: give S3 settings in AWS_ENDPOINT_URL_S3, AWS_REGION, "
                               f"AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, not in the URI")
        if not parts.netloc:
            raise StorageError(f"{uri}: name a bucket (s3://BUCKET/PREFIX)")
        return
    query = urllib.parse.parse_qs(parts.query)
    if parts.password or any(w in k.lower() for k in query for w in CREDENTIAL_WORDS):
        raise StorageError(f"{_safe(uri)}: credentials must not be part of the URI (it is saved in "
                           f"config.json and printed); give them through the environment")


def _safe(uri: str) -> str:
    """A URI with its query and user info cut off, for messages."""
    parts = urllib.parse.urlsplit(uri)
    return f"{parts.scheme}://{parts.hostname or ''}{parts.path}" + ("?..." if parts.query else "")


def filesystem(uri: str, checking: bool = False) -> Any:
    """The filesystem that serves this URI (built once per process and settings)."""
    check_uri(uri)
    scheme = _scheme(uri)
    if scheme in ("s3", "s3a"):
        settings = S3Settings.from_env()
        bucket = fs_path(uri).split("/", 1)[0]
        key = (scheme, settings, checking, bucket if settings.endpoint is None else "")
        if key not in _FILESYSTEMS:
            _FILESYSTEMS[key] = s3_filesystem(settings, bucket, checking)
        return _FILESYSTEMS[key]
    try:
        return pafs.FileSystem.from_uri(uri)[0]
    except (OSError, pyarrow.ArrowException) as e:
        raise StorageError(f"{_safe(uri)}: {reason(e)}") from None


# --- faults -------------------------------------------------------------------------------------

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
def faults(action: str, loc: Location) -> Iterator[None]:
    """Turns a filesystem failure into one StorageError line (FileNotFoundError passes through)."""
    try:
        yield
    except (FileNotFoundError, StorageError):
        raise
    except (OSError, pyarrow.ArrowException) as e:
        raise StorageError(f"cannot {action} {loc.uri}: {reason(e)}") from None


def retrying(fn: Callable[[], T], wait_s: float, what: str = "",
             pause_s: float = 2.0) -> T:
    """fn(), tried again on StorageError until `wait_s` seconds have passed (0: once)."""
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
            time.sleep(min(pause_s, left))


# --- Ray's own files ----------------------------------------------------------------------------

def for_ray(root: Location, wait_s: float) -> Any:
    """The filesystem to give Ray (RunConfig.storage_filesystem). On object storage, every call
    Ray's controller makes (its checkpoint snapshot, deleting old checkpoints) is retried for up
    to `wait_s` seconds, so a short outage does not end the run with a controller error."""
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


# --- the driver's check -------------------------------------------------------------------------

def check_writable(where: str) -> Location:
    """Fails in seconds, with one line saying what to fix, unless this storage takes a write:
    endpoint unreachable, credentials refused, bucket missing, no write permission."""
    if "://" not in where:
        loc = at(where)
        probe = loc.join(f".write_test_{socket.gethostname()}_{os.getpid()}")
        try:
            loc.makedirs()
            probe.write_bytes(b"")
            probe.delete()
        except OSError as e:
            raise StorageError(f"--storage-path {where} is not writable ({reason(e)}); choose a "
                               f"folder you can write to") from None
        return loc
    check_uri(where)
    if _scheme(where) in ("s3", "s3a"):
        _check_s3(where)
    else:
        loc = Location(filesystem(where), fs_path(where), where)
        probe = loc.join(f".write_test_{os.getpid()}")
        try:
            probe.write_bytes(b"")
            probe.delete()
        except OSError as e:
            raise StorageError(f"--storage-path {_safe(where)} is not writable ({reason(e)})") from None
    return at(where)


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
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        loc = check_writable(argv[1])
    except StorageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{loc.uri}: writable ({time.monotonic() - started:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
