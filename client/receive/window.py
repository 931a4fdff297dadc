"""Tensors one at a time as they arrive, with memory bounded by a window: the loading style
of engines that copy each weight into place (vLLM's and SGLang's ``load_weights(iterable)``).

One stream carries the tensors; a receiving thread may run ahead of the consumer by at most
``window_bytes`` of tensors (one larger tensor is received alone). A tensor's bytes count
against the window until the consumer asks for the next one; the iterator then drops its
reference, so the buffer is freed unless the consumer kept it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager

import numpy as np

from weightserve.client._retry import OnWait
from weightserve.client.receive.stream import ReceivedTensor, aligned_empty, receive
from weightserve.client.transports.base import ChunkReader, StreamParams
from weightserve.client.wire.schema import ChunkHeader

# What a layer-by-layer load adds to the client's peak memory grows with the window;
# docs/performance.md has the figures for 64 and 256 MiB.
DEFAULT_WINDOW_BYTES = 64 << 20


class _Abandoned(Exception):
    """The consumer stopped iterating: the receiving thread stops at its next tensor."""


class _Window:
    """Bytes received but not yet moved past by the consumer, at most ``limit`` (a tensor
    larger than the limit is let in alone)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.abandoned = False
        self._cond = threading.Condition()

    def reserve(self, nbytes: int) -> None:
        with self._cond:
            while not self.abandoned and self.used and self.used + nbytes > self.limit:
                self._cond.wait()
            if self.abandoned:
                raise _Abandoned()
            self.used += nbytes

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.used -= nbytes
            self._cond.notify_all()

    def abandon(self) -> None:
        with self._cond:
            self.abandoned = True
            self._cond.notify_all()


_END = object()


def iter_received(
    open_chunks: Callable[[StreamParams], ChunkReader],
    params: StreamParams,
    names: list[str],
    *,
    window_bytes: int,
    receiving: AbstractContextManager[None],
    retries: int | None,
    retry_seconds: float,
    on_bytes: Callable[[int], None] | None = None,
    allocate: Callable[[ChunkHeader], np.ndarray] | None = None,
    on_wait: OnWait | None = None,
    verify: str | None = None,
) -> Generator[tuple[ChunkHeader, np.ndarray], None, None]:
    """``(header, uint8 buffer)`` of each tensor of ``names``, in stream order, as it lands.

    The stream is ``receive``'s (same ``open_chunks``, ``params``, retries and ``verify``),
    run on a thread inside ``receiving`` (the transport's preparation for the load)."""
    window = _Window(window_bytes)
    arrived: queue.Queue[object] = queue.Queue()  # unbounded: the window bounds it
    place = allocate or (lambda header: aligned_empty(header.total_bytes))

    def windowed(header: ChunkHeader) -> np.ndarray:
        window.reserve(header.total_bytes)
        return place(header)

    def run() -> None:
        try:
            with receiving:
                receive(
                    open_chunks,
                    params,
                    names,
                    retries=retries,
                    retry_seconds=retry_seconds,
                    on_bytes=on_bytes,
                    allocate=windowed,
                    on_wait=on_wait,
                    on_tensor=arrived.put,
                    verify=verify,
                )
        except _Abandoned:
            return
        except BaseException as e:  # handed to the consumer, raised there
            arrived.put(e)
            return
        arrived.put(_END)

    receiver = threading.Thread(target=run, name="weightserve-iter", daemon=True)
    receiver.start()
    try:
        while True:
            item = arrived.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, ReceivedTensor)
            nbytes = item.header.total_bytes
            yield item.header, item.buffer
            del item  # the consumer moved on: drop the buffer before letting more in
            window.release(nbytes)
    finally:
        window.abandon()
        receiver.join()
