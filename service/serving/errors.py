"""An error the server raised, in its wire form: every transport encodes it through this
``WireError`` (client/wire/errors.py), so the class, message and retry hint travel alike."""

from __future__ import annotations

from dataclasses import dataclass

from weightserve.client.errors import STATUS_TABLE, WeightserveError, status_for
from weightserve.client.wire.errors import WireError


@dataclass(frozen=True)
class RaisedError(WireError):
    """A ``WireError`` whose HTTP status and gRPC code are those of the class raised, not of
    the class its name reads back as: a class only the server knows (a reader's rule such as
    ``BadMagic``, the Hub routes' ``RevisionNotFound``) keeps its ancestor's row of
    ``STATUS_TABLE`` instead of falling to WeightserveError's 500."""

    status: tuple[int, str] = STATUS_TABLE[WeightserveError]

    def http_status(self) -> int:
        return self.status[0]

    def grpc_code(self) -> str:
        return self.status[1]


def wire_error(exc: WeightserveError) -> WireError:
    return RaisedError(type(exc).__name__, str(exc), exc.retry_after, status_for(exc))
