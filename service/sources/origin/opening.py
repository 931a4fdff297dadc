"""An origin by its URI: object storage (objects.py) or another weightserve (upstream.py)."""

from __future__ import annotations

from urllib.parse import urlsplit

from weightserve.client.remote import TLSOptions
from weightserve.service.sources.origin.base import (
    UPSTREAM_READ_TIMEOUT,
    Origin,
    RetryPolicy,
    _redact_uri,
)
from weightserve.service.sources.origin.objects import FileSystemOrigin
from weightserve.service.sources.origin.upstream import UpstreamOrigin


def open_origin(
    uri: str,
    *,
    token: str | None = None,
    tls: TLSOptions | None = None,
    retry: RetryPolicy | None = None,
    stall_seconds: float = UPSTREAM_READ_TIMEOUT,
) -> Origin:
    """The origin ``uri`` names:

    - ``s3://bucket/prefix?endpoint_override=HOST:PORT&scheme=http&region=...`` and
      ``gs://bucket/prefix``: ``pyarrow.fs.FileSystem.from_uri`` syntax and query options;
      credentials are found the way pyarrow finds them (environment, profiles, instance or
      workload identity).
    - ``file:///absolute/dir``.
    - ``http(s)://HOST:PORT``: another weightserve, read through its files API with
      ``token`` and ``tls``; file names are ``MODEL_ID/FILE_NAME``. ``retry`` bounds its
      retries, ``stall_seconds`` the silence after which a read is abandoned and retried; an
      object store's own client retries with backoff (bounded) instead.
    """
    scheme = urlsplit(uri).scheme
    if scheme in ("http", "https"):
        return UpstreamOrigin(
            uri, token=token, tls=tls, retry=retry or RetryPolicy(), timeout=stall_seconds
        )
    if scheme in ("s3", "gs", "gcs", "file"):
        return FileSystemOrigin(uri, retry=retry or RetryPolicy(), stall_seconds=stall_seconds)
    raise ValueError(
        f"unsupported origin {_redact_uri(uri)!r}: use s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, "
        "file:///ABSOLUTE/DIR or http(s)://HOST:PORT of another weightserve"
    )
