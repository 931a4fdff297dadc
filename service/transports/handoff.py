"""The same-node zero-copy handoff: descriptors of immutable bytes over a Unix domain socket.

A client on the same node asks for tensors as it would for a stream; instead of bytes it gets
descriptors (SCM_RIGHTS) of files that hold them, with each tensor's file, offset, length and
chunk digests. The client maps them read-only, so every process on the node reads one copy in
memory, and a load copies nothing through a socket. The wire (one connection, any number of
requests, each frame a 4-byte big-endian length and a JSON object) is documented in
docs/protocol.md ("Same-node socket and zero-copy handoff").

A completed load never changes, whatever is written to the root later. So a descriptor is
handed out for mapping only where its bytes cannot change: a file the source owns (the node
cache writes its files once and replaces them by rename), or a sealed snapshot of the file
version (``service/sources/files/snapshots.py``), made once and shared by every handoff of that
version. Anything else (no room in the snapshot budget, no memfd seals) is marked ``copy``:
the client copies those ranges out of the descriptor, verifies them and maps nothing.

What the server checks is what every transport checks: the token and its model grants (a
descriptor opens a whole file, so only files of models the token may read are handed out), the
stream limits (a handoff holds a stream slot until the client says it has verified the bytes),
the revision a request pins, and the file being the version indexed. The peer's credentials
(SO_PEERCRED) name the client for per-client limits and logs, and may be limited to a set of
user ids. While the client verifies (or copies), the server holds its read lease on the files
(``MappedFile.hold``), so an in-place writer waits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import socketserver
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightserve.client.errors import (
    InvalidRequest,
    ModelUnavailable,
    PermissionDenied,
    WeightserveError,
)
from weightserve.client.wire.errors import WireError
from weightserve.client.wire.handoff import (
    FDS_PER_MESSAGE,
    FILE_COPY,
    FILE_OWNED,
    FILE_SEALED,
    MAX_FRAME_BYTES,
    HandoffProtocolError,
    encode_frame,
    read_frame,
)
from weightserve.client.wire.schema import DEFAULT_CHUNK_BYTES
from weightserve.service.serving.auth import authorize
from weightserve.service.serving.lease import StreamLease
from weightserve.service.serving.request import from_handoff
from weightserve.service.serving.state import ServiceState
from weightserve.service.serving.streams import PlannedTensor, plan_stream, stream_chunks
from weightserve.service.serving.views import server_version
from weightserve.service.sources.files.mapped import RELOAD_RETRY_AFTER
from weightserve.service.sources.files.snapshots import (
    Snapshot,
    SnapshotStore,
    default_snapshot_bytes,
)
from weightserve.service.sources.model import Model
from weightserve.service.transports.listener import StartupError, claim_socket_path

log = logging.getLogger("weightserve.handoff")

# How long a handoff's stream slot (and read lease) waits for the client to say it verified
# the bytes; a client that says nothing for this long is cut off.
VERIFY_TIMEOUT = 120.0
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket, from the kernel."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


class _Handler(socketserver.BaseRequestHandler):
    server: HandoffServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        pid, uid, gid = peer_credentials(sock)
        owner = self.server
        refused = None
        if owner.allowed_uids is not None and uid not in owner.allowed_uids:
            log.warning("handoff: refused a connection from uid %d (pid %d)", uid, pid)
            refused = PermissionDenied(
                f"user id {uid} may not use this socket; the server allows "
                f"{sorted(owner.allowed_uids)} (--uds-uids)"
            )
        peer = f"uid {uid} pid {pid}"
        while True:
            try:
                message = read_frame(sock)
            except (HandoffProtocolError, OSError):
                return
            if message is None:
                return
            op = message.get("op")
            if refused is not None:  # answered, not cut: the client says why it cannot use it
                _send(sock, _error(refused))
            elif op == "hello":
                _send(sock, owner.hello())
            elif op == "open":
                if not owner.serve_open(sock, message, peer):
                    return
            else:
                _send(sock, _error(InvalidRequest(f"unknown handoff operation {op!r}")))


@dataclass(frozen=True)
class _FileSource:
    """What a handoff passes for one file: how the client takes its bytes (``FILE_*``), the
    descriptor, and its (size, mtime in ns) as passed."""

    kind: str
    fd: int
    stamp: tuple[int, int]
    snapshot: Snapshot | None = None


def _error(e: WeightserveError) -> dict[str, Any]:
    return {"error": WireError.from_exception(e).to_json()}


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(encode_frame(message))


def _send_with_fds(sock: socket.socket, frame: bytes, fds: list[int]) -> None:
    if not fds:
        sock.sendall(frame)
        return
    # The descriptors ride on the frame's first bytes; more than the kernel takes in one
    # message (SCM_MAX_FD) follow on one-byte messages of their own.
    first, rest = fds[:FDS_PER_MESSAGE], fds[FDS_PER_MESSAGE:]
    sent = socket.send_fds(sock, [frame], first)
    if sent < len(frame):
        sock.sendall(frame[sent:])
    for i in range(0, len(rest), FDS_PER_MESSAGE):
        socket.send_fds(sock, [b"F"], rest[i : i + FDS_PER_MESSAGE])


@dataclass(frozen=True)
class HandoffEndpoint:
    """Where the handoff listens and for whom: ``path`` (a Unix socket, replaced if a stale one
    is there), its permission ``mode``, the user ids given descriptors (None: any) and the
    memory for sealed snapshots (None: ``default_snapshot_bytes()``)."""

    path: str
    mode: int = 0o666
    allowed_uids: frozenset[int] | None = None
    snapshot_bytes: int | None = None


class HandoffServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """The handoff endpoint listening on ``endpoint.path``."""

    daemon_threads = True
    allow_reuse_address = False
    # The kernel's maximum, not socketserver's 5: the ranks of a node start together, and a
    # full queue answers a connect with EAGAIN.
    request_queue_size = socket.SOMAXCONN

    def __init__(self, endpoint: HandoffEndpoint, state: ServiceState) -> None:
        self.path = Path(endpoint.path)
        self.state = state
        self.instance = state.instance
        self.allowed_uids = endpoint.allowed_uids
        snapshot_bytes = endpoint.snapshot_bytes
        self.snapshots = SnapshotStore(
            default_snapshot_bytes() if snapshot_bytes is None else snapshot_bytes
        )
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        super().__init__(str(self.path), _Handler)
        os.chmod(self.path, endpoint.mode)
        self._thread: threading.Thread | None = None

    def start(self) -> HandoffServer:
        self._thread = threading.Thread(
            target=self.serve_forever, name="weightserve-handoff", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        self.snapshots.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def hello(self) -> dict[str, Any]:
        return {"instance": self.instance, "version": server_version()}

    def serve_open(self, sock: socket.socket, message: dict[str, Any], peer: str) -> bool:
        """One handoff: plan, take a slot and the files' leases, send the descriptors, hold
        the slot until the client says it verified the bytes. False: the client went away."""
        held: list[Snapshot] = []  # snapshots whose descriptors this answer passes
        try:
            with StreamLease(self.state, "handoff") as lease:
                frame, fds, nbytes = self._answer(lease, message, peer, held)
                try:
                    _send_with_fds(sock, frame, fds)
                except OSError:
                    return False  # the client went away: counted as cancelled
                # The client maps (or copies) and checks the bytes now; the leases make an
                # in-place writer wait until it is done.
                sock.settimeout(VERIFY_TIMEOUT)
                try:
                    done = read_frame(sock)
                except (HandoffProtocolError, OSError):
                    done = None
                finally:
                    with contextlib.suppress(OSError):
                        sock.settimeout(None)
                lease.progress(nbytes)  # handed out, not copied
                lease.finished()
        except WeightserveError as e:
            _send(sock, _error(e))
            return True
        finally:
            for snapshot in held:
                self.snapshots.release(snapshot)
        return done is not None

    def _answer(
        self, lease: StreamLease, message: dict[str, Any], peer: str, held: list[Snapshot]
    ) -> tuple[bytes, list[int], int]:
        """The answer frame, the descriptors it carries and the bytes they hand out; the
        lease holds the slot and the files from here on, ``held`` the snapshots passed."""
        state = self.state
        token = message.get("token")
        access = authorize(state.tokens, f"Bearer {token}" if token else None)
        model_id = message.get("model")
        if not isinstance(model_id, str):
            raise InvalidRequest("a handoff names a model")
        request = from_handoff(message)
        model = state.readable_model(access, model_id, request.revision)
        planned = plan_stream(model, request, state.limits.max_names)
        in_files = [p for p in planned if p.byte_offset is not None and p.nbytes]
        # Empty tensors need no file (an empty file has no mapping to pass on).
        needed = list(dict.fromkeys(p.entry.file for p in in_files))
        lease.admit(model, set(needed), access.client_key(peer))
        can_copy = message.get("can_copy") is True
        sources = {f: self._source(model, f, can_copy, held) for f in needed}
        files = [f for f in needed if sources[f] is not None]
        index = {f: i for i, f in enumerate(files)}
        tensors = []
        nbytes = 0
        for p in planned:
            if p.byte_offset is None:
                continue
            source = sources.get(p.entry.file) if p.nbytes else None
            if p.nbytes and source is None:
                continue  # streamed instead (listed under "copy")
            tensors.append(
                {
                    "name": p.entry.name,
                    "dtype": p.dtype,
                    "shape": list(p.shape),
                    "logical_shape": list(p.logical_shape),
                    "encoding": p.encoding,
                    "file": index[p.entry.file] if source is not None else None,
                    "offset": p.byte_offset,
                    "nbytes": p.nbytes,
                    "chunk_bytes": DEFAULT_CHUNK_BYTES,
                    "digests": self._digests(model, p, source),
                }
            )
            nbytes += p.nbytes
        answer = {
            "model": model.id,
            "revision": model.revision,
            "files": [
                {
                    "name": f.name,
                    "size": model.mapped(f).size,
                    "kind": source.kind,
                    "stamp": list(source.stamp),
                }
                for f in files
                if (source := sources[f]) is not None
            ],
            "tensors": tensors,
            # Gathered on the way out (strided sources, inner-axis shards), or in a file an
            # older client would map although it may change: the client fetches these over
            # a copying transport.
            "copy": [
                p.entry.name
                for p in planned
                if p.byte_offset is None or (p.nbytes and sources[p.entry.file] is None)
            ],
        }
        frame = encode_frame(answer)
        if len(frame) > MAX_FRAME_BYTES:
            raise InvalidRequest(
                f"the handoff answer for {len(planned)} tensors is too large; ask for "
                "fewer tensors at once"
            )
        return frame, [s.fd for f in files if (s := sources[f]) is not None], nbytes

    def _source(
        self, model: Model, file: Path, can_copy: bool, held: list[Snapshot]
    ) -> _FileSource | None:
        """How a file's bytes are handed out: mapped where they cannot change (a file the
        source owns, else a sealed snapshot of this version), else copied by the client;
        None: streamed (a client that cannot copy would map a file that may change)."""
        mapped = model.mapped(file)
        if self._owned(file):
            return _FileSource(FILE_OWNED, mapped.fileno(), mapped.content_stamp())
        snapshot = self.snapshots.acquire(mapped)
        if snapshot is not None:
            held.append(snapshot)
            return _FileSource(FILE_SEALED, snapshot.fileno(), snapshot.stamp(), snapshot)
        if can_copy:
            return _FileSource(FILE_COPY, mapped.fileno(), mapped.content_stamp())
        return None

    def _owned(self, file: Path) -> bool:
        """Whether the source wrote the file itself and never rewrites it: files under the
        root of a source whose files change by no other hands (``watch_files`` False: the
        node cache, which fills each file once and replaces it only by rename)."""
        catalog = self.state.catalog
        return not catalog.watch_files and file.is_relative_to(catalog.root)

    def _digests(self, model: Model, p: PlannedTensor, source: _FileSource | None) -> list[int]:
        """The stream's chunk digests of a tensor: computed once per mapping and shared with
        every HTTP, gRPC and handoff client of the same bytes. A snapshot's bytes are checked
        against them (once per chunk): a copy that differs from the file is never passed."""
        digests = []
        for h, data in stream_chunks(model, [p], DEFAULT_CHUNK_BYTES):
            digests.append(h.digest)
            snapshot = source.snapshot if source is not None else None
            start = p.byte_offset + h.offset  # type: ignore[operator]
            if snapshot is not None and not snapshot.matches(start, len(data), h.digest):
                self.snapshots.discard(snapshot)
                raise ModelUnavailable(
                    f"the snapshot of {snapshot.path.name} differs from the file; the model "
                    "reloads on its next request",
                    retry_after=RELOAD_RETRY_AFTER,
                )
        return digests


class HandoffListener:
    """The handoff socket as a ``Listener`` (``HandoffServer`` on ``path``)."""

    name = "handoff"

    def __init__(self, endpoint: HandoffEndpoint, state: ServiceState) -> None:
        self.endpoint, self.state = endpoint, state
        self.path = endpoint.path
        self.server: HandoffServer | None = None

    def start(self) -> None:
        claim_socket_path(self.path)
        try:
            self.server = HandoffServer(self.endpoint, self.state).start()
        except OSError as e:
            raise StartupError("uds", f"cannot listen on {self.path}: {e.strerror or e}") from None

    def drain(self) -> None:
        """Nothing to announce: a handoff in progress holds its slot until the client is done."""

    def stop(self, force: bool, wait: float) -> None:
        if self.server is not None:
            self.server.stop()  # removes its socket file
