"""Publishing: arrays and files uploaded to a server and committed there as one new revision
of a model (service/sources/publishing/publisher.py keeps them), and the revisions a model has.

Tensors travel as one safetensors file written on the fly from the arrays' own memory (no
copy of the model in the client); files are streamed from disk. The server checks the upload
with its strict readers and makes it ``main`` only when it is complete; anything that fails
on the way discards the upload, so ``main`` never moves to a partial revision.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from weightserve.client.errors import (
    InvalidRequest,
    ResourceExhausted,
    ServerUnreachable,
    TransportError,
)
from weightserve.client.transports.base import ControlTransport, UploadPart
from weightserve.client.wire.backoff import Delays
from weightserve.client.wire.delta_plan import element_bytes, header_line, plan_delta
from weightserve.client.wire.dtypes import from_numpy_dtype, wire_dtype
from weightserve.client.wire.safetensors_layout import LayoutEntry, safetensors_header

READ_BLOCK = 8 << 20  # bytes read from a file per send
WATCH_RETRY_FIRST = 0.05
WATCH_RETRY_MAX = 2.0
UploadSource = bytes | bytearray | memoryview | str | os.PathLike[str]


@dataclass(frozen=True)
class Revision:
    """One revision of a model: ``commit`` names its bytes (``ID@COMMIT`` loads them),
    ``parent`` the revision it was published on (None for the first). ``unchanged``: the
    publish that answered it held the same bytes as ``main``, so nothing was published and
    ``main`` kept its record (its message, its metadata)."""

    commit: str
    parent: str | None
    created: float  # seconds since the epoch
    bytes: int
    message: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    unchanged: bool = False

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Revision:
        return cls(
            commit=str(body["commit"]),
            parent=body.get("parent"),
            created=float(body.get("created") or 0.0),
            bytes=int(body.get("bytes") or 0),
            message=str(body.get("message") or ""),
            metadata=dict(body.get("metadata") or {}),
            unchanged=bool(body.get("unchanged")),
        )


def tensor_bytes(value: Any) -> tuple[str, tuple[int, ...], memoryview]:
    """(wire dtype, shape, bytes) of an array: a NumPy array, a torch tensor, anything with
    DLPack or the buffer protocol. The bytes are the array's own memory where it is
    contiguous and on the CPU (a copy otherwise)."""
    if type(value).__module__.startswith("torch"):
        import torch  # only when given torch tensors: torch is optional

        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        name = str(t.dtype).removeprefix("torch.")
        wire_dtype(name)  # a dtype with no wire equivalent is refused by name
        raw = t.reshape(-1).view(torch.uint8).numpy()
        return name, tuple(t.shape), memoryview(raw.data)
    if isinstance(value, np.ndarray):
        array = value
    elif hasattr(value, "__dlpack__"):
        array = np.from_dlpack(value)
    else:
        array = np.asarray(value)
    array = np.asarray(array, order="C")  # not ascontiguousarray: it makes 0-dim 1-dim
    name = from_numpy_dtype(array.dtype)
    raw = array.reshape(-1).view(np.uint8)
    return name, tuple(array.shape), memoryview(raw.data)


def _tensor_stream(
    tensors: Mapping[str, Any], metadata: Mapping[str, str] | None
) -> tuple[int, Iterator[memoryview | bytes]]:
    """(total bytes, the chunks) of a safetensors file holding ``tensors``."""
    parts = [(name, *tensor_bytes(v)) for name, v in tensors.items()]
    header = safetensors_header(
        (LayoutEntry(name, dtype, shape, raw.nbytes) for name, dtype, shape, raw in parts),
        dict(metadata) if metadata else None,
    )

    def chunks() -> Iterator[memoryview | bytes]:
        yield header
        for *_, raw in parts:
            for start in range(0, raw.nbytes, READ_BLOCK):
                yield raw[start : start + READ_BLOCK]

    return len(header) + sum(raw.nbytes for *_, raw in parts), chunks()


def _patch_stream(
    tensors: Mapping[str, Any], base_tensors: Mapping[str, Any]
) -> tuple[int, Iterator[memoryview | bytes]]:
    """(total bytes, the chunks) of a patch against the base: per tensor, in the delta stream's
    form, nothing (its bytes are ``base_tensors``'), an element patch or the whole tensor,
    whichever is smallest; a whole tensor's bytes are the array's own memory."""
    entries = []
    for name, value in tensors.items():
        dtype, shape, new = tensor_bytes(value)
        old = None
        if name in base_tensors:
            old_dtype, old_shape, old_raw = tensor_bytes(base_tensors[name])
            if (old_dtype, old_shape) == (dtype, shape):
                old = old_raw
        entries.append(plan_delta(name, dtype, shape, new, old, element_bytes(dtype)))
    lines = [header_line(e.header) for e in entries]

    def chunks() -> Iterator[memoryview | bytes]:
        for line, entry in zip(lines, entries, strict=True):
            yield line
            for piece in entry.payload:
                view = memoryview(piece)
                for start in range(0, view.nbytes, READ_BLOCK):
                    yield view[start : start + READ_BLOCK]

    total = sum(len(line) + e.header.payload_bytes for line, e in zip(lines, entries, strict=True))
    return total, chunks()


def _file_stream(source: UploadSource) -> tuple[int, Iterator[memoryview | bytes]]:
    if isinstance(source, bytes | bytearray | memoryview):
        data = memoryview(source)
        return data.nbytes, iter([data])
    path = Path(source)
    size = path.stat().st_size

    def chunks() -> Iterator[bytes]:
        with open(path, "rb") as f:
            while block := f.read(READ_BLOCK):
                yield block

    return size, chunks()


@dataclass(frozen=True)
class Publication:
    """One revision to publish, as ``Client.publish`` takes it (its docstring says what each
    field does)."""

    model_id: str
    tensors: Mapping[str, Any] | None = None
    base: str | None = None
    base_tensors: Mapping[str, Any] | None = None
    files: Mapping[str, UploadSource] | None = None
    metadata: Mapping[str, Any] | None = None
    message: str = ""


def publish(
    transport: ControlTransport,
    publication: Publication,
    on_bytes: Callable[[int], None] | None = None,
) -> Revision:
    """Upload and commit one revision (see ``Client.publish``); with ``base_tensors`` (the
    arrays published as ``base``), ``tensors`` travel as a patch against them. A transport
    without uploads (gRPC) refuses it with WrongTransport."""
    p, model_id = publication, publication.model_id
    if not p.tensors and not p.files:
        raise InvalidRequest("a publish needs tensors or files")
    if p.base_tensors is not None and p.base is None:
        raise InvalidRequest(
            "base_tensors are the arrays published as a base revision: give that base too"
        )
    upload = transport.start_upload(model_id, p.base, p.message, dict(p.metadata or {}))
    try:
        for name, source in (p.files or {}).items():
            size, chunks = _file_stream(source)
            part = UploadPart(model_id, upload, f"files/{name.strip('/')}", chunks, size)
            transport.upload(part, on_bytes)
        if p.tensors and p.base_tensors is not None:
            size, chunks = _patch_stream(p.tensors, p.base_tensors)
            transport.upload(UploadPart(model_id, upload, "patch", chunks, size), on_bytes)
        elif p.tensors:
            size, chunks = _tensor_stream(p.tensors, None)
            transport.upload(UploadPart(model_id, upload, "tensors", chunks, size), on_bytes)
        record = transport.commit_upload(model_id, upload)
    except BaseException:
        # The first error is the one to report; the server forgets the upload on its own
        # too (a body cut off, or left idle).
        with contextlib.suppress(Exception):
            transport.discard_upload(model_id, upload)
        raise
    return Revision.from_json(record)


def publish_directory(
    transport: ControlTransport,
    model_id: str,
    directory: Path,
    *,
    base: str | None = None,
    message: str = "",
    on_bytes: Callable[[int], None] | None = None,
) -> Revision:
    """Publish every file below ``directory`` as it is (hidden files left out)."""
    files = {
        p.relative_to(directory).as_posix(): p
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    }
    if not files:
        raise InvalidRequest(f"{directory} holds no file to publish")
    publication = Publication(model_id, base=base, files=files, message=message)
    return publish(transport, publication, on_bytes)


def watch(
    transport: ControlTransport,
    model_id: str,
    since: str | None = None,
    timeout: float | None = None,
) -> Iterator[Revision]:
    """Each revision of ``model_id`` that becomes ``main`` from now on (with ``since``: every
    one after that commit first), in order, pushed by the server (HTTP: an NDJSON response;
    gRPC: WatchRevisions). A dropped connection or a restarting server is reconnected with
    the last commit (and sequence) seen, so none is missed or repeated, a rollback included. Ends after ``timeout`` seconds
    (None: never)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    anchor = since
    sequence: int | None = None  # of the change that made ``anchor`` main, once known
    delays = Delays(WATCH_RETRY_FIRST, WATCH_RETRY_MAX, jitter=False)
    while deadline is None or time.monotonic() < deadline:
        connected = False
        try:
            for event in _events(transport, model_id, anchor, deadline, sequence):
                connected = True
                delays.reset()
                if event.get("event") == "hello" and anchor is None:
                    anchor = event.get("main") or None
                    sequence = _sequence(event)
                elif event.get("event") == "revision":
                    revision = Revision.from_json(event)
                    anchor, sequence = revision.commit, _sequence(event)
                    yield revision
        except (ServerUnreachable, ValueError):
            pass  # reconnected below, from the last commit seen
        except ResourceExhausted:
            # Over gRPC the server cuts a watcher that fell too far behind (HTTP ends the
            # stream with an ``overrun`` event): what it missed comes on reconnecting.
            if not connected:
                raise  # refused before any event (too many watches): not ours to wait out
        except TransportError:
            if not connected:
                raise  # never answered (TLS, a wrong port): waiting will not fix it
        left = None if deadline is None else deadline - time.monotonic()
        pause = delays.next()
        time.sleep(pause if left is None else max(0.0, min(pause, left)))


def _events(
    transport: ControlTransport,
    model_id: str,
    since: str | None,
    deadline: float | None,
    after: int | None,
) -> Iterator[dict[str, Any]]:
    """One watch connection's events, until it ends, breaks or ``deadline`` passes."""
    left = None if deadline is None else max(0.001, deadline - time.monotonic())
    yield from transport.watch_revisions(model_id, since, left, after)


def _sequence(event: dict[str, Any]) -> int | None:
    """An event's sequence (docs/protocol.md, "Publishing revisions"); None from a server
    that numbers none."""
    found = event.get("sequence")
    return found if isinstance(found, int) and not isinstance(found, bool) and found > 0 else None


def revisions(transport: ControlTransport, model_id: str) -> list[Revision]:
    return [Revision.from_json(r) for r in transport.list_revisions(model_id)]


def hold(transport: ControlTransport, model_id: str, commit: str, seconds: float) -> float | None:
    return transport.hold(model_id, commit, seconds)
