"""The revision feed: every watcher of a model is told of each revision it gets, in order.

The publisher calls ``announce`` from whatever thread committed the revision. An HTTP watch is
an asyncio queue on the event loop of the stream that serves it (fed with
``call_soon_threadsafe``), a gRPC watch a thread-safe queue its handler thread blocks on; a
publish reaches every open watch stream at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

Record = dict[str, Any]
EVERY_MODEL = "*"  # the key of watchers of the whole server (``GET /v1/watch``)
HEARTBEAT_SECONDS = 5.0  # a line this often on an idle watch: proxies keep it, clients see it live
DRAIN_CHECK_SECONDS = 0.5  # how soon an idle watch ends when the server shuts down


class RevisionFeed:
    def __init__(self) -> None:
        self._watchers: dict[str, dict[int, Callable[[Record], None]]] = {}
        self._lock = threading.Lock()
        self._next = 0

    def announce(self, model_id: str, record: Record) -> None:
        """Tell every watcher of ``model_id`` of a new revision (``record``), and every
        watcher of the whole server (the record with ``model``)."""
        with self._lock:
            deliveries = [(d, record) for d in self._watchers.get(model_id, {}).values()]
            deliveries += [
                (d, {"model": model_id, **record})
                for d in self._watchers.get(EVERY_MODEL, {}).values()
            ]
        for deliver, what in deliveries:
            with contextlib.suppress(RuntimeError):  # an asyncio watcher's loop closed
                deliver(what)

    @contextlib.contextmanager
    def _watching(self, model_id: str, deliver: Callable[[Record], None]) -> Iterator[None]:
        with self._lock:
            key = self._next
            self._next += 1
            self._watchers.setdefault(model_id, {})[key] = deliver
        try:
            yield
        finally:
            with self._lock:
                found = self._watchers.get(model_id)
                if found is not None:
                    found.pop(key, None)
                    if not found:
                        del self._watchers[model_id]

    @contextlib.contextmanager
    def subscribe(self, model_id: str) -> Iterator[asyncio.Queue[Record]]:
        """An asyncio queue of the revisions announced from now on, until the block ends
        (``EVERY_MODEL``: of every model); call it on the event loop that reads the queue."""
        found: asyncio.Queue[Record] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def deliver(record: Record) -> None:
            loop.call_soon_threadsafe(found.put_nowait, record)

        with self._watching(model_id, deliver):
            yield found

    @contextlib.contextmanager
    def subscribe_blocking(self, model_id: str) -> Iterator[queue.Queue[Record]]:
        """A thread-safe queue of the revisions announced from now on (a gRPC handler)."""
        found: queue.Queue[Record] = queue.Queue()
        with self._watching(model_id, found.put):
            yield found

    def watchers(self) -> int:
        with self._lock:
            return sum(len(w) for w in self._watchers.values())
