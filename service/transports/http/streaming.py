"""How an HTTP answer streams: tensor data (an Arrow IPC stream) and files' bytes, sent with an
exact Content-Length (no chunked-encoding copy) and cut when the client goes away or stalls.

On plain TCP or a Unix socket under uvicorn the body goes out through ``_SocketWriter``:
tensor and file bytes with ``sendfile`` from the checkpoint file to a peer on another host,
copied from the file's mapping for one on this host (``--sendfile``, ``sendfile_to``), the
framing around them with ``writev``, no copy in user space. ``WeightserveApp`` is the
outermost ASGI layer, which notes uvicorn's connection where the writer finds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib
import ipaddress
import logging
import mmap
import os
import select
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import anyio
import anyio.to_thread
from fastapi import FastAPI
from fastapi.responses import Response

from weightserve.client.errors import ModelUnavailable, WeightserveError
from weightserve.client.wire import socket_loops
from weightserve.client.wire.schema import ARROW_STREAM_MEDIA_TYPE
from weightserve.client.wire.socket_loops import (
    WRITE_FILE_ENDED,
    WRITE_TIMED_OUT,
    _socketio,
)
from weightserve.service.config import SendfileMode
from weightserve.service.serving.lease import StreamLease
from weightserve.service.serving.streams import FileMessage, MessageStream
from weightserve.service.transports.http.body_reader import SocketBodyReader, plain_socket
from weightserve.service.transports.http.common import ERROR_KEY
from weightserve.service.transports.http.one_write import one_write

log = logging.getLogger("weightserve.http")


# An ASGI stream gives the event loop a turn after this many tensor bytes (see below).
PAUSE_EVERY_BYTES = 8 << 20
# A direct write's batch on its worker thread: a hop to the thread and back costs the event
# loop more than the batch's own Python, and a client gone fails the write itself, so the
# batch is large (docs/performance.md, "Where the time goes").
DIRECT_BATCH_BYTES = 64 << 20


class ArrowStreamResponse(Response):
    """Writes the stream's pieces as they come; stops early when the client goes away, and
    closes the stream's lease (slot, files, idle cut, bytes served) when it ends."""

    media_type = ARROW_STREAM_MEDIA_TYPE

    def __init__(
        self,
        lease: StreamLease,
        messages: Iterator,
        length: int,
        headers: dict[str, str],
        status_code: int = 200,
        media_type: str | None = None,
    ) -> None:
        # The files API sends a file's bytes (or a 206 range of them) the same way, as
        # messages ``(b"", data)``: the data part is what the bytes-served metric counts.
        super().__init__(
            content=None,
            status_code=status_code,
            headers={**headers, "content-length": str(length)},
            media_type=media_type or self.media_type,
        )
        self.lease = lease
        self.messages = messages
        self.length = length

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.length < DIRECT_WRITE_MIN_BYTES:
            return await self._send_whole(scope, send)

        gone = _client_gone(receive)
        lease = self.lease
        pause_at = PAUSE_EVERY_BYTES
        idle = _TaskIdleCut(lease)
        writer: _SocketWriter | None = None
        job: Future | None = None  # the writer's batch on its thread
        pool = _writer_pool(scope, lease.state.limits.max_streams)
        try:
            start = {"type": "http.response.start", "status": self.status_code}
            await send({**start, "headers": self.raw_headers})
            if pool is not None:
                writer = await _SocketWriter.attach(scope, lease.state.limits.idle_timeout)
            if writer is not None:
                assert pool is not None
                idle.watch.close()  # the writer enforces the idle timeout itself
                if isinstance(self.messages, MessageStream):
                    # sendfile reports a truncation itself (a short send), and nothing here
                    # reads a known chunk: the files are checked once per batch.
                    self.messages.checks.every_bytes = DIRECT_BATCH_BYTES
                # Messages are taken (digests included) and written on a worker thread, a
                # batch per hop; between batches the loop runs and a client gone is noticed.
                while not gone.done():
                    job = pool.submit(writer.write_some, self.messages)
                    written, finished = await asyncio.wrap_future(job)
                    lease.progress(written)
                    if finished:
                        break
                else:
                    scope[ERROR_KEY] = "Cancelled"
                    return
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            for message in self.messages:
                if gone.done():
                    scope[ERROR_KEY] = "Cancelled"
                    break
                if len(message) > 1:
                    lease.progress(len(message[1]))  # tensor data bytes, not framing
                    if lease.sent >= pause_at:
                        # uvicorn's send returns without yielding while the socket takes the
                        # bytes, and after a client resets until the loop runs connection_lost:
                        # without a pause, a client that left gets the rest of the stream
                        # read, hashed and written into the void, with the loop blocked.
                        pause_at = lease.sent + PAUSE_EVERY_BYTES
                        await asyncio.sleep(0)
                for part in message:
                    if not part:
                        continue
                    if isinstance(part, memoryview) and isinstance(part.obj, mmap.mmap):
                        # Tensor bytes, read from the mapping when written. A send may wait
                        # (socket full) for as long as the client likes, so wait here with an
                        # empty write, then check the file still covers the bytes: reading a
                        # mapped page a truncation removed is SIGBUS, which kills the process.
                        await send({"type": "http.response.body", "body": b"", "more_body": True})
                        _ensure_still_mapped(part.obj)
                    await send({"type": "http.response.body", "body": part, "more_body": True})
                    lease.progress()
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            # Returning with the response incomplete makes uvicorn close the connection.
            _cut_idle(scope, lease, idle)
        except WeightserveError as e:  # e.g. a file truncated while being served
            scope[ERROR_KEY] = type(e).__name__
            log.warning("stream of model %s broke: %s", lease.model_id, e)
        except (OSError, TimeoutError) as e:  # direct writes: the client left or stalled
            scope[ERROR_KEY] = "IdleTimeout" if isinstance(e, TimeoutError) else "Cancelled"
            log.warning(
                "stream of model %s to %s cut: %s",
                lease.model_id,
                (scope.get("client") or ("?",))[0],
                e,
            )
        finally:
            if writer is not None:
                await _release_writer(writer, job)
                metrics = lease.state.metrics
                metrics.child(metrics.http_direct_bytes, "sendfile").inc(writer.sent_from_files)
                metrics.child(metrics.http_direct_bytes, "write").inc(
                    writer.written - writer.sent_from_files
                )
                app = scope.get("app")
                if isinstance(app, WeightserveApp):
                    app.open_writers.discard(writer)
                    app.direct_bytes += writer.written
                    app.sendfile_bytes += writer.sent_from_files
            gone.cancel()
            lease.close()

    async def _send_whole(self, scope: Any, send: Any) -> None:
        """A small stream as one body after its headers, both in one socket write where the
        connection allows (``one_write``): a segment costs more than the whole small
        request's framing and digests (docs/performance.md, "Small requests")."""
        try:
            body, data_bytes = whole_body(self.messages)  # an error: answered with its status
        except BaseException:
            self.lease.close()
            raise
        await send_whole(
            scope, send, self.lease, self.raw_headers, body, data_bytes, self.status_code
        )  # a 206 of the files API too


