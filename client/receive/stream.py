"""Receive a tensor stream into final buffers: one buffer per tensor, chunks placed in it
directly, chunk digests checked as ``verify`` says, a broken stream resumed from the last
good chunk.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import xxhash

from weightserve.client._retry import DEFAULT_RETRY_SECONDS, Backoff, OnWait
from weightserve.client.errors import DataCorruption, TransportError, WeightserveError
from weightserve.client.transports.base import ChunkReader, StreamParams
from weightserve.client.wire.schema import ChunkHeader

log = logging.getLogger("weightserve.client")

ALIGNMENT = 64  # MAX checks CPU weight alignment by address; 64 covers every dtype and GGUF

VERIFY_CHOICES = ("full", "sample", "none")
VERIFY_ENV = "WEIGHTSERVE_VERIFY"
SAMPLE_ONE_IN = 8  # verify="sample": chunks past the first checked, one in this many


def verify_policy(value: str | None = None) -> str:
    """The digest policy: ``value``, else ``WEIGHTSERVE_VERIFY``, else ``"full"``."""
    source = "verify"
    if value is None:
        value = os.environ.get(VERIFY_ENV) or "full"
        source = VERIFY_ENV
    if value not in VERIFY_CHOICES:
        raise ValueError(f"{source} must be one of {', '.join(VERIFY_CHOICES)}, got {value!r}")
    return value


def sampled(name: str, offset: int) -> bool:
    """Whether ``verify="sample"`` checks the chunk at byte ``offset`` of tensor ``name``:
    every tensor's first chunk, and one in ``SAMPLE_ONE_IN`` of the others, picked by a hash
    of name and offset, so the same chunks on every load, in every process."""
    if offset == 0:
        return True
    return xxhash.xxh3_64_intdigest(f"{name}\0{offset}".encode()) % SAMPLE_ONE_IN == 0


def chunk_checker(verify: str | None = None) -> Callable[[str, int, int, Any], bool]:
    """``check(name, offset, digest, data)`` for the policy ``verify`` (``verify_policy``):
    checks the chunk's xxh3-64 when the policy picks it, raising ``DataCorruption`` on a
    mismatch, and says whether it checked. Every data path applies its policy through this.
    ``"full"`` checks every chunk (~0.08 CPU-s/GiB on the bench machine), ``"sample"`` the
    chunks ``sampled`` picks, ``"none"`` none (the transport's own checksums remain: TCP's,
    and TLS's integrity where used)."""
    policy = verify_policy(verify)

    def check(name: str, offset: int, digest: int, data: Any) -> bool:
        if policy == "none" or (policy == "sample" and not sampled(name, offset)):
            return False
        if xxhash.xxh3_64_intdigest(data) != digest:
            raise DataCorruption(
                f"tensor {name!r}: bytes {offset}..{offset + len(data)} do not match their digest"
            )
        return True

    return check


def aligned_empty(nbytes: int, alignment: int = ALIGNMENT) -> np.ndarray:
    """A writable uint8 buffer whose address is a multiple of ``alignment``."""
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start : start + nbytes]


