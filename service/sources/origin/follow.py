"""A node cache follows its upstream weightserve by watching it, not by rescanning.

One long-lived watch of every model on the upstream (``GET /v1/watch``, NDJSON): each revision
announced there of a model this node holds is filled at once (only the files that changed)
and announced to the node's own watchers once its bytes are here (``OriginCatalog.follow``),
so a worker told by its node loads from its node. The watch reconnects with backoff; on every
reconnect the origin is listed again, so a revision announced while disconnected is caught
(the first connection follows the listing the server made at start; a revision published in
between is caught by the next rescan).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from weightserve.client.errors import NotFound, WeightserveError
from weightserve.client.wire.backoff import Delays
from weightserve.service.sources.origin.catalog import OriginCatalog

log = logging.getLogger("weightserve.service")

RETRY_FIRST = 0.2
RETRY_MAX = 10.0


class UpstreamFollower:
    """The thread that keeps a node cache's held models at its upstream's newest revision."""

    def __init__(
        self,
        catalog: OriginCatalog,
        events: Callable[[], Iterator[dict[str, Any]]],
        interrupt: Callable[[], None] = lambda: None,
    ) -> None:
        """``interrupt`` ends a read of ``events`` blocked in this thread (see ``stop``)."""
        self.catalog = catalog
        self.events = events
        self.interrupt = interrupt
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weightserve-follow", daemon=True)

    def start(self) -> UpstreamFollower:
        self._thread.start()
        return self

    def stop(self, wait: float = 5.0) -> None:
        """Stop following: the watch is cut at once (its read would wait for the upstream's
        next heartbeat), and the thread waited for."""
        self._stop.set()
        self.interrupt()
        if self._thread.is_alive():
            self._thread.join(wait)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        delays = Delays(RETRY_FIRST, RETRY_MAX, jitter=False)
        failing = False
        connected_before = False
        while not self._stop.is_set():
            try:
                for event in self.events():
                    if self._stop.is_set():
                        return
                    if event.get("event") == "hello":
                        if failing:
                            log.info("following %s again", self.catalog.description)
                        failing = False
                        delays.reset()
                        if connected_before:  # the first: the server listed it at start
                            self._catch_up()
                        connected_before = True
                    elif event.get("event") == "revision" and event.get("model"):
                        self.catalog.follow(event["model"], event)
            except NotFound:
                log.info(
                    "%s announces no revisions (an older weightserve): its models are "
                    "followed by rescanning only",
                    self.catalog.description,
                )
                return
            except (WeightserveError, OSError, ValueError) as e:
                if self._stop.is_set():
                    return  # cut by stop()
                if not failing:
                    log.warning(
                        "the watch of %s broke (%s); reconnecting", self.catalog.description, e
                    )
                failing = True
            self._stop.wait(delays.next())

    def _catch_up(self) -> None:
        """After a reconnect: list the origin again and follow every held model it has moved
        on from while the watch was down."""
        try:
            self.catalog.catch_up()
        except WeightserveError as e:
            log.warning("listing %s failed: %s", self.catalog.description, e)
