"""S3 settings from the variables the AWS tools use, and the S3FileSystem built from them.

AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN, else AWS_PROFILE (and the rest of
the AWS default credential chain); AWS_REGION / AWS_DEFAULT_REGION; AWS_ENDPOINT_URL_S3, else
AWS_ENDPOINT_URL, for S3-compatible stores. The `S3FileSystem` is built here, not by
`FileSystem.from_uri` (which asks AWS for the bucket's region and fails against other endpoints).
Credentials are never written into a message, a log line, config.json or a URI.
"""

from __future__ import annotations

import dataclasses
import os
import urllib.parse
from dataclasses import dataclass
from typing import Any, Optional

import pyarrow
import pyarrow.fs as pafs

from .faults import StorageError, reason

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

