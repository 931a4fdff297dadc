"""The revision feed: every watcher of a model is told of each revision it gets, in order.

The publisher calls ``announce`` from whatever thread committed the revision; each watcher is
an asyncio queue on the event loop of the stream that serves it, fed with
``call_soon_threadsafe``, so a publish reaches every open watch stream at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

Watcher = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[dict[str, Any]]"]


class RevisionFeed:
    def __init__(self) -> None:
        self._watchers: dict[str, set[Watcher]] = {}
        self._lock = threading.Lock()

    def announce(self, model_id: str, record: dict[str, Any]) -> None:
        """Tell every watcher of ``model_id`` of a new revision (``record``)."""
        with self._lock:
            watchers = list(self._watchers.get(model_id, ()))
        for loop, queue in watchers:
            with contextlib.suppress(RuntimeError):  # its loop closed: the stream is gone
                loop.call_soon_threadsafe(queue.put_nowait, record)

    @contextlib.contextmanager
    def subscribe(self, model_id: str) -> Iterator[asyncio.Queue[dict[str, Any]]]:
        """A queue of the revisions announced from now on, until the block ends; call it on
        the event loop that reads the queue."""
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        watcher = (asyncio.get_running_loop(), queue)
        with self._lock:
            self._watchers.setdefault(model_id, set()).add(watcher)
        try:
            yield queue
        finally:
            with self._lock:
                found = self._watchers.get(model_id)
                if found is not None:
                    found.discard(watcher)
                    if not found:
                        del self._watchers[model_id]

    def watchers(self) -> int:
        with self._lock:
            return sum(len(w) for w in self._watchers.values())
