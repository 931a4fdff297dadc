"""Bulk tensor fetches of one model (``RemoteModel.fetch`` and ``iter_tensors``): the
tensors asked for as one stream, or a few in parallel split by bytes, or as views of the
node's page cache through the same-node handoff, with what it cannot give streamed in its
place; optionally within a memory window. Never one round trip per tensor.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from weightserve.client._models import ModelInfo, TensorInfo
from weightserve.client._retry import OnWait, WaitsForServer, call_with_retry, retry_seconds_from
from weightserve.client.errors import InvalidRequest, TensorNotFound, TransportError
from weightserve.client.receive.stream import (
    ReceivedTensor,
    arena_allocator,
    receive,
    verify_policy,
)
from weightserve.client.receive.window import iter_received
from weightserve.client.transports.base import DataTransport, StreamParams
from weightserve.client.transports.handoff import Handoff, HandoffClient
from weightserve.client.transports.planes import PlaneChooser, Planes
from weightserve.client.wire.dtypes import numpy_dtype, wire_dtype
from weightserve.client.wire.hints import did_you_mean
from weightserve.client.wire.schema import DEFAULT_CHUNK_BYTES, ChunkHeader

# Loads below this many bytes use one stream: a second one costs a small load a connection, a
# thread and an arena, and on the 2-core bench machine it barely helped large ones
# (docs/performance.md). Above this, parallel streams keep a client with more cores from
# being one thread's pace, each of at least STREAM_MIN_BYTES.
PARALLEL_MIN_BYTES = 256 << 20
STREAM_MIN_BYTES = 128 << 20
PARALLEL_ENV = "WEIGHTSERVE_PARALLEL_STREAMS"
# A stream per four cores the process may run on, from 2 to 4: each stream is a receiving
# thread that copies and hashes at about one core's pace, and the rest of the cores are the
# engine's. 4 at most: eight workers of one node are one client to the server's per-client
# stream limit (16 by default).
MAX_DEFAULT_PARALLEL = 4


def default_parallel() -> int:
    """Concurrent streams for a bulk fetch: ``WEIGHTSERVE_PARALLEL_STREAMS``, else one per
    four cores this process may use (its CPU affinity), from 2 to ``MAX_DEFAULT_PARALLEL``."""
    given = os.environ.get(PARALLEL_ENV)
    if given:
        try:
            value = int(given)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"{PARALLEL_ENV} must be a whole number of at least 1, got {given!r}")
        return value
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(2, min(MAX_DEFAULT_PARALLEL, (cores or 1) // 4))


@dataclass(frozen=True)
class FetchOptions:
    # Concurrent streams for a bulk fetch (split by bytes): default_parallel().
    parallel: int = field(default_factory=default_parallel)
    # At most this many retries of one stream; None: as many as retry_seconds allows.
    retries: int | None = None
    chunk_bytes: int | None = None
    # How long a busy or unreachable server is waited for; None: the client's retry_seconds.
    retry_seconds: float | None = None
    # Chunk digests checked: "full" (every chunk), "sample" (each tensor's first and one in
    # eight of the others) or "none"; default WEIGHTSERVE_VERIFY, else "full" (_receive.py).
    verify: str = field(default_factory=verify_policy)

    def __post_init__(self) -> None:
        verify_policy(self.verify)  # a wrong value fails here, naming the choices


def as_array(t: ReceivedTensor | np.ndarray, info: TensorInfo) -> np.ndarray:
    """The received bytes viewed as the tensor's served dtype and shape (no copy)."""
    buffer = t.buffer if isinstance(t, ReceivedTensor) else t
    spec = wire_dtype(info.dtype)
    if spec.numpy_name is None:  # packed sub-byte types stay raw bytes
        return buffer
    return buffer.view(numpy_dtype(info.dtype)).reshape(info.shape)