class LeasedStreamResponse(Response):
    """A body of no length known in advance (the delta stream: its patches are computed as it
    goes), sent chunked under the stream's lease like any data route's: the pieces are taken
    on the threadpool, mapped bytes checked still mapped before they are sent, the idle cut
    armed, the bytes counted; the pieces' iterator is closed before the lease ends (what it
    still reads of the files is done while they are held)."""

    def __init__(
        self,
        lease: StreamLease,
        pieces: Iterator[bytes | memoryview],
        headers: dict[str, str],
        media_type: str,
    ) -> None:
        # Not Response.__init__: it would send Content-Length 0 for a body it is not given.
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)
        self.lease = lease
        self.pieces = pieces

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        gone = _client_gone(receive)
        lease = self.lease
        idle: _TaskIdleCut | None = None
        try:
            idle = _TaskIdleCut(lease)
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            while not gone.done():
                piece = await anyio.to_thread.run_sync(next, self.pieces, None)
                if piece is None:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    lease.finished()
                    break
                if isinstance(piece, memoryview) and isinstance(piece.obj, mmap.mmap):
                    _ensure_still_mapped(piece.obj)  # before the send reads it (SIGBUS)
                await send({"type": "http.response.body", "body": piece, "more_body": True})
                lease.progress(len(piece))
            else:
                scope[ERROR_KEY] = "Cancelled"
        except asyncio.CancelledError:
            _cut_idle(scope, lease, idle)
        except WeightserveError as e:  # e.g. a file changed while its patch was computed
            scope[ERROR_KEY] = type(e).__name__
            log.warning("delta stream of model %s broke: %s", lease.model_id, e)
        finally:
            gone.cancel()
            # On a thread: closing the iterator waits for the diffs it started. Shielded, so a
            # second cancellation still leaves the lease closed once they are done.
            await asyncio.shield(asyncio.get_running_loop().run_in_executor(None, self._end))

    def _end(self) -> None:
        try:
            close = getattr(self.pieces, "close", None)
            if close is not None:
                close()
        finally:
            self.lease.close()


