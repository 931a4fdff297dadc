"""The client end of the same-node zero-copy handoff (server: service/transports/handoff.py).

The server passes descriptors; this side maps each one read-only once and hands out NumPy
views of the tensors' byte ranges, so every process on the node reads one copy in memory and
no tensor byte goes through a socket. What a load returns never changes afterwards: a
descriptor is mapped only when its bytes cannot change, a memfd sealed against writes,
shrinking and growing (checked here, ``F_GET_SEALS``) or a file the server marks as its own
(the node cache's, written once and replaced only by rename). Any other descriptor (a file of
the model root, or from an older server) is not mapped: its ranges are copied out (``pread``,
so a truncation ends the read instead of faulting) and every chunk of the copy is verified.

The arrays of mapped descriptors are flagged read-only (they are the node's shared pages).
The mappings are private (copy on write), so an engine that insists on writable memory
(MAX's ``Buffer.from_dlpack`` copies a read-only array, torch warns) can be given
``writable_alias(array)`` instead of a copy: a write then changes a private copy of that one
page, never the shared bytes or another process's view.

Before the arrays are handed out, the bytes are checked as a stream's are (chunk digests, as
``verify`` says) and a descriptor that is not sealed is checked to be the version the server
described (size and modification time): a file written in place meanwhile fails the handoff
with ``ModelUnavailable`` (the caller tries again and gets the new revision).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from weightserve.client.errors import ModelUnavailable, TransportError, WeightserveError
from weightserve.client.receive.stream import (
    ReceivedTensor,
    aligned_empty,
    chunk_checker,
    verify_policy,
)
from weightserve.client.transports.base import wire_error_from_json
from weightserve.client.wire.handoff import (
    FILE_COPY,
    FILE_OWNED,
    FILE_SEALED,
    HandoffProtocolError,
    encode_frame,
    read_fds,
    read_frame,
)
from weightserve.client.wire.schema import ChunkHeader

log = logging.getLogger("weightserve.client")

# Linux 5.14+: fault the range's page-cache pages into the page table in one call (no copy).
_MADV_POPULATE_READ = 22
_PAGE = mmap.PAGESIZE
# The memfd seals that make bytes immutable (Linux); elsewhere nothing counts as sealed.
_IMMUTABLE_SEALS = (
    getattr(fcntl, "F_SEAL_WRITE", 0)
    | getattr(fcntl, "F_SEAL_SHRINK", 0)
    | getattr(fcntl, "F_SEAL_GROW", 0)
)
RELOAD_WAIT = 0.5  # seconds before asking again after a file changed under a handoff
CONNECT_BUSY_SECONDS = 2.0  # how long a connect waits out the server's full accept queue


# Live handoff mappings by start address: (length, the mapping), for writable_alias.
_MAPPINGS: dict[int, tuple[int, weakref.ref[mmap.mmap]]] = {}
_MAPPINGS_LOCK = threading.Lock()


def _register(m: mmap.mmap, length: int) -> None:
    start = np.frombuffer(m, dtype=np.uint8, count=1).ctypes.data
    with _MAPPINGS_LOCK:
        _MAPPINGS[start] = (length, weakref.ref(m))
    weakref.finalize(m, _forget, start)


def _forget(start: int) -> None:
    with _MAPPINGS_LOCK:
        _MAPPINGS.pop(start, None)


def writable_alias(arr: np.ndarray) -> np.ndarray | None:
    """A writable array over the same memory as ``arr`` when ``arr`` is a view of a handoff
    mapping (copy on write: writes stay in this process), else None. It keeps the mapping
    alive. For engines that copy read-only arrays; nothing is copied here."""
    if arr.flags.writeable or not arr.flags.c_contiguous:
        return None
    address, nbytes = arr.ctypes.data, arr.nbytes
    with _MAPPINGS_LOCK:
        found = [
            (start, ref)
            for start, (length, ref) in _MAPPINGS.items()
            if start <= address and address + nbytes <= start + length
        ]
    for start, ref in found:
        m = ref()
        if m is not None:
            alias = np.frombuffer(m, dtype=np.uint8, count=nbytes, offset=address - start)
            return alias.view(arr.dtype).reshape(arr.shape)
    return None


def handoff_socket_path(http_socket: str) -> str:
    """The handoff socket beside a server's HTTP socket (``--uds PATH`` serves both)."""
    return http_socket + ".handoff"


