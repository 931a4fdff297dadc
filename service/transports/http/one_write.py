"""One socket write for a small answer's head and body. uvicorn writes each ASGI send to the
socket at once, so a head and a body are two segments, each sent by the kernel and woken up
for by the client; gathered, they are one (docs/performance.md, "Small requests")."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class _Gathering:
    """Stands in for a connection's asyncio transport: keeps what is written, passes
    everything else on to the transport."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        self._parts.append(data)

    def flush(self) -> None:
        if self._parts:
            data = b"".join(self._parts)
            self._parts.clear()
            self._transport.write(data)

    def close(self) -> None:  # uvicorn closes a connection not kept alive after its answer
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


@contextlib.contextmanager
def one_write(cycle: Any) -> Iterator[None]:
    """Inside, what uvicorn's request-response ``cycle`` writes is kept, and written in one
    piece when the block ends (however it ends). Without a cycle (another server, HTTP/2)
    nothing changes."""
    transport = getattr(cycle, "transport", None)
    if transport is None:
        yield
        return
    gathering = _Gathering(transport)
    cycle.transport = gathering
    try:
        yield
    finally:
        cycle.transport = transport
        gathering.flush()