def _client_gone(receive: Any) -> asyncio.Future[None]:
    """Done once the client disconnects (the ASGI ``http.disconnect``): cancel it at the end."""

    async def wait_disconnect() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    return asyncio.ensure_future(wait_disconnect())


def whole_body(messages: Iterator) -> tuple[bytes, int]:
    """A small stream's bytes in one piece, and how many of them are tensor data (what the
    bytes-served metric counts, not framing)."""
    body, data_bytes = bytearray(), 0
    for message in messages:
        for part in message:
            if isinstance(part, memoryview) and isinstance(part.obj, mmap.mmap):
                _ensure_still_mapped(part.obj)  # before reading it (SIGBUS)
            body += part
        if len(message) > 1:
            data_bytes += len(message[1])
    return bytes(body), data_bytes


async def send_whole(
    scope: Any,
    send: Any,
    lease: StreamLease,
    raw_headers: list[tuple[bytes, bytes]],
    body: bytes,
    data_bytes: int,
    status: int = 200,
) -> None:
    """``status`` with ``body`` after its headers, in one socket write where the connection allows
    (``one_write``); closes ``lease`` however it ends, a cancellation by the idle cut ending
    as ``IdleTimeout``."""
    idle: _TaskIdleCut | None = None
    try:
        # The bytes are in memory: the files and the stream slot are free before the client
        # has them, so a slow reader holds neither.
        lease.release()
        idle = _TaskIdleCut(lease)  # a client that reads nothing
        with one_write(scope.get(CYCLE_KEY)):
            start = {"type": "http.response.start", "status": status, "headers": raw_headers}
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": False})
        lease.progress(data_bytes)
    except asyncio.CancelledError:
        _cut_idle(scope, lease, idle)
    finally:
        lease.close()


def _cut_idle(scope: Any, lease: StreamLease, idle: _TaskIdleCut | None) -> None:
    """Inside ``except CancelledError``: re-raise unless the idle cut cancelled the stream,
    which ends as ``IdleTimeout``."""
    if idle is None or not lease.idle_cut:
        raise  # noqa: PLE0704 - always called while handling the cancellation
    idle.uncancel()
    scope[ERROR_KEY] = "IdleTimeout"
    log.warning(
        "stream of model %s to %s cut: the client read nothing for %.1f s",
        lease.model_id,
        (scope.get("client") or ("?",))[0],
        lease.state.limits.idle_timeout,
    )


class KeptAnswer(Response):
    """A one-tensor stream answered from bytes kept whole for its revision
    (``tensors.KeptAnswers``): no plan of messages, no copy out of the mapping, and headers
    encoded once, not by Starlette per request (docs/performance.md, "Small requests")."""

    def __init__(
        self, lease: StreamLease, raw_headers: list[tuple[bytes, bytes]], body: bytes, data: int
    ) -> None:
        # Response.__init__ would encode the headers again; nothing here uses what else it sets.
        self.status_code = 200
        self.background = None
        self.raw_headers = raw_headers
        self.lease = lease
        self.whole = body
        self.data_bytes = data

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send_whole(scope, send, self.lease, self.raw_headers, self.whole, self.data_bytes)


class _TaskIdleCut:
    """The idle cut (``StreamLease.watch_idle``) of a stream sent from an ASGI task: a client
    that stops reading blocks ``send`` (uvicorn waits for the socket to drain), so the cut
    cancels the task, on its event loop."""

    def __init__(self, lease: StreamLease) -> None:
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.watch = lease.watch_idle(self._cut)

    def _cut(self) -> None:  # on the idle cutter's thread
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing left to cut
            self.loop.call_soon_threadsafe(self._cancel)

    def _cancel(self) -> None:
        if not self.watch.closed and self.task is not None:  # the stream has not ended
            self.task.cancel()

    def uncancel(self) -> None:
        uncancel = getattr(self.task, "uncancel", None)  # Python 3.11+
        if uncancel is not None:
            uncancel()


