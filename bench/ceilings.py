"""Ceilings: what the machine can do with no protocol at all.

Raw loopback TCP. A plain threaded socket server (``python -m bench.ceilings FILE``, its own
process) answers one request line per connection, ``MODE OFFSET LENGTH``, with that byte
range of the checkpoint file and closes:

- ``sendfile``: ``os.sendfile`` from the page cache (no user-space copy at all);
- ``mmap``: ``sendall`` of 4 MiB slices of an mmap of the file (one copy, mmap -> kernel),
  the way a Python server that maps the file sends it.

The client (``raw_fetch``) splits the file over 1 or 2 connections and ``recv_into``s one
freshly allocated buffer (allocation and page faults are inside the timing). The best of the
four = "the ceiling".

``lowat=True`` (the ``raw_*_lowat`` rows) receives as the client's large reads do, waking
once a megabyte has arrived (``SO_RCVLOWAT``) rather than for every batch of segments; the
ceiling is the best row either way. ``verify=True`` (the ``raw_*_xxh3`` rows, with ``lowat``) hashes every 2 MiB of the buffer with xxh3-64 as
soon as it has landed, as the client checks every chunk's digest (DESIGN.md: each tensor
carries a digest the client checks): the ceiling for a client that keeps that promise, and,
against the plain row of the same run, what the check alone costs.

Page cache: ``pagecache_read`` reads the file with ``readinto`` into one fresh buffer: the
page-cache ceiling (what "it is already on local disk and cached" costs). ``local_load_file``
is ``safetensors.torch.load_file(backend="pread")`` of the same file into fresh memory: what
a user with a local copy runs (for reference; not a ceiling).
"""

from __future__ import annotations

import mmap
import os
import socket
import sys
import threading
from collections.abc import Callable

import numpy as np
import xxhash

from bench.procs import listen_threaded, serve_until_stdin_closes
from weightserve.client.transports.http1 import RCVLOWAT_BYTES
from weightserve.client.wire.schema import DEFAULT_CHUNK_BYTES

PIECE = 4 << 20


def _serve_one(conn: socket.socket, fd: int, view: memoryview) -> None:
    with conn:
        line = b""
        while not line.endswith(b"\n"):
            got = conn.recv(256)
            if not got:
                return
            line += got
        mode, offset, length = line.decode().split()
        at, end = int(offset), int(offset) + int(length)
        if mode == "sendfile":
            while at < end:
                n = os.sendfile(conn.fileno(), fd, at, end - at)
                if n == 0:
                    break
                at += n
        else:
            while at < end:
                k = min(PIECE, end - at)
                conn.sendall(view[at : at + k])
                at += k


def serve(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    view = memoryview(mm)
    listener = listen_threaded(0, lambda conn: _serve_one(conn, fd, view))
    serve_until_stdin_closes({"port": listener.getsockname()[1], "size": os.fstat(fd).st_size})
    listener.close()


# -- client side (run inside bench.worker) ---------------------------------------------------


def split_fetch(size: int, connections: int, one: Callable[[int, int], None]) -> None:
    """``one(lo, hi)`` for ``connections`` equal byte ranges of ``size``, each on its own
    thread; the first error any of them raised is raised here."""
    bounds = [size * i // connections for i in range(connections + 1)]
    errors: list[BaseException] = []

    def guarded(lo: int, hi: int) -> None:
        try:
            one(lo, hi)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [
        threading.Thread(target=guarded, args=(bounds[i], bounds[i + 1]))
        for i in range(connections)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def wait_for(sock: socket.socket, owed: int, mark: int) -> int:
    """Set ``sock``'s low-water mark to ``RCVLOWAT_BYTES``, or to ``owed`` where less is owed
    (never waiting for bytes that will not come), when that differs from ``mark``; returns
    the mark now set."""
    wanted = min(RCVLOWAT_BYTES, owed)
    if wanted and wanted != mark:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, wanted)
        return wanted
    return mark


def raw_fetch(
    port: int, size: int, mode: str, connections: int, verify: bool = False, lowat: bool = False
):
    """The whole file over ``connections`` loopback connections into one fresh buffer;
    with ``verify``, each ``DEFAULT_CHUNK_BYTES`` piece hashed as soon as it has landed;
    with ``lowat``, each receive waits for ``RCVLOWAT_BYTES`` (or the rest, if less) as the
    client's large body reads do."""
    piece = DEFAULT_CHUNK_BYTES if verify else 0

    def run():
        buf = np.empty(size, dtype=np.uint8)
        view = memoryview(buf)

        def one(lo: int, hi: int) -> None:
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(f"{mode} {lo} {hi - lo}\n".encode())
                at = hashed = lo
                mark = 1
                while at < hi:
                    if lowat:
                        mark = wait_for(s, hi - at, mark)
                    n = s.recv_into(view[at:hi])
                    if n == 0:
                        raise ConnectionError(f"closed at {at} of {lo}..{hi}")
                    at += n
                    while piece and (at - hashed >= piece or (at == hi and hashed < hi)):
                        end = min(hashed + piece, hi)
                        xxhash.xxh3_64_intdigest(view[hashed:end])
                        hashed = end

        split_fetch(size, connections, one)
        return {"bytes": size}, buf

    return run


def pagecache_read(path: str):
    """The file (already in the page cache) read into one fresh buffer."""

    def run():
        size = os.path.getsize(path)
        buf = np.empty(size, dtype=np.uint8)
        view = memoryview(buf)
        with open(path, "rb", buffering=0) as f:
            at = 0
            while at < size:
                n = f.readinto(view[at:])
                if not n:
                    raise EOFError(path)
                at += n
        return {"bytes": size}, buf

    return run


def local_load_file(path: str):
    """``safetensors.torch.load_file(path, backend="pread")``: the local file into fresh
    memory. (The default ``backend="mmap"`` returns in milliseconds because it maps the page
    cache and copies nothing; that is not a load into process memory.)"""
    import safetensors.torch

    def run():
        try:
            tensors = safetensors.torch.load_file(path, backend="pread")
        except TypeError:  # safetensors without the backend argument
            tensors = {k: v.clone() for k, v in safetensors.torch.load_file(path).items()}
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        return {"bytes": total}, tensors

    return run


if __name__ == "__main__":
    serve(sys.argv[1])


def fresh_memory(size: int):
    """Diagnostic: allocate ``size`` bytes and write every page once, no I/O at all. What
    landing data in fresh memory costs by itself (page faults, zeroing); every whole-model
    contender above pays it too."""

    def run():
        buf = np.empty(size, dtype=np.uint8)
        buf[::4096] = 1  # one write per 4 KiB page faults it in (huge pages: fewer faults)
        return {"bytes": size}, buf

    return run