def arena_allocator(sizes: dict[str, int]) -> Callable[[ChunkHeader], np.ndarray]:
    """Place every tensor of one stream in one aligned arena.

    ``sizes`` gives each tensor's size, or an upper bound of it (a shard's part). One large
    allocation instead of one per tensor: NumPy asks the kernel for transparent huge pages
    on allocations of 4 MiB and more, so faulting in the destination costs one fault per
    2 MiB instead of one per 4 KiB page — for the many tensors below 4 MiB too (bench:
    fresh-memory faults were the largest client cost). Each array is a view that keeps the
    arena alive; pages of the arena no tensor uses are never touched, so memory stays about
    the bytes fetched.
    """
    offsets: dict[str, int] = {}
    position = 0
    for name, n in sizes.items():
        offsets[name] = position
        position += -(-n // ALIGNMENT) * ALIGNMENT
    arena = aligned_empty(position)

    def allocate(header: ChunkHeader) -> np.ndarray:
        start = offsets.get(header.name)
        if start is None or header.total_bytes > sizes[header.name]:
            return aligned_empty(header.total_bytes)  # not what the index said: own buffer
        return arena[start : start + header.total_bytes]

    return allocate


class ReceivedTensor:
    """A tensor's bytes as they arrive, and what the stream said about them."""

    __slots__ = ("header", "buffer", "received")

    def __init__(self, header: ChunkHeader, buffer: np.ndarray) -> None:
        self.header = header
        self.buffer = buffer  # uint8, exactly total_bytes long
        self.received = 0

    @property
    def complete(self) -> bool:
        return self.received == self.header.total_bytes


def receive(
    open_chunks: Callable[[StreamParams], ChunkReader],
    params: StreamParams,
    expected: Sequence[str],
    *,
    retries: int | None = None,
    retry_seconds: float = DEFAULT_RETRY_SECONDS,
    on_bytes: Callable[[int], None] | None = None,
    allocate: Callable[[ChunkHeader], np.ndarray] | None = None,
    on_wait: OnWait | None = None,
    on_tensor: Callable[[ReceivedTensor], None] | None = None,
    verify: str | None = None,
) -> dict[str, ReceivedTensor]:
    """Fetch ``expected`` tensors (in stream order) with resume on breaks.

    ``params`` must pin the model revision so a resumed transfer never mixes two revisions.
    ``allocate`` gives the buffer for a tensor from its first chunk's header (default: fresh
    aligned memory; ``weightserve pull`` passes slices of the output file instead).
    A busy server, one that cannot be reached and a broken stream are tried again with
    backoff (client/_retry.py) while no data flows for up to ``retry_seconds``, and at most
    ``retries`` times in all when given; ``on_wait`` hears of each wait.
    ``on_tensor`` is handed each tensor as soon as it is complete and verified; the result
    then keeps none of them, so their buffers live only as long as the callee keeps them.
    ``verify`` says which chunk digests are checked (``chunk_checker``).
    """
    check = chunk_checker(verify)
    done: dict[str, ReceivedTensor] = {}
    handed_over: set[str] = set()  # complete tensors given to on_tensor and not kept
    partial: ReceivedTensor | None = None  # the tensor being received; kept across resumes

    def destination(header: ChunkHeader) -> memoryview:
        nonlocal partial
        if partial is None or partial.header.name != header.name:
            buffer = allocate(header) if allocate else aligned_empty(header.total_bytes)
            partial = ReceivedTensor(header, buffer)
        if header.offset != partial.received or header.total_bytes != len(partial.buffer):
            raise TransportError(
                f"tensor {header.name!r}: chunk at byte {header.offset} of "
                f"{header.total_bytes}, expected {partial.received} of {len(partial.buffer)}"
            )
        return partial.buffer.data[header.offset : header.offset + header.nbytes]

    attempt = 0
    backoff = Backoff(retry_seconds)
    request = params
    while True:
        reader: ChunkReader | None = None
        try:
            # Inside the try: a server restarting refuses connections for a moment, and
            # reconnecting is what the retries are for.
            reader = open_chunks(request)
            reader.read_schema()
            while (header := reader.next_chunk(destination)) is not None:
                assert partial is not None
                chunk = partial.buffer.data[header.offset : header.offset + header.nbytes]
                check(header.name, header.offset, header.digest, chunk)
                partial.received += header.nbytes
                backoff.reset()  # data flows: a later outage gets the whole budget again
                if on_bytes is not None:
                    on_bytes(header.nbytes)
                if partial.complete:
                    partial.header = replace_header(header)
                    if on_tensor is None:
                        done[header.name] = partial
                        partial = None
                    else:
                        handed_over.add(header.name)
                        complete, partial = partial, None
                        del chunk  # hold no view of a handed-over buffer
                        on_tensor(complete)
                        del complete
            missing = [n for n in expected if n not in done and n not in handed_over]
            if missing:
                raise TransportError(
                    f"stream ended without {len(missing)} tensors, e.g. {missing[0]!r}"
                )
            return done
        except WeightserveError as e:
            if reader is not None:  # before the back-off sleep, not after it
                reader.close()
                reader = None
            attempt += 1
            if retries is not None and attempt > retries:
                raise
            reason, delay = backoff.retry_wait(e)
            remaining = [n for n in expected if n not in done and n not in handed_over]
            if partial is not None and partial.header.name in remaining:
                request = replace(
                    params, resume_tensor=partial.header.name, resume_offset=partial.received
                )
            elif remaining:
                request = replace(params, resume_tensor=remaining[0], resume_offset=0)
            else:
                return done
            # A busy server is expected in a crowd (and shown through on_wait): no warning.
            log.log(
                logging.INFO if reason == "server busy" else logging.WARNING,
                "%s (%s); trying again from %s byte %d in %.1f s (retry %d)",
                reason,
                e,
                request.resume_tensor,
                request.resume_offset,
                delay,
                attempt,
            )
            backoff.sleep(reason, delay, on_wait)
        finally:
            # Every way out, an error the caller sees included: an open stream holds a
            # slot on the server until it is cancelled.
            if reader is not None:
                reader.close()


def replace_header(header: ChunkHeader) -> ChunkHeader:
    """The tensor-level header (offset 0, whole size) for a completed tensor."""
    return ChunkHeader(
        header.name,
        header.dtype,
        header.shape,
        header.logical_shape,
        header.encoding,
        0,
        header.total_bytes,
        0,
        header.total_bytes,
    )