# Bodies this long go out through _SocketWriter where it can engage; shorter ones (a small
# tensor) cost less through the event loop's own write than through a worker thread.
DIRECT_WRITE_MIN_BYTES = 1 << 20
# ASGI scope key: uvicorn's request-response cycle of a plain HTTP/1.1 connection, set by
# the outermost layer (WeightserveApp.__call__) before Starlette wraps ``send``.
CYCLE_KEY = "weightserve.uvicorn_cycle"


def _uvicorn_cycle_types() -> tuple[type, ...]:
    """uvicorn's HTTP/1.1 request-response cycles (httptools and h11), those installed."""
    found = []
    for module in ("httptools_impl", "h11_impl"):
        try:
            imported = importlib.import_module(f"uvicorn.protocols.http.{module}")
        except ImportError:  # httptools not installed, or no uvicorn at all
            continue
        found.append(imported.RequestResponseCycle)
    return tuple(found)


_CYCLE_TYPES = _uvicorn_cycle_types()


class _SocketWriter:
    """Writes stream messages straight to the connection's socket: a ``FileMessage``'s data
    with ``sendfile`` from its file (unless ``sendfile_to`` says a copy), everything else
    with ``writev``.

    asyncio (before 3.12) copies whatever a socket doesn't take at once into its own buffer,
    which was most of the HTTP server's time; here nothing in user space copies tensor bytes,
    and ``sendfile`` hands the kernel the file's page-cache pages, which TCP sends without
    copying them either (docs/performance.md, "Where the time goes"). On TCP each batch is
    corked, so framing and data share full segments. The writes run on a worker thread (the
    GIL is released in writev, sendfile and poll), so several streams proceed in parallel. A
    truncated file ends ``sendfile`` short and a page it removed fails ``writev`` (EFAULT):
    the stream is cut, never a SIGBUS.

    Only for uvicorn's plain HTTP/1.1 connections (TCP or a Unix socket), found through the
    cycle ``WeightserveApp`` puts in the scope: the server's Content-Length accounting is
    adjusted here (httptools counts down ``expected_content_length``, h11 its writer's
    length). TLS, other servers and anything unrecognised use ASGI sends: Python's ``ssl``
    cannot hand its keys to kernel TLS, so a TLS connection has no socket to write to.
    """

    def __init__(self, account: Callable[[int], None], fd: int, idle_timeout: float) -> None:
        self.account = account
        self.written = 0  # body bytes, framing included
        self.sent_from_files = 0  # of which sent with sendfile
        # Our own descriptor: if asyncio closes its socket (client gone), this number can't
        # be reused by another connection while a write is still in flight.
        self.sock = socket.socket(fileno=os.dup(fd))
        self.fd = self.sock.fileno()
        self.idle_ms = int(idle_timeout * 1000)
        self.poller = select.poll()
        self.poller.register(self.fd, select.POLLOUT)
        self.cork = getattr(socket, "TCP_CORK", None)
        if self.sock.family not in (socket.AF_INET, socket.AF_INET6):
            self.cork = None
        self.use_sendfile = hasattr(os, "sendfile")
        # A write (and its waits for room) in one native call, the GIL released throughout
        # (client/wire/socket_loops.py); the loops below where not built.
        self.native = socket_loops.NATIVE
        self.pending = b""  # a chunk's padding, sent in front of the next framing
        self.unaccounted = 0  # body bytes written that uvicorn has not been told of yet

    @classmethod
    async def attach(cls, scope: Any, idle_timeout: float) -> _SocketWriter | None:
        cycle = scope.get(CYCLE_KEY)
        transport = getattr(cycle, "transport", None)
        account = _content_length_account(cycle)
        if transport is None or account is None:
            return None
        sock = plain_socket(transport)
        if sock is None:
            return None
        # The status line and headers must be on the wire before the body.
        while transport.get_write_buffer_size():
            await asyncio.sleep(0.001)
            if transport.is_closing():
                return None
        writer = cls(account, sock.fileno(), idle_timeout)
        app = scope.get("app")
        if isinstance(app, WeightserveApp):
            same_host = same_host_peer(sock)
            writer.use_sendfile = writer.use_sendfile and sendfile_to(app.sendfile, same_host)
            if same_host and not writer.use_sendfile and writer.cork is not None:
                writer.bound_send_buffer()
            app.direct_streams += 1
            app.open_writers.add(writer)
        return writer

    def bound_send_buffer(self) -> None:
        """Hold a same-host TCP peer's unsent and unacknowledged bytes to
        ``SAME_HOST_SEND_BUFFER`` instead of the several MiB TCP's autotuning grows to."""
        with contextlib.suppress(OSError):  # the client left: the write will say so
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SAME_HOST_SEND_BUFFER)

    def write_some(self, messages: Iterator[tuple]) -> tuple[int, bool]:
        """Take and write messages until ``DIRECT_BATCH_BYTES`` tensor bytes went out or the
        stream ended: (tensor bytes written, whether the stream ended).

        Per chunk this is one write of its framing (with the last chunk's padding in front)
        and one ``sendfile``; what uvicorn is told is counted once per batch."""
        written = 0
        use_sendfile = self.use_sendfile
        try:
            with self._corked():
                for message in messages:
                    if type(message) is FileMessage and use_sendfile:
                        n = len(message[1])
                        pending, self.pending = self.pending, b""
                        self.write_bytes(pending + message.prefix if pending else message.prefix)
                        self.send_file(message, n)
                        self.pending = message.suffix
                        use_sendfile = self.use_sendfile
                    else:
                        data = message[1] if len(message) > 1 else None
                        if isinstance(data, memoryview) and isinstance(data.obj, mmap.mmap):
                            _ensure_still_mapped(data.obj)
                        self.write_all(message)
                        if data is None:
                            continue
                        n = len(data)
                    written += n
                    if written >= DIRECT_BATCH_BYTES:
                        self.flush()
                        return written, False
                self.flush()
        finally:
            self.account(self.unaccounted)
            self.unaccounted = 0
        return written, True

    def flush(self) -> None:
        """Write the padding held back for the next framing (at the end of a batch)."""
        if self.pending:
            pending, self.pending = self.pending, b""
            self.write_bytes(pending)

    def write_bytes(self, data: bytes) -> None:
        at = 0
        while at < len(data):
            try:
                at += os.write(self.fd, data[at:] if at else data)
            except BlockingIOError:
                self._wait_writable()
        self.unaccounted += at
        self.written += at

    def write_all(self, parts: tuple) -> None:
        views = [memoryview(p).cast("B") for p in (self.pending, *parts) if len(p)]
        self.pending = b""
        if self.native:
            assert _socketio is not None
            written, outcome = _socketio.writev_all(self.fd, views, self.idle_ms)
            self.unaccounted += written
            self.written += written
            if outcome:
                raise self._write_error(outcome)
            return
        total = sum(len(v) for v in views)
        while views:
            try:
                n = os.writev(self.fd, views)
            except BlockingIOError:
                self._wait_writable()
                continue
            while views and n >= len(views[0]):
                n -= len(views.pop(0))
            if n:
                views[0] = views[0][n:]
        self.unaccounted += total
        self.written += total

    def send_file(self, message: FileMessage, count: int) -> None:
        """``count`` bytes of ``message``'s file from its offset, with ``sendfile``; where
        the file system can't, from the mapping with ``writev`` (and no sendfile again)."""
        file_fd = message.mapped.fileno()
        at = start = message.file_offset
        end = start + count
        if self.native and hasattr(_socketio, "sendfile_all"):  # Linux's sendfile only
            assert _socketio is not None
            sent, outcome = _socketio.sendfile_all(self.fd, file_fd, start, count, self.idle_ms)
            self.unaccounted += sent
            self.written += sent
            self.sent_from_files += sent
            if not outcome:
                return
            if outcome == WRITE_FILE_ENDED:
                raise _truncated(message)
            if not (outcome > 0 and not sent and outcome in _NO_SENDFILE):
                raise self._write_error(outcome)
            self.use_sendfile = False
            self.write_all(message[1:2])
            return
        while at < end:
            try:
                n = os.sendfile(self.fd, file_fd, at, end - at)
            except BlockingIOError:
                self._wait_writable()
                continue
            except OSError as e:
                if at > start or e.errno not in _NO_SENDFILE:
                    raise
                self.use_sendfile = False
                self.write_all(message[1:2])
                return
            if n == 0:  # the end of the file came first: truncated since it was mapped
                raise _truncated(message)
            at += n
            self.unaccounted += n
            self.written += n
            self.sent_from_files += n

    def _wait_writable(self) -> None:
        if not self.poller.poll(self.idle_ms):
            raise self._write_error(WRITE_TIMED_OUT)

    def _write_error(self, outcome: int) -> OSError:
        """The error for a native write loop's outcome (or a wait that timed out here)."""
        if outcome == WRITE_TIMED_OUT:
            return TimeoutError(f"the client read nothing for {self.idle_ms / 1000:.1f} s")
        return OSError(outcome, os.strerror(outcome))  # BrokenPipeError etc. by errno

    @contextlib.contextmanager
    def _corked(self) -> Iterator[None]:
        """TCP_CORK while a batch is written: framing and data go out in full segments,
        the rest when the batch ends (so nothing waits while the event loop runs)."""
        if self.cork is None:
            yield
            return
        self.sock.setsockopt(socket.IPPROTO_TCP, self.cork, 1)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):  # the client left: nothing to flush
                self.sock.setsockopt(socket.IPPROTO_TCP, self.cork, 0)

    def abort(self) -> None:
        """End the connection under a batch another thread is writing: its ``poll`` wakes
        and its next send fails at once; the descriptor itself stays open until ``close``."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()


def _truncated(message: FileMessage) -> ModelUnavailable:
    return ModelUnavailable(
        f"{message.mapped.path.name} was truncated while being served; the model reloads on "
        "its next request"
    )


# The send buffer (SO_SNDBUF; the kernel doubles it) of a TCP connection to a peer on this
# host that gets copies. Over loopback the buffer covers no network delay, only the time the
# receiver takes to be scheduled; autotuning's several MiB queued leave the client copying
# (and hashing) what left the caches long ago: a 1 GiB load took 0.34 s with this against
# 0.40 s without, with less CPU on both sides; half of it stalled the sender
# (docs/performance.md, "A send buffer for same-host peers").
SAME_HOST_SEND_BUFFER = 512 << 10


def sendfile_to(mode: SendfileMode, same_host: bool) -> bool:
    """Whether file bytes go to a peer with ``sendfile`` (``--sendfile``): always (on),
    never (off), or (auto) unless the peer is on this host (``same_host_peer``).

    Through a NIC, ``sendfile`` spares the server its copy. To a peer on this host, the
    receiver copies straight out of the page cache, cold, on the core its load is bound by;
    after the server's copy it reads the socket's freshly written pages instead. Measured on
    loopback (docs/performance.md, "sendfile or a copy"): a whole-model load took a quarter
    less time with the copy on AMD EPYC hosts; on an Intel Xeon host the raw readers were
    level, or up to a tenth slower."""
    if mode != "auto":
        return mode == "on"
    return not same_host


def same_host_peer(sock: socket.socket) -> bool:
    """Whether the peer of the connected ``sock`` is on this host, by its address: a Unix
    socket, a loopback address, or this end's own address (a host reaching its own IP goes
    over loopback). A pod on the same node behind its own veth is not recognised."""
    if sock.family == socket.AF_UNIX:
        return True
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    try:
        peer = _unmapped(ipaddress.ip_address(sock.getpeername()[0]))
        local = _unmapped(ipaddress.ip_address(sock.getsockname()[0]))
    except (OSError, ValueError):  # gone already, or an address this can't read
        return False
    return peer.is_loopback or peer == local


def _unmapped(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An IPv4 peer of a dual-stack socket (``::ffff:127.0.0.1``) as its IPv4 address."""
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped if mapped is not None else address


