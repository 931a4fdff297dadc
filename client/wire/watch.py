"""The revision watch as both sides read it (``GET /v1/models/ID/-/watch``, ``GET /v1/watch``;
docs/protocol.md, "Publishing revisions"): NDJSON, one event object per line, a heartbeat
every few seconds, the stream ended by the server's shutdown. Pure: the connection and its
reads stay with the caller's transport; a watcher reconnects with client/wire/backoff.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

# Seconds without a line (the server sends a heartbeat every 5) before a watch is taken for
# dead and reconnected.
WATCH_SILENCE = 20.0


def parse_event(line: bytes) -> dict[str, Any]:
    """One watch line: a JSON object with a string ``event``; ValueError for anything else."""
    found: Any = json.loads(line)
    if not isinstance(found, dict) or not isinstance(found.get("event"), str):
        raise ValueError(f"a watch line that is not an event: {line[:200]!r}")
    return found


def read_events(
    readline: Callable[[], bytes], before_read: Callable[[], bool] | None = None
) -> Iterator[dict[str, Any]]:
    """The events of one watch connection, read line by line until the server ends it;
    ``before_read()`` runs before each read and stops the watch by answering False (a
    deadline passed)."""
    while before_read is None or before_read():
        line = readline()
        if not line:
            return  # the server ended the watch (shutting down): the caller reconnects
        yield parse_event(line)
