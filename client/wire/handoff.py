"""Framing of the same-node handoff socket, shared by client and server.

Each frame is a 4-byte big-endian length and that many bytes of a UTF-8 JSON object.
Descriptors (SCM_RIGHTS) ride on the bytes of an answer frame; the full protocol is in
docs/protocol.md ("Same-node socket and zero-copy handoff").
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from weightserve.client.wire.json_body import load_json_object

# The kernel passes at most SCM_MAX_FD (253) descriptors in one message.
FDS_PER_MESSAGE = 250
# A frame larger than this is refused: a whole model's index with per-chunk digests is a few
# MB at most; a corrupt length prefix must not make either side allocate gigabytes.
MAX_FRAME_BYTES = 64 << 20
_LENGTH = struct.Struct(">I")

# How the client takes a passed file's bytes (its "kind" in the answer): a completed load
# must never change, so only bytes that cannot change are mapped.
FILE_SEALED = "sealed"  # a memfd snapshot sealed against write, shrink and grow: mapped
FILE_OWNED = "owned"  # a file the server wrote and never rewrites (the node cache's): mapped
FILE_COPY = "copy"  # anything else: the client copies the ranges out and verifies them


class HandoffProtocolError(ConnectionError):
    """The peer broke the framing (a bad length, not JSON, or the connection ended inside a
    frame)."""


def encode_frame(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return _LENGTH.pack(len(body)) + body


def _read_exact(sock: socket.socket, n: int, fds: list[int] | None) -> bytes | None:
    """n bytes (None at a clean end before the first); descriptors that arrive on them are
    appended to ``fds`` (with ``fds`` None, any that arrive are closed: not expected)."""
    buf = bytearray()
    while len(buf) < n:
        data, got, _flags, _addr = socket.recv_fds(
            sock, n - len(buf), FDS_PER_MESSAGE, socket.MSG_CMSG_CLOEXEC
        )
        if fds is not None:
            fds.extend(got)
        else:
            for fd in got:
                socket.close(fd)
        if not data:
            if not buf:
                return None
            raise HandoffProtocolError("the connection ended inside a frame")
        buf += data
    return bytes(buf)


def read_frame(sock: socket.socket, fds: list[int] | None = None) -> dict[str, Any] | None:
    """The next frame's object, or None when the peer closed the connection between frames."""
    head = _read_exact(sock, _LENGTH.size, fds)
    if head is None:
        return None
    (length,) = _LENGTH.unpack(head)
    if length > MAX_FRAME_BYTES:
        raise HandoffProtocolError(f"a frame of {length} bytes (the limit is {MAX_FRAME_BYTES})")
    body = _read_exact(sock, length, fds) if length else b""
    if body is None:
        raise HandoffProtocolError("the connection ended inside a frame")
    message: dict[str, Any] = load_json_object(body, HandoffProtocolError, "a frame")
    return message


def read_fds(sock: socket.socket, fds: list[int], count: int) -> None:
    """Read the one-byte messages that carry descriptors beyond the first batch until
    ``fds`` holds ``count``."""
    while len(fds) < count:
        data = _read_exact(sock, 1, fds)
        if data != b"F":
            raise HandoffProtocolError("expected a descriptor message")
