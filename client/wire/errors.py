"""How an error crosses the wire: one shape on every transport, encoded and decoded here.

An error is its class name, its message and, for a temporary refusal, the seconds the server
asks the client to wait (``WireError``). Every transport carries that same triple:

    HTTP      status from ``STATUS_TABLE``; body ``{"error": {"type", "message"}}``;
              ``Retry-After`` (whole seconds, never 0)
    gRPC      status code from ``STATUS_TABLE``; details = message; trailing metadata
              ``weightserve-error`` = class, ``grpc-retry-pushback-ms`` = wait
    Flight    the Flight error class for the gRPC code; ``extra_info`` = the JSON object
              ``{"type", "message", "retry_after"}``
    handoff   an answer frame ``{"error": {"type", "message", "retry_after"}}``

The exception classes and their status table live in ``weightserve.client.errors``; the
service encodes with ``WireError.from_exception``, the client decodes with the ``from_*``
constructors and raises ``.exception()``: the same class the server raised.
"""

from __future__ import annotations

import datetime
import email.utils
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from weightserve.client.errors import WeightserveError, error_from_wire, status_for

# gRPC trailing metadata: the class name of the server's exception.
ERROR_METADATA_KEY = "weightserve-error"
# gRPC's own retry hint (milliseconds; a negative value means "do not retry"), which grpc
# core's retry policy reads as well as our client.
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


@dataclass(frozen=True)
class WireError:
    """One error as it travels: class name, message, seconds to wait (temporary refusals)."""

    type: str
    message: str
    retry_after: float | None = None
    # (HTTP status, gRPC code name) of the raised class, kept by ``from_exception``: a class
    # only the server knows (a reader's rule such as ``BadMagic``) has its ancestor's row of
    # STATUS_TABLE, which its name alone would not find on this side.
    status: tuple[int, str] | None = field(default=None, compare=False)

    @classmethod
    def from_exception(cls, exc: WeightserveError) -> WireError:
        return cls(type(exc).__name__, str(exc), exc.retry_after, status_for(exc))

    def _status(self) -> tuple[int, str]:
        return self.status or status_for(self.exception())

    def exception(self) -> WeightserveError:
        """The exception the server raised: the same class when it is one of ours."""
        return error_from_wire(self.type, self.message, self.retry_after)

    # The JSON object of HTTP bodies, Flight's extra_info and handoff frames.
    def to_json(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"type": self.type, "message": self.message}
        if self.retry_after is not None:
            fields["retry_after"] = self.retry_after
        return fields

    @classmethod
    def from_json(cls, fields: object) -> WireError | None:
        """The error in a decoded JSON object, or None when it does not hold one."""
        if not isinstance(fields, Mapping) or "message" not in fields:
            return None
        kind = fields.get("type")
        if not isinstance(kind, str):
            return None
        hint = fields.get("retry_after")
        seconds = float(hint) if isinstance(hint, (int, float)) and hint >= 0 else None
        return cls(kind, str(fields["message"]), seconds)

    # HTTP
    def http_status(self) -> int:
        return self._status()[0]

    def http_headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        # Retry-After counts whole seconds; never 0, which would invite a busy loop.
        return {"retry-after": str(max(1, math.ceil(self.retry_after)))}

    def http_body(self) -> dict[str, Any]:
        return {"error": {"type": self.type, "message": self.message}}

    @classmethod
    def from_http(cls, body: object, retry_after: str | None) -> WireError | None:
        """The error of an HTTP answer (its decoded JSON body and Retry-After header), or
        None when the body is not ours (a proxy's page, say)."""
        if not isinstance(body, Mapping):
            return None
        found = cls.from_json(body.get("error"))
        if found is None:
            return None
        return cls(found.type, found.message, retry_after_seconds(retry_after))

    # gRPC
    def grpc_code(self) -> str:
        """The name of the ``grpc.StatusCode`` member."""
        return self._status()[1]

    def grpc_trailers(self) -> tuple[tuple[str, str], ...]:
        trailing = [(ERROR_METADATA_KEY, self.type)]
        if self.retry_after is not None:
            trailing.append((RETRY_PUSHBACK_KEY, str(round(self.retry_after * 1000))))
        return tuple(trailing)

    @classmethod
    def from_grpc(cls, details: str, trailing: Mapping[str, Any]) -> WireError | None:
        """The error of a gRPC status whose trailing metadata names our class, or None."""
        kind = trailing.get(ERROR_METADATA_KEY)
        if not kind:
            return None
        if isinstance(kind, bytes):
            kind = kind.decode(errors="replace")
        return cls(str(kind), details, pushback_seconds(trailing.get(RETRY_PUSHBACK_KEY)))


def retry_after_seconds(value: str | None) -> float | None:
    """An HTTP ``Retry-After`` value (seconds, or an HTTP date) in seconds from now."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds())


def pushback_seconds(value: str | bytes | None) -> float | None:
    """gRPC's ``grpc-retry-pushback-ms`` trailer in seconds (a negative value: do not retry)."""
    if value is None:
        return None
    try:
        ms = int(value)
    except (TypeError, ValueError):
        return None
    return ms / 1000 if ms >= 0 else None