def _populate(m: mmap.mmap, start: int, length: int) -> None:
    """Map a range's pages now: one call instead of a fault per 64 KiB as they are read."""
    if length <= 0:
        return
    aligned = start - start % _PAGE
    try:
        m.madvise(_MADV_POPULATE_READ, aligned, length + start - aligned)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOSYS):
            raise
        m.madvise(mmap.MADV_WILLNEED, aligned, length + start - aligned)  # older kernels


@dataclass(frozen=True)
class HandedFile:
    """One descriptor a handoff passed: how its bytes were taken (``sealed`` or ``owned``:
    mapped; ``copy``: copied out) and its identity (st_dev, st_ino), the same in every
    process given the same snapshot."""

    name: str
    kind: str
    identity: tuple[int, int]


@dataclass
class Handoff:
    """What one handoff gave: tensors (read-only views, or copies), the descriptors they came
    from, and the names to fetch over a stream instead."""

    revision: str
    tensors: dict[str, ReceivedTensor] = field(default_factory=dict)
    copy: list[str] = field(default_factory=list)
    files: list[HandedFile] = field(default_factory=list)
    nbytes: int = 0


class HandoffClient:
    """Handoffs from the server behind one Unix socket (a connection per handoff: they are
    cheap on one node, and parallel loads from several threads need no shared state)."""

    def __init__(self, path: str, token: str | None = None, timeout: float = 60.0) -> None:
        self.path = path
        self.token = token
        self.timeout = timeout

    def _connect(self) -> socket.socket:
        # A full accept queue answers EAGAIN at once (a Unix socket does not wait): a burst of
        # ranks connecting together waits a moment for the server to accept.
        deadline = time.monotonic() + min(self.timeout, CONNECT_BUSY_SECONDS)
        delay = 0.001
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(self.path)
                return sock
            except BlockingIOError:
                sock.close()
                if time.monotonic() >= deadline:
                    raise TransportError(
                        f"handoff socket {self.path} stayed busy "
                        f"for {CONNECT_BUSY_SECONDS:g} s (its accept queue is full)"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
            except OSError as e:
                sock.close()
                # Not ServerUnreachable: a missing socket is not waited out; the client copies
                # over another plane instead (client/transports/planes.py).
                raise TransportError(
                    f"no weightserve handoff socket at {self.path} ({e.strerror or e})"
                ) from None

    def hello(self) -> dict[str, Any]:
        """The server's instance id and version (to match a socket to a server)."""
        sock = self._connect()
        try:
            sock.sendall(encode_frame({"op": "hello"}))
            answer = read_frame(sock)
        except (OSError, HandoffProtocolError) as e:
            raise TransportError(f"handoff socket {self.path}: {e}") from None
        finally:
            sock.close()
        if answer is None:
            raise TransportError(f"handoff socket {self.path} closed the connection")
        _raise_if_error(answer, self.path)
        return answer

    def open(
        self,
        model: str,
        *,
        names: list[str] | None = None,
        prefix: str | None = None,
        shard: tuple[int, int] | None = None,
        axis: int = 0,
        revision: str | None = None,
        verify: str | None = None,
    ) -> Handoff:
        """Tensors of ``model`` by names or prefix (a shard along an axis whose part is one
        byte range comes as a view too), verified as ``verify`` says."""
        verify = verify_policy(verify)  # a wrong value fails before any connection
        # can_copy: descriptors that are neither sealed nor the server's own are copied out
        # here; without it (older clients) the server sends such tensors over a stream.
        request: dict[str, Any] = {
            "op": "open", "model": model, "revision": revision, "can_copy": True,
        }  # fmt: skip
        if names is not None:
            request["names"] = list(names)
        else:
            request["prefix"] = prefix or ""
        if shard is not None:
            request["shard"], request["axis"] = list(shard), axis
        if self.token:
            request["token"] = self.token
        sock = self._connect()
        fds: list[int] = []
        try:
            sock.sendall(encode_frame(request))
            answer = read_frame(sock, fds)
            if answer is None:
                raise TransportError(f"handoff socket {self.path} closed the connection")
            _raise_if_error(answer, self.path)
            read_fds(sock, fds, len(answer["files"]))
            result = _map_and_check(answer, fds, verify)
            # The server holds the files' leases until now: an in-place writer waited.
            sock.sendall(encode_frame({"op": "done"}))
            return result
        except (OSError, HandoffProtocolError) as e:
            raise TransportError(f"handoff from {self.path} broke: {e}") from None
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            sock.close()


def _raise_if_error(answer: dict[str, Any], path: str) -> None:
    """The server's error, when its answer is one (``{"error": {"type", "message",
    "retry_after"}}``), as the same class it raised."""
    error = answer.get("error")
    if not error:
        return
    found = wire_error_from_json(error, older_class_key="class")
    if found is None:
        raise TransportError(f"handoff socket {path} answered an error this client cannot read")
    raise found.exception()


def _sealed(fd: int) -> bool:
    """Whether ``fd`` is a memfd sealed against writes, shrinking and growing: its bytes can
    never change, whoever holds it."""
    if not _IMMUTABLE_SEALS:
        return False
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # not a memfd (EINVAL)
        return False
    return seals & _IMMUTABLE_SEALS == _IMMUTABLE_SEALS


def _kind(fd: int, described: dict[str, Any]) -> str:
    """How this client takes a passed file's bytes: mapped when sealed (checked here) or the
    server's own file; anything else, whatever the server says, copied."""
    if _sealed(fd):
        return FILE_SEALED
    return FILE_OWNED if described.get("kind") == FILE_OWNED else FILE_COPY


def _copy_range(fd: int, buffer: np.ndarray, offset: int, name: str) -> None:
    """Read ``buffer``'s length from ``fd`` at ``offset`` (``pread``: a truncated file ends
    the read short instead of faulting, as a mapping would)."""
    view, done = buffer.data, 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise ModelUnavailable(
                f"{name} was truncated during the handoff; the model reloads on its next request",
                retry_after=RELOAD_WAIT,
            )
        done += n


def _map_and_check(answer: dict[str, Any], fds: list[int], verify: str) -> Handoff:
    files = answer["files"]
    maps: list[mmap.mmap | None] = []  # None: the file's ranges are copied
    out = Handoff(answer["revision"], copy=list(answer.get("copy", [])))
    for fd, f in zip(fds, files, strict=True):
        st = os.fstat(fd)
        if st.st_size < f["size"]:
            raise ModelUnavailable(
                f"{f['name']} was truncated; the model reloads on its next request",
                retry_after=RELOAD_WAIT,
            )
        kind = _kind(fd, f)
        out.files.append(HandedFile(f["name"], kind, (st.st_dev, st.st_ino)))
        if kind == FILE_COPY:
            maps.append(None)
            continue
        # Private: reads share the node's one copy, a write (by an engine given
        # writable_alias) copies that page for this process alone.
        m = mmap.mmap(fd, f["size"], access=mmap.ACCESS_COPY)
        _register(m, f["size"])
        maps.append(m)
    copied: list[tuple[dict[str, Any], np.ndarray]] = []
    try:
        for t in answer["tensors"]:
            total = t["nbytes"]
            header = ChunkHeader(
                t["name"], t["dtype"], tuple(t["shape"]), tuple(t["logical_shape"]),
                t["encoding"], 0, total, 0, total,
            )  # fmt: skip
            if t["file"] is None:
                buffer = np.empty(0, dtype=np.uint8)
                buffer.flags.writeable = False
            elif (m := maps[t["file"]]) is None:
                buffer = aligned_empty(total)
                _copy_range(fds[t["file"]], buffer, t["offset"], files[t["file"]]["name"])
                copied.append((t, buffer))
            else:
                _populate(m, t["offset"], total)
                buffer = np.frombuffer(m, dtype=np.uint8, count=total, offset=t["offset"])
                buffer.flags.writeable = False
                _check_digests(t, buffer, verify)
            received = ReceivedTensor(header, buffer)
            received.received = total
            out.tensors[t["name"]] = received
            out.nbytes += total
        # After reading: a write in place changes the modification time before it changes
        # bytes, so unchanged times mean the bytes read (and hashed) are of this version.
        # A sealed memfd cannot change at all.
        for fd, f, handed in zip(fds, files, out.files, strict=True):
            if handed.kind == FILE_SEALED:
                continue
            st = os.fstat(fd)
            if [st.st_size, st.st_mtime_ns] != f["stamp"]:
                raise ModelUnavailable(
                    f"{f['name']} was written in place during the handoff; the model reloads "
                    "on its next request",
                    retry_after=RELOAD_WAIT,
                )
        # Copies are checked whole whatever ``verify`` says: nothing guarantees their source.
        for t, buffer in copied:
            _check_digests(t, buffer, "full")
    except WeightserveError:
        out.tensors.clear()  # drop the views so the mappings can go
        raise
    return out


def _check_digests(t: dict[str, Any], buffer: np.ndarray, verify: str) -> None:
    """The stream's policy, applied to the server's chunk digests of this tensor."""
    check = chunk_checker(verify)
    step, data = t["chunk_bytes"], buffer.data
    for i, digest in enumerate(t["digests"]):
        check(t["name"], i * step, digest, data[i * step : (i + 1) * step])
