"""A file or folder of a run: a pyarrow filesystem and a path on it (local folder, s3://..., or
another pyarrow.fs URI). Everything the project reads or writes in a run folder goes through a
`Location`, never through `open()` on a path that might be a URI; strict JSON files on it, replaced as a
whole.

S3 settings come from the variables the AWS tools use: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and
AWS_SESSION_TOKEN, else AWS_PROFILE (and the rest of the AWS default credential chain); AWS_REGION /
AWS_DEFAULT_REGION; AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL, for S3-compatible stores. The
`S3FileSystem` is built here, not by `FileSystem.from_uri` (which asks AWS for the bucket's region and
fails against other endpoints). Credentials are never written into a message, a log line, config.json or
a URI.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import urllib.parse
from dataclasses import dataclass
from typing import Any, Optional, Union

import pyarrow
import pyarrow.fs as pafs

from ..core.jsonio import dumps, loads
from .faults import StorageError, faults, reason

CHUNK = 64 * 2**20  # buffer for copies between stores (a folder moved on object storage, staging)


CREDENTIAL_WORDS = ("secret", "key", "token", "password", "credential")


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

    def delete(self) -> None:
        """Deletes the file or folder; nothing there is fine."""
        kind = self.info().type
        with faults("delete", self):
            if kind == pafs.FileType.Directory:
                self.fs.delete_dir(self.path)
            elif kind == pafs.FileType.File:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.delete_file(self.path)

    def move_to(self, dest: Location) -> None:
        """Renames a folder (local) or copies and deletes it (object stores have no rename)."""
        with faults("move", self):
            if self.is_local:
                self.fs.move(self.path, dest.path)
                return
            # pyarrow's threaded copies to S3 are unsafe (apache/arrow#32372), as Ray notes
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


def read_json(path: Where) -> Any:
    return loads(at(path).read_text())


def read_jsonl(path: Where) -> list[dict]:
    try:
        text = at(path).read_text()
    except FileNotFoundError:
        return []
    return [loads(line) for line in text.splitlines() if line.strip()]


def write_json(path: Where, obj: Any) -> None:
    at(path).write_text(dumps(obj, indent=2, sort_keys=True))


# Training: a stalled transfer is given up after REQUEST_TIMEOUT_S without progress (not a cap on a
# transfer's length), each request is tried up to ATTEMPTS times.
CONNECT_TIMEOUT_S, REQUEST_TIMEOUT_S, ATTEMPTS = 5.0, 30.0, 4


# The driver's check before anything starts: seconds, not minutes, when the endpoint is dead.
CHECK_CONNECT_TIMEOUT_S, CHECK_REQUEST_TIMEOUT_S, CHECK_ATTEMPTS = 2.0, 5.0, 2


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
    region = settings.region or ("us-east-1" if settings.endpoint else None)
    if region is None:
        try:
            region = pafs.resolve_s3_region(bucket)
        except (OSError, pyarrow.ArrowException) as e:
            raise StorageError(f"cannot find the AWS region of bucket {bucket!r} ({reason(e)}); set "
                               f"AWS_REGION, or AWS_ENDPOINT_URL_S3 for an S3-compatible store") from None
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

