"""The revision feed: every watcher of a model is told of each change of its ``main``, in order.

The publisher (or a node cache, once it holds the bytes) calls ``announce`` from whatever
thread made the change. Each announcement is serialized once, there, and its bytes are shared
by every watch stream: sixty watchers of a revision with a megabyte of metadata cost one
megabyte and no work on the event loop. A watcher that does not keep up is bounded: past
``WATCH_QUEUE_EVENTS`` announcements waiting for it, they are dropped and it is marked
overrun; its stream then ends with an ``overrun`` event (the client reconnects with the last
sequence or commit it saw, and the backlog answers what it missed). An HTTP watch waits on
an asyncio event of the loop that serves it (woken with ``call_soon_threadsafe``), a gRPC
watch on a thread-safe condition its handler thread blocks on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from weightserve.service.sources.base import RevisionLog

Record = dict[str, Any]
EVERY_MODEL = "*"  # the key of watchers of the whole server (``GET /v1/watch``)
HEARTBEAT_SECONDS = 5.0  # a line this often on an idle watch: proxies keep it, clients see it live
DRAIN_CHECK_SECONDS = 0.5  # how soon an idle watch ends when the server shuts down
WATCH_QUEUE_EVENTS = 16  # announcements waiting for one watcher before it is overrun
OVERRUN_REASON = (
    "this watcher fell behind by more than 16 revisions: reconnect with `after` = the last "
    "sequence (or `since` = the last commit) seen for what was missed"
)


def event_line(body: Record) -> bytes:
    """One NDJSON line of a watch stream."""
    return json.dumps(body, separators=(",", ":")).encode() + b"\n"


@dataclass(frozen=True)
class Announcement:
    """One change of main as every watcher gets it: the record, and its line serialized once
    (with ``model`` for watchers of every model)."""

    record: Record
    line: bytes = field(repr=False)

    @property
    def sequence(self) -> int:
        return int(self.record.get("sequence") or 0)


# What an overrun watcher is sent last, before its stream ends.
OVERRUN = Announcement({}, event_line({"event": "overrun", "reason": OVERRUN_REASON}))


@dataclass(frozen=True)
class WatchStart:
    """What a watch of one model sends before its live announcements, as every transport
    sends it: ``hello`` (``main`` and its sequence), then ``backlog``, the changes a watcher
    resuming at ``since`` / ``after`` missed (each record with its ``sequence``, the last
    flagged ``history_cut`` where the history kept does not reach back). ``sent``: the last
    sequence these cover; a live announcement numbered at or below it is not sent again."""

    hello: Record
    backlog: list[Record]
    sent: int


def watch_start(
    log: RevisionLog, model_id: str, since: str | None, after: int | None
) -> WatchStart:
    """Read after subscribing (blocking: it reads the store): a change meanwhile is queued
    for the watcher, and its sequence tells whether this answer already covers it."""
    current = log.revisions(model_id)
    sent = log.sequence(model_id)
    backlog = log.revisions_after(model_id, since, after) if since or after is not None else []
    hello = {"event": "hello", "main": current[0]["commit"], "sequence": sent}
    for record in backlog:
        sent = max(sent, int(record.get("sequence") or 0))
    return WatchStart(hello, backlog, sent)


class Subscription:
    """What one watcher has not read yet, bounded; ``wake`` tells its reader."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._pending: deque[Announcement] = deque()
        self._lock = threading.Lock()
        self._wake = wake
        self.overrun = False

    def deliver(self, announcement: Announcement) -> None:
        with self._lock:
            if self.overrun:
                return
            if len(self._pending) >= WATCH_QUEUE_EVENTS:
                self._pending.clear()  # the bytes go; the watcher catches up by reconnecting
                self.overrun = True
            else:
                self._pending.append(announcement)
        self._wake()

    def take(self) -> Announcement | None:
        with self._lock:
            return self._pending.popleft() if self._pending else None


class AsyncSubscription(Subscription):
    """A watcher on an event loop (an HTTP watch stream)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._ready = asyncio.Event()
        self._loop = loop
        super().__init__(self._notify)

    def _notify(self) -> None:
        self._loop.call_soon_threadsafe(self._ready.set)

    async def get(self, timeout: float) -> Announcement | None:
        """The next announcement; None once overrun; TimeoutError after ``timeout``."""
        while True:
            found = self.take()
            if found is not None or self.overrun:
                return found
            # A delivery after the look sets the event later, on this loop: no wake is lost.
            self._ready.clear()
            await asyncio.wait_for(self._ready.wait(), timeout)


class BlockingSubscription(Subscription):
    """A watcher on a thread (a gRPC handler)."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        super().__init__(self._notify)

    def _notify(self) -> None:
        with self._ready:
            self._ready.notify_all()

    def get(self, timeout: float) -> Announcement | None:
        """As ``AsyncSubscription.get``, raising ``queue.Empty`` after ``timeout``."""
        with self._ready:
            found = self.take()
            if found is None and not self.overrun:
                self._ready.wait(timeout)
                found = self.take()
                if found is None and not self.overrun:
                    raise queue.Empty
        return found


class RevisionFeed:
    def __init__(self) -> None:
        self._watchers: dict[str, dict[int, Subscription]] = {}
        self._lock = threading.Lock()
        self._next = 0

    def announce(self, model_id: str, record: Record) -> None:
        """Tell every watcher of ``model_id`` of a change of its main (``record``), and every
        watcher of the whole server (the record with ``model``), each line serialized once."""
        with self._lock:
            of_model = list(self._watchers.get(model_id, {}).values())
            of_all = list(self._watchers.get(EVERY_MODEL, {}).values())
        for watchers, body in (
            (of_model, record),
            (of_all, {"model": model_id, **record}),
        ):
            if not watchers:
                continue
            announcement = Announcement(body, event_line({"event": "revision", **body}))
            for watcher in watchers:
                with contextlib.suppress(RuntimeError):  # an asyncio watcher's loop closed
                    watcher.deliver(announcement)

    @contextlib.contextmanager
    def _watching(self, model_id: str, watcher: Subscription) -> Iterator[None]:
        with self._lock:
            key = self._next
            self._next += 1
            self._watchers.setdefault(model_id, {})[key] = watcher
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
    def subscribe(self, model_id: str) -> Iterator[AsyncSubscription]:
        """The announcements from now on, until the block ends (``EVERY_MODEL``: of every
        model); call it on the event loop that reads them."""
        watcher = AsyncSubscription(asyncio.get_running_loop())
        with self._watching(model_id, watcher):
            yield watcher

    @contextlib.contextmanager
    def subscribe_blocking(self, model_id: str) -> Iterator[BlockingSubscription]:
        """The announcements from now on, for a thread (a gRPC handler)."""
        watcher = BlockingSubscription()
        with self._watching(model_id, watcher):
            yield watcher

    def watchers(self) -> int:
        with self._lock:
            return sum(len(w) for w in self._watchers.values())