# sendfile's errors that mean "not from this file to this socket" rather than a failed write.
_NO_SENDFILE = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})


def _content_length_account(cycle: Any) -> Callable[[int], None] | None:
    """What tells uvicorn's cycle that ``n`` body bytes went out behind its back, so its
    Content-Length check at the end of the response holds; None for anything else."""
    if not _CYCLE_TYPES or not isinstance(cycle, _CYCLE_TYPES):
        return None
    if hasattr(cycle, "expected_content_length"):  # httptools
        if getattr(cycle, "chunked_encoding", None):
            return None

        def count_down(n: int) -> None:
            cycle.expected_content_length -= n

        return count_down
    writer: Any = getattr(getattr(cycle, "conn", None), "_writer", None)  # h11's body writer
    if type(writer).__name__ != "ContentLengthWriter" or not isinstance(
        getattr(writer, "_length", None), int
    ):
        return None

    def h11_count_down(n: int) -> None:
        writer._length -= n

    return h11_count_down


def _ensure_still_mapped(mapping: mmap.mmap) -> None:
    """ModelUnavailable if the file behind ``mapping`` shrank since it was mapped (one fstat):
    see ``MappedFile.ensure_unchanged``."""
    if mapping.size() < len(mapping):
        raise ModelUnavailable(
            "a file of this model was truncated while being served; the model reloads on its "
            "next request"
        )