@dataclass(frozen=True)
class Receiving:
    """How a fetch cuts and receives its tensors: the like-named arguments of
    ``RemoteModel.fetch`` and ``iter_tensors``."""

    shard: tuple[int, int] | None = None
    axis: int = 0
    on_bytes: Callable[[int], None] | None = None
    allocate: Callable[[ChunkHeader], np.ndarray] | None = None
    on_wait: OnWait | None = None


class FetchingClient(WaitsForServer, Protocol):
    """What a fetch needs of the model's client (``Client`` is one)."""

    @property  # read-only: a client holding a wider one is one too
    def transport(self) -> DataTransport: ...

    data_plane: str
    _planes: PlaneChooser

    def planes(self) -> Planes: ...


class FetchedModel(Protocol):
    """What a fetch needs of the model (``RemoteModel`` is one)."""

    @property
    def client(self) -> FetchingClient: ...

    id: str
    info: ModelInfo
    options: FetchOptions


class TensorFetcher:
    """The fetches of one model; reads the model's id, index and options at each call (a
    caller may change its options)."""

    def __init__(self, model: FetchedModel) -> None:
        self.model = model

    def names(self, prefix: str = "") -> list[str]:
        return [n for n in self.model.info.tensors if n.startswith(prefix)]

    def fetch(
        self, names: Sequence[str] | None, prefix: str | None, how: Receiving
    ) -> dict[str, np.ndarray]:
        """See ``RemoteModel.fetch``."""
        wanted = self.wanted(names, prefix)
        if not wanted:
            return {}
        with self.model.client.transport.receiving(self.bytes_of(wanted)):
            received = self._fetch_parallel(wanted, how)
        return {name: _served(received[name].header, received[name]) for name in wanted}

    def iter_tensors(
        self,
        names: Sequence[str] | None,
        prefix: str | None,
        window_bytes: int,
        how: Receiving,
    ) -> Generator[tuple[str, np.ndarray], None, None]:
        """See ``RemoteModel.iter_tensors``."""
        wanted = self.wanted(names, prefix)  # checked now, not at the first next()
        _check_shard(how.shard)
        if window_bytes < 1:
            raise ValueError(f"window_bytes must be at least 1, got {window_bytes}")
        return self._iterate(wanted, window_bytes, how)

    def _iterate(
        self, wanted: list[str], window_bytes: int, how: Receiving
    ) -> Generator[tuple[str, np.ndarray], None, None]:
        if not wanted:
            return
        planes = self.model.client.planes()
        handoff = planes.handoff
        handed = self._handoff(handoff, wanted, how) if handoff else None
        if handed is not None:
            yield from self._iterate_handed(handed, planes.streams, wanted, window_bytes, how)
            return
        received = self._windowed(planes.streams, wanted, window_bytes, how)
        try:
            for h, buffer in received:
                yield h.name, _served(h, buffer)
                del buffer  # the iterator holds no view once the consumer moves on
        finally:
            received.close()

    def _iterate_handed(
        self,
        handed: Handoff,
        streams: DataTransport,
        wanted: list[str],
        window_bytes: int,
        how: Receiving,
    ) -> Generator[tuple[str, np.ndarray], None, None]:
        """Handed-off views (no window to bound: they are the node's page cache) and, in
        their places in stream order, the tensors the handoff could not give (strided
        sources), streamed within the window."""
        placed = _taken(handed, how.on_bytes, how.allocate)
        copied = [n for n in wanted if n in set(handed.copy)]
        streamed = self._windowed(streams, copied, window_bytes, how) if copied else iter(())
        try:
            for name in wanted:
                if name in placed:
                    r = placed.pop(name)
                    h, buffer = r.header, r.buffer
                    del r
                else:
                    h, buffer = next(streamed)
                yield h.name, _served(h, buffer)
                del buffer
        finally:
            close = getattr(streamed, "close", None)
            if close is not None:
                close()

    def _windowed(
        self, streams: DataTransport, names: list[str], window_bytes: int, how: Receiving
    ) -> Generator[tuple[ChunkHeader, np.ndarray], None, None]:
        """One stream of ``names`` over ``streams``, received within the window."""
        return iter_received(
            lambda p: streams.open_chunks(self.model.id, p),
            self._stream_params(names, how, streams),
            names,
            window_bytes=window_bytes,
            receiving=streams.receiving(min(window_bytes, self.bytes_of(names))),
            retries=self.model.options.retries,
            retry_seconds=self._retry_seconds(),
            on_bytes=how.on_bytes,
            allocate=how.allocate,
            on_wait=how.on_wait or self.model.client.on_wait,
            verify=self.model.options.verify,
        )

    def _stream_params(
        self, names: list[str], how: Receiving, streams: DataTransport
    ) -> StreamParams:
        """A stream request for ``names``, pinned to the revision the index was read at; in
        the transport's bulk chunks unless the options set the chunk, or the request is at
        most one default chunk (a small tensor keeps its fastest route)."""
        chunk_bytes = self.model.options.chunk_bytes
        if chunk_bytes is None and self.bytes_of(names) > DEFAULT_CHUNK_BYTES:
            chunk_bytes = streams.bulk_chunk_bytes
        return StreamParams(
            names=tuple(names),
            shard=how.shard,
            axis=how.axis,
            chunk_bytes=chunk_bytes,
            revision=self.model.info.revision,
        )

    def wanted(self, names: Sequence[str] | None, prefix: str | None) -> list[str]:
        """The tensors asked for: ``names`` (each checked to exist), else those under
        ``prefix`` (``None``: every tensor)."""
        if names is None:
            return self.names(prefix or "")
        wanted = list(names)
        for n in wanted:
            if n not in self.model.info.tensors:
                hint = did_you_mean(n, self.model.info.tensors)
                raise TensorNotFound(f"No weight named {n!r} in model {self.model.id!r}.{hint}")
        return wanted

    def _retry_seconds(self) -> float:
        if self.model.options.retry_seconds is not None:
            return retry_seconds_from(self.model.options.retry_seconds)
        return self.model.client.retry_seconds

    def _part_bound(self, name: str, shard: tuple[int, int] | None, axis: int) -> int:
        """Bytes of the tensor's part in a shard, or a close upper bound of them."""
        info = self.model.info.tensors[name]
        if shard is None or info.encoding is not None or len(info.shape) <= axis:
            return info.nbytes  # whole, or GGML blocks (split in whole blocks): at most all
        length = info.shape[axis]
        if length == 0:
            return 0
        # numpy.array_split: the largest part has ceil(length / n) slices along the axis
        return -(-length // shard[1]) * (info.nbytes // length)

    def bytes_of(self, names: list[str]) -> int:
        return sum(self.model.info.tensors[n].nbytes for n in names)

    def _groups(self, names: list[str]) -> list[list[str]]:
        """Split into up to ``parallel`` groups of about equal bytes, keeping stream order."""
        total = self.bytes_of(names)
        parallel = min(max(1, self.model.options.parallel), total // STREAM_MIN_BYTES)
        if parallel <= 1 or len(names) < 2 or total < PARALLEL_MIN_BYTES:
            return [names]
        groups: list[list[str]] = [[]]
        target, acc = total / parallel, 0
        for n in names:
            if acc >= target * len(groups) and len(groups) < parallel:
                groups.append([])
            groups[-1].append(n)
            acc += self.model.info.tensors[n].nbytes
        return [g for g in groups if g]

    def _fetch_parallel(self, names: list[str], how: Receiving) -> dict[str, ReceivedTensor]:
        _check_shard(how.shard)
        planes = self.model.client.planes()
        if planes.handoff is not None:
            handed = self._handoff(planes.handoff, names, how)
            if handed is not None:
                result = _taken(handed, how.on_bytes, how.allocate)
                if handed.copy:  # strided sources: not a byte range of a file
                    rest = [n for n in names if n in set(handed.copy)]
                    result.update(self._fetch_streams(rest, how))
                return result
        return self._fetch_streams(names, how)

    def _handoff(self, handoff: HandoffClient, names: list[str], how: Receiving) -> Handoff | None:
        """The tensors as views of the node's page cache, or None when the handoff socket
        stopped answering (the client copies over a stream from then on)."""
        verify = self.model.options.verify
        try:
            return call_with_retry(
                lambda: handoff.open(
                    self.model.id, names=names, shard=how.shard, axis=how.axis,
                    revision=self.model.info.revision, verify=verify,
                ),
                self._retry_seconds(),
                f"{handoff.path} model {self.model.id!r}",
                how.on_wait or self.model.client.on_wait,
            )  # fmt: skip
        except TransportError as e:
            self.model.client._planes.handoff_failed(e)
            if self.model.client.data_plane == "handoff":
                raise
            return None

    def _fetch_streams(self, names: list[str], how: Receiving) -> dict[str, ReceivedTensor]:
        transport = self.model.client.planes().streams
        groups = self._groups(names)
        retry_seconds = self._retry_seconds()
        on_bytes = how.on_bytes
        counted = on_bytes
        if on_bytes is not None and len(groups) > 1:
            progress_lock = threading.Lock()

            def counted(n: int) -> None:  # one stream per thread, one caller's callback
                with progress_lock:
                    on_bytes(n)

        def one(group: list[str]) -> dict[str, ReceivedTensor]:
            params = self._stream_params(group, how, transport)
            place = how.allocate
            if place is None and len(group) > 1:
                # One tensor alone gets the same aligned buffer without an arena.
                place = arena_allocator(
                    {n: self._part_bound(n, how.shard, how.axis) for n in group}
                )
            return receive(
                lambda p: transport.open_chunks(self.model.id, p),
                params,
                group,
                retries=self.model.options.retries,
                retry_seconds=retry_seconds,
                on_bytes=counted,
                allocate=place,
                on_wait=how.on_wait or self.model.client.on_wait,
                verify=self.model.options.verify,
            )

        if len(groups) == 1:
            return one(groups[0])
        result: dict[str, ReceivedTensor] = {}
        with ThreadPoolExecutor(len(groups), thread_name_prefix="weightserve-fetch") as pool:
            for part in pool.map(one, groups):
                result.update(part)
        return result


def _check_shard(shard: tuple[int, int] | None) -> None:
    if shard is not None and not 0 <= shard[0] < shard[1]:
        raise InvalidRequest(f"shard {shard[0]}/{shard[1]}: need 0 <= index < count")


def _served(h: ChunkHeader, buffer: ReceivedTensor | np.ndarray) -> np.ndarray:
    """A received tensor as its header says it was served (dtype and shape; no copy)."""
    info = TensorInfo(h.name, h.dtype, h.shape, h.logical_shape, h.encoding, h.total_bytes)
    return as_array(buffer, info)


def _taken(
    handed: Handoff,
    on_bytes: Callable[[int], None] | None,
    allocate: Callable[[ChunkHeader], np.ndarray] | None,
) -> dict[str, ReceivedTensor]:
    """A handoff's tensors, counted as arrived, as they are (read-only views of the page
    cache), or copied into the caller's buffers when it gives ``allocate`` (an output file,
    pinned memory): the one copy the caller asked for. The handoff keeps none of them."""
    tensors, handed.tensors = handed.tensors, {}
    if on_bytes is not None and handed.nbytes:
        on_bytes(handed.nbytes)
    if allocate is None:
        return tensors
    placed = {}
    for name, t in tensors.items():
        buffer = allocate(t.header)
        np.copyto(buffer[: t.header.total_bytes], t.buffer)
        own = ReceivedTensor(t.header, buffer[: t.header.total_bytes])
        own.received = t.received
        placed[name] = own
    return placed
