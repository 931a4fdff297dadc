"""One server spoken to through the transport seam itself, below ``Client``: no retries, no
choice of data plane, no fetch machinery. For programs that relay what a server holds, such as
a node cache reading its upstream weightserve: the answers are the HTTP API's JSON objects
(docs/protocol.md), file bytes come as ``FileSource``, long answers as ``LineStream``, and
every error is a weightserve error (``weightserve.client.errors``).

    from weightserve.client.remote import connect, iter_updates

    server = connect("http://upstream:8080", token=token)
    listing = server.list_models()
    watch = server.open_watch(None, None)      # every model's new revisions, NDJSON lines
    target, updates = iter_updates(server, "org/model", since=commit)
"""

from __future__ import annotations

from weightserve.client._update import UpdateTarget, iter_updates
from weightserve.client.transports.base import (
    DEFAULT_READ_TIMEOUT,
    Connection,
    ControlTransport,
    DataTransport,
    FileSource,
    LineStream,
    TLSOptions,
    Transport,
    carries,
)
from weightserve.client.transports.planes import make_transport
from weightserve.client.wire.delta import TensorUpdate
from weightserve.client.wire.routes import ServerAddress, parse_url

__all__ = [
    "ControlTransport",
    "DataTransport",
    "FileSource",
    "LineStream",
    "TLSOptions",
    "TensorUpdate",
    "Transport",
    "UpdateTarget",
    "carries",
    "connect",
    "iter_updates",
]


def connect(
    server: str | ServerAddress,
    *,
    token: str | None = None,
    tls: TLSOptions | None = None,
    timeout: float = DEFAULT_READ_TIMEOUT,
) -> Transport:
    """The transport to ``server`` (a URL, ``http(s)://`` or ``grpc(s)://``, or a parsed
    address) that its scheme names; close it when done. A verb it does not carry (a watch's
    lines over gRPC) raises ``WrongTransport``; ``carries(transport, verb)`` says beforehand."""
    address = parse_url(server)[0] if isinstance(server, str) else server
    return make_transport(address, Connection(token, tls, timeout))