async def _release_writer(writer: _SocketWriter, job: Future | None) -> None:
    """Close ``writer`` once its thread is done with it. A task cancelled while a batch is
    on the thread (uvicorn's forced shutdown after the grace period) would otherwise leave
    that thread waiting on its client up to the idle timeout, holding the process's exit,
    and closing the descriptor under it could hand its number to another connection, or the
    lease end the files' holds before its last ``sendfile``: so the connection is shut down
    (the thread's poll wakes, its send fails) and the thread waited for."""
    if job is not None and not job.done():
        writer.abort()
        with contextlib.suppress(BaseException):  # a second cancel: the task ends anyway
            await asyncio.shield(asyncio.wrap_future(job))
    writer.close()


def _writer_pool(scope: Any, max_streams: int) -> ThreadPoolExecutor | None:
    """The app's pool of writer threads (``WeightserveApp.writer_pool``); None outside one,
    where no writer attaches (the ASGI sends carry the stream)."""
    app = scope.get("app")
    return app.writer_pool(max_streams) if isinstance(app, WeightserveApp) else None


WRITER_THREAD_NAME = "weightserve-writer"
READER_THREAD_NAME = "weightserve-body-reader"
BODY_READERS = 16  # uploads read from their sockets at once; more take the ASGI messages


class WeightserveApp(FastAPI):
    """The FastAPI app, and the outermost ASGI layer uvicorn calls: before Starlette wraps
    ``send`` it notes the server's own request-response cycle in the scope (``CYCLE_KEY``),
    where a stream's ``_SocketWriter`` finds it."""

    # Streams and body bytes written with _SocketWriter, and how many of those bytes went
    # with sendfile (tests check that each path engages).
    direct_streams = 0
    direct_bytes = 0
    sendfile_bytes = 0
    # ``--sendfile``: to which peers file bytes go with sendfile rather than written from the
    # mapping (one copy in the server); see ``sendfile_to``.
    sendfile: SendfileMode = "auto"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.open_writers: set[_SocketWriter] = set()  # streams on a writer thread now
        self._writers: ThreadPoolExecutor | None = None
        self._writers_lock = threading.Lock()
        self.open_readers: set[SocketBodyReader] = set()  # uploads on a reading thread now
        self._readers: ThreadPoolExecutor | None = None
        self._readers_taken = 0
        self._readers_lock = threading.Lock()
        self.socket_body_bytes = 0  # upload bytes read from the socket (tests check it engages)

    def abort_streams(self) -> int:
        """Cut every stream a writer thread is sending (the listener's forced stop, once the
        grace period is over): uvicorn stops its loop without cancelling them, and each
        thread would wait on its client up to the idle timeout, holding the process's exit.
        Returns how many were cut."""
        writers = list(self.open_writers)
        for writer in writers:
            writer.abort()
        readers = list(self.open_readers)
        for reader in readers:
            reader.abort()
        return len(writers) + len(readers)

    def reserve_body_reader(self) -> bool:
        """A reading thread for one upload's body (``SocketBodyReader``), if one of
        ``BODY_READERS`` is free: a publisher that stalls holds its thread up to the body
        timeout, so past that many the ASGI messages carry the body (they hold no thread)."""
        with self._readers_lock:
            if self._readers_taken >= BODY_READERS:
                return False
            self._readers_taken += 1
            return True

    def release_body_reader(self, reader: SocketBodyReader | None) -> None:
        """The reservation ends (and ``reader``, if one was attached, is closed)."""
        with self._readers_lock:
            self._readers_taken -= 1
            if reader is not None:
                self.open_readers.discard(reader)
                self.socket_body_bytes += reader.received
        if reader is not None:
            reader.close()

    def body_reader_pool(self) -> ThreadPoolExecutor:
        with self._readers_lock:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(
                    max_workers=BODY_READERS, thread_name_prefix=READER_THREAD_NAME
                )
            return self._readers

    def writer_pool(self, max_streams: int) -> ThreadPoolExecutor:
        """The threads that write streams to their sockets, one per stream the server admits
        (``Limits.max_streams``), made as needed: a client that stops reading holds its
        writer in ``poll`` until the idle timeout, so a smaller pool shared with anything
        else (asyncio's default executor has ``cores + 4`` threads) would let a few stalled
        clients stop every other stream. Idle threads stay for the process's life."""
        with self._writers_lock:
            if self._writers is None:
                self._writers = ThreadPoolExecutor(
                    max_workers=max(1, max_streams), thread_name_prefix=WRITER_THREAD_NAME
                )
            return self._writers

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("http_version") == "1.1":
            cycle = getattr(send, "__self__", None)
            if _CYCLE_TYPES and isinstance(cycle, _CYCLE_TYPES):
                scope[CYCLE_KEY] = cycle
        await super().__call__(scope, receive, send)


