"""The idle cut: a stream whose client has taken nothing for ``idle_timeout`` is cut, so it
cannot hold its stream slot (and a handler thread) forever.

A client that stops reading blocks the transport's send (HTTP: uvicorn waits for the socket
to drain; gRPC: HTTP/2 flow control blocks the handler inside grpc). One watcher thread per
server, running only while streams are watched, calls each stale stream's ``cut``; a
transport says what cutting means (cancel the ASGI task, cancel the gRPC call).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("weightserve.idle")


class IdleWatch:
    """One stream's watch: ``progress()`` whenever the client took something."""

    def __init__(self, cutter: IdleCutter, cut: Callable[[], None]) -> None:
        self._cutter = cutter
        self.cut = cut
        self.last = time.monotonic()
        self.fired = False  # the cut was called: the stream ends as an idle timeout
        self.closed = False

    def progress(self) -> None:
        self.last = time.monotonic()

    def close(self) -> None:
        """Stop watching (idempotent); a cut already on its way may still arrive."""
        self.closed = True
        self._cutter.forget(self)


class IdleCutter:
    """Watches streams and cuts those idle for ``timeout`` seconds; the check runs every
    ``min(1 s, timeout / 4)``."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        self._watched: set[IdleWatch] = set()
        self._running = False

    def watch(self, cut: Callable[[], None]) -> IdleWatch:
        """Watch a stream from now on; ``cut`` is called (on the watcher thread) once it has
        been idle for ``timeout``."""
        watch = IdleWatch(self, cut)
        with self._lock:
            self._watched.add(watch)
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="weightserve-idle", daemon=True).start()
        return watch

    def forget(self, watch: IdleWatch) -> None:
        with self._lock:
            self._watched.discard(watch)

    def _run(self) -> None:
        period = min(1.0, self.timeout / 4)
        while True:
            time.sleep(period)
            now = time.monotonic()
            with self._lock:
                if not self._watched:
                    self._running = False
                    return
                stale = [w for w in self._watched if now - w.last > self.timeout]
                for watch in stale:
                    self._watched.discard(watch)
                    watch.fired = True
            for watch in stale:
                try:
                    watch.cut()
                except Exception:  # one stream's failed cut must not stop the watcher
                    log.exception("cutting an idle stream failed")
