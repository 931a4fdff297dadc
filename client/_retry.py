"""When the client tries again, and for how long: jittered exponential backoff that honours the
server's hint, bounded by time rather than by a count of tries.

A refusal that says it is temporary (``retry_after`` set: a stream limit reached, a server
shutting down), a server that cannot be reached and a stream that broke are retried; every
other error is final. The budget (``retry_seconds``; ``WEIGHTSERVE_RETRY_SECONDS``; 60 s by
default) is how long one outage may last: long enough for a pod to restart, and it starts
again once data flows. A ``weightserve`` command first waits for the server to accept a
connection (``wait_for_server``) only briefly unless told, so a wrong URL fails in seconds.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

from weightserve.client.errors import (
    DataCorruption,
    ModelFilling,
    ModelUnavailable,
    ResourceExhausted,
    ServerUnreachable,
    TransportError,
    WeightserveError,
)
from weightserve.client.wire.backoff import Delays

if TYPE_CHECKING:
    from weightserve.client.wire.routes import ServerAddress

log = logging.getLogger("weightserve.client")

RETRY_ENV = "WEIGHTSERVE_RETRY_SECONDS"
DEFAULT_RETRY_SECONDS = 60.0
# How long a ``weightserve`` command waits for a server that refuses its first connection
# when neither --retry-seconds nor the variable says: a mistyped URL fails in seconds. Once the
# server has answered, an outage gets the budget above as in the library.
COMMAND_START_SECONDS = 2.0
FIRST_WAIT = 0.25  # seconds before the first retry, doubled on each further one...
LONGEST_WAIT = 5.0  # ...up to this (a server's own hint may ask for longer)

T = TypeVar("T")
# Told before each wait: a few words on why (e.g. "server busy") and the seconds it waits.
OnWait = Callable[[str, float], None]


class WaitsForServer(Protocol):
    """How long a client waits for a busy or unreachable server, and who hears of each wait
    (``Client`` is one): what its fetches and downloads retry by."""

    retry_seconds: float
    on_wait: OnWait | None


def retry_seconds_from(value: float | str | None) -> float:
    """The retry budget: ``value`` if given, else ``WEIGHTSERVE_RETRY_SECONDS``, else 60 s."""
    source = "retry_seconds"
    if value is None:
        value = os.environ.get(RETRY_ENV) or DEFAULT_RETRY_SECONDS
        source = RETRY_ENV
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not seconds >= 0 or math.isinf(seconds):  # also refuses NaN
        raise ValueError(
            f"{source} must be a number of seconds >= 0 (0: never retry), got {value!r}"
        )
    return seconds


def retry_reason(exc: BaseException, stream: bool = True) -> str | None:
    """Why ``exc`` is worth another try, in a few words; None when it is final.

    A broken stream (``stream``) resumes; a metadata call is tried again only on a
    temporary refusal or a refused connection, since any other failure of a small request
    would fail the same way again.
    """
    if isinstance(exc, ResourceExhausted) and exc.retry_after is not None:
        return "server busy"
    if isinstance(exc, ModelFilling):
        return "model being copied into the server's cache"
    if isinstance(exc, ModelUnavailable) and exc.retry_after is not None:
        return "model reloading or server shutting down"
    if isinstance(exc, ServerUnreachable):
        return "server unreachable"
    if stream and isinstance(exc, (TransportError, DataCorruption)):
        return "stream broke"
    return None


class Backoff:
    """The waits of one outage: each retry waits about twice as long as the one before (from
    ``FIRST_WAIT`` up to ``LONGEST_WAIT``), at least what the server asked for, with random
    jitter so a crowd of refused clients does not come back in step; no more retries once
    ``budget`` seconds have passed since the first failure. ``reset()`` after progress."""

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.tries = 0
        self._deadline: float | None = None
        self._delays = Delays(FIRST_WAIT, LONGEST_WAIT)

    def reset(self) -> None:
        self.tries = 0
        self._deadline = None
        self._delays.reset()

    def next_wait(self, exc: BaseException) -> float | None:
        """Seconds to wait before trying again after ``exc`` (a retryable error, see
        ``retry_reason``), or None: the budget is spent."""
        now = time.monotonic()
        if self._deadline is None or isinstance(exc, ModelFilling):
            # A fill in progress is not an outage: the budget starts again from each answer
            # (the server's fill itself ends, with the model or OriginUnavailable).
            self._deadline = now + self.budget
        left = self._deadline - now
        if left <= 0:
            return None
        wait = self._delays.next()
        hint = getattr(exc, "retry_after", None)
        if hint:
            wait = max(wait, hint * random.uniform(1.0, 1.5))
        self.tries += 1
        return min(wait, left)  # the last try comes at the deadline, not after it

    def wait_or_raise(self, exc: WeightserveError) -> float:
        """``next_wait(exc)``, or, once the budget is spent, raise: ``exc`` itself if it was
        never retried, else ``gave_up(exc)``. Call it while handling ``exc``."""
        wait = self.next_wait(exc)
        if wait is not None:
            return wait
        if not self.tries:
            raise exc
        raise self.gave_up(exc) from exc

    def retry_wait(self, exc: WeightserveError, stream: bool = True) -> tuple[str, float]:
        """Why and how long to wait before trying again after ``exc`` (``retry_reason``,
        ``wait_or_raise``): ``exc`` is raised again when it is not worth a retry or once the
        budget is spent. Call it while handling ``exc``."""
        reason = retry_reason(exc, stream=stream)
        if reason is None:
            raise exc
        return reason, self.wait_or_raise(exc)

    @staticmethod
    def sleep(reason: str, wait: float, on_wait: OnWait | None) -> None:
        """Tell ``on_wait`` of the wait (``retry_wait``'s), then wait."""
        if on_wait is not None:
            on_wait(reason, wait)
        time.sleep(wait)

    def gave_up(self, exc: WeightserveError) -> WeightserveError:
        """``exc`` (same class) saying how long it was retried and how to wait longer."""
        message = (
            f"{exc} (gave up after retrying for {self.budget:g} s; to wait longer, set "
            f"retry_seconds (the command line's --retry-seconds) or {RETRY_ENV})"
        )
        again = copy.copy(exc)  # the same class and attributes (retry_after), a new message
        again.args = (message,)
        return again


def call_with_retry(
    call: Callable[[], T],
    budget: float,
    what: str,
    on_wait: OnWait | None = None,
    *,
    stream: bool = False,
) -> T:
    """``call()``, tried again on a busy or unreachable server within ``budget`` seconds.

    For metadata calls (model list, model info): they hold no stream, so a refused
    connection is what there is to wait out (a server restarting). With ``stream``, a call
    that reads a stream whole (a delta update) is tried again when the stream breaks too.
    """
    backoff = Backoff(budget)
    while True:
        try:
            return call()
        except WeightserveError as e:
            reason, wait = backoff.retry_wait(e, stream=stream)
            log.warning("%s: %s (%s); retrying in %.1f s", what, reason, e, wait)
            backoff.sleep(reason, wait, on_wait)


def wait_for_server(address: ServerAddress, budget: float | None) -> None:
    """The command line's first step: return once ``address`` accepts a connection;
    ServerUnreachable after ``budget`` seconds of refusals (None: ``COMMAND_START_SECONDS``),
    naming --retry-seconds (a server still starting needs a longer one)."""
    import socket

    if budget is None:
        budget = COMMAND_START_SECONDS
    backoff = Backoff(budget)
    timeout = max(1.0, min(budget, 10.0))  # a host that drops packets answers nothing
    while True:
        try:
            if address.socket_path is not None:
                with socket.socket(socket.AF_UNIX) as s:
                    s.settimeout(timeout)
                    s.connect(address.socket_path)
            else:
                socket.create_connection((address.host, address.port), timeout=timeout).close()
            return
        except OSError as e:
            error = ServerUnreachable(f"cannot reach weightserve at {address.url}: {e}")
        wait = backoff.next_wait(error)
        if wait is None:
            tried = f"gave up after retrying for {budget:g} s; " if budget else ""
            raise ServerUnreachable(
                f"{error} ({tried}is it running? To wait for a server that is starting, give "
                f"--retry-seconds N or set {RETRY_ENV})"
            )
        time.sleep(wait)