class GrowingFileResponse(Response):
    """A file's bytes sent as they come, with its exact Content-Length: ``pieces`` blocks for
    the next bytes (a file a node cache's fill is still writing; on a thread of ``waits``, the
    limiter of what mostly waits) and yields ``b""`` now and then, a turn to notice a client
    gone. A failure before the last byte is logged and the connection closed with the body
    short, so the client sees the transfer fail (and may resume it with a Range) instead of a
    short file. ``on_end`` runs once, however it ends."""

    def __init__(
        self,
        pieces: Iterator[bytes],
        length: int,
        headers: dict[str, str],
        status_code: int,
        on_end: Callable[[int], None],
        waits: anyio.CapacityLimiter,
        media_type: str = "application/octet-stream",
    ) -> None:
        super().__init__(
            content=None,
            status_code=status_code,
            headers={**headers, "content-length": str(length)},
            media_type=media_type,
        )
        self.pieces = pieces
        self.on_end = on_end  # with the bytes sent
        self.waits = waits

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        gone = _client_gone(receive)
        sent = 0
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})  # fmt: skip
            while not gone.done():
                piece = await anyio.to_thread.run_sync(next, self.pieces, None, limiter=self.waits)
                if piece is None:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
                if piece:
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
                    sent += len(piece)
            scope[ERROR_KEY] = "Cancelled"
        except (WeightserveError, OSError) as e:
            scope[ERROR_KEY] = type(e).__name__
            log.warning("file stream %s broke after %d bytes: %s", scope.get("path"), sent, e)
        finally:
            gone.cancel()
            close = getattr(self.pieces, "close", None)
            if close is not None:
                await anyio.to_thread.run_sync(close, limiter=self.waits)
            self.on_end(sent)


class HeldResponse(Response):
    """A JSON answer that waits for something slow (a node cache's fill) without letting the
    connection idle: ``poll(seconds)`` blocks up to that long and returns the answer once it
    is ready. One ready within ``quiet`` seconds is sent as it is (its status and headers);
    after that, 200 is committed and a space sent every ``beat`` seconds (leading whitespace
    is valid JSON), so proxies' idle timeouts never cut the wait. An error answer after the
    commit is written and the connection closed before the body ends: the client sees a
    failed transfer, never a 200 document. ``poll`` runs on a thread of ``waits``."""

    def __init__(
        self,
        poll: Callable[[float], Response | None],
        quiet: float,
        beat: float,
        waits: anyio.CapacityLimiter,
    ) -> None:
        super().__init__(content=None, status_code=200, media_type="application/json")
        self.poll = poll
        self.quiet = quiet
        self.beat = beat
        self.waits = waits

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        answer = await anyio.to_thread.run_sync(self.poll, self.quiet, limiter=self.waits)
        if answer is not None:
            return await answer(scope, receive, send)
        headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        while answer is None:
            await send({"type": "http.response.body", "body": b" ", "more_body": True})
            answer = await anyio.to_thread.run_sync(self.poll, self.beat, limiter=self.waits)
        whole = answer.status_code == 200
        await send({"type": "http.response.body", "body": answer.body, "more_body": not whole})
        if not whole:
            scope[ERROR_KEY] = scope.get(ERROR_KEY) or "HeldAnswerFailed"
            log.warning("held answer to %s failed after 200 was sent: %s", scope.get("path"),
                        bytes(answer.body)[:300].decode("utf-8", "replace"))  # fmt: skip
