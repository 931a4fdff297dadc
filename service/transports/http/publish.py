"""The publish routes: a trainer uploads a revision's files (or tensors) and commits it, and
anyone lists a model's revisions or holds one (docs/protocol.md, "Publishing revisions").

An upload's bodies are streamed to disk as they arrive (bounded memory whatever the model's
size), limited by ``--max-upload-bytes`` (every part of the upload together, reserved as each
starts); a body cut off (the publisher killed) or silent for ``--upload-body-timeout``
discards the whole upload. A commit waits for the upload's parts still arriving (at most
twice ``--upload-body-timeout``), so nothing lands in a revision after its commit answers. No
answer names the server's staging directory. Publishing needs ``publish=PATTERN`` in the
token file, or ``--allow-publish`` on a server without one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import xxhash
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from weightserve.client.errors import (
    InvalidRequest,
    PublishConflict,
    WeightserveError,
)
from weightserve.client.wire.delta import DELTA_MEDIA_TYPE
from weightserve.client.wire.json_body import load_json_object
from weightserve.client.wire.routes import MAIN_REVISION, UPLOADS_ROUTE, with_revision
from weightserve.service.serving.delta import delta_base
from weightserve.service.serving.feed import (
    DRAIN_CHECK_SECONDS,
    EVERY_MODEL,
    HEARTBEAT_SECONDS,
    OVERRUN,
    Announcement,
    AsyncSubscription,
    event_line,
    watch_start,
)
from weightserve.service.serving.lease import StreamLease
from weightserve.service.serving.state import ServiceState
from weightserve.service.sources.base import RevisionLog
from weightserve.service.sources.files.stamps import file_stamp
from weightserve.service.sources.publishing.holds import hold_seconds, holder_name
from weightserve.service.sources.publishing.uploads import (
    PATCH_PART,
    TENSORS_PART,
    Publishing,
    Upload,
    check_record_size,
    file_part,
    part_label,
)
from weightserve.service.transports.http.body_reader import SocketBodyReader, write_all
from weightserve.service.transports.http.common import (
    OPERATION_KEY,
    AccessCheck,
    error_response,
    off_loop,
)
from weightserve.service.transports.http.routes import get_and_head
from weightserve.service.transports.http.streaming import (
    CYCLE_KEY,
    LeasedStreamResponse,
    WeightserveApp,
)

PUBLISH_OPERATION = "publish"
WRITE_BLOCK = 8 << 20  # bytes gathered before one write to disk, off the event loop
# Files from this size on keep the digest taken as they arrived (one write of the digest
# table each); smaller ones are hashed at commit, all in one pass and one table write.
HASHED_ON_ARRIVAL_MIN_BYTES = 1 << 20
COMMIT_POLL_SECONDS = 0.02  # how often a commit looks whether its upload's parts have ended
COMMIT_WAIT_TIMEOUTS = 2  # a commit waits this many --upload-body-timeout for parts arriving
MODEL = "/v1/models/{model:model_id}/-"


async def _json_body(http: Request) -> dict[str, Any]:
    raw = await http.body()
    if not raw:
        return {}
    return load_json_object(raw, InvalidRequest, "the request body")


class _Stalled(Exception):
    """A part's body sent nothing for ``--upload-body-timeout``: answered, then closed."""

    def __init__(self, error: InvalidRequest) -> None:
        super().__init__(str(error))
        self.error = error


async def _receive(http: Request, publisher: Publishing, upload: Upload, name: str | None) -> int:
    """Stream the request body into the upload's file; the bytes written."""
    with _no_paths(upload):
        target = publisher.target(upload, name)
    part = TENSORS_PART if name is None else file_part(name.strip("/"))
    hasher = xxhash.xxh3_128()  # the file's digest, as its bytes pass: the commit reads it
    written = await _receive_into(http, publisher, upload, target, part, hasher)

    def settle() -> None:  # off the event loop: keeping the digest writes the digest table
        digest = None
        if written >= HASHED_ON_ARRIVAL_MIN_BYTES:
            digest = (file_stamp(target.stat()), hasher.hexdigest())
        publisher.received(upload, name, target, written, digest)

    await run_in_threadpool(settle)
    return written


async def _receive_into(
    http: Request,
    publisher: Publishing,
    upload: Upload,
    target: Path,
    part: str,
    hasher: xxhash.xxh3_128 | None = None,
) -> int:
    """Stream the request body into ``target`` as the upload's ``part``; the bytes written,
    made durable (and given to ``hasher`` as they are written). The part stays counted (as
    arriving) until the caller settles it; any failure on the way discards the whole
    upload."""
    length = http.headers.get("content-length")
    declared = int(length) if length is not None and length.isdigit() else None
    label = part_label(part)
    publisher.start_part(upload, part, declared)
    try:
        await run_in_threadpool(target.parent.mkdir, parents=True, exist_ok=True)
        out = await run_in_threadpool(open, target, "wb")
    except OSError as e:
        publisher.end_part(upload, part)
        raise InvalidRequest(f"{label} cannot be written: {e.strerror}") from None
    progress = _Progress(publisher, upload, part, label, hasher)
    try:
        reading = _socket_reader(http, declared, publisher.body_timeout)
        if reading is None:
            written = await _receive_messages(http, out.fileno(), progress)
        else:
            written = await _receive_from_socket(out.fileno(), progress, *reading)
        await run_in_threadpool(os.fsync, out.fileno())  # durable before any commit names it
    except ClientDisconnect:
        publisher.abort(upload.id, "the publisher went away in the middle of a file")
        publisher.end_part(upload, part)
        raise
    except BaseException as e:
        publisher.abort(upload.id, f"{label} could not be received: {e}")
        publisher.end_part(upload, part)
        raise
    finally:
        await run_in_threadpool(out.close)
    if declared is not None and written != declared:
        publisher.abort(upload.id, "a file arrived short")
        publisher.end_part(upload, part)
        raise InvalidRequest(f"{label}: {written} bytes of {declared} arrived")
    return written


class _Progress:
    """One part's bytes as they arrive: counted against ``--max-upload-bytes`` (from any
    thread), and the error of a body that stalls."""

    def __init__(
        self,
        publisher: Publishing,
        upload: Upload,
        part: str,
        label: str,
        hasher: xxhash.xxh3_128 | None,
    ) -> None:
        self.publisher, self.upload, self.part, self.label = publisher, upload, part, label
        self.hasher = hasher
        self.arrived = 0

    def grow(self, arrived: int) -> None:
        self.arrived = arrived
        self.publisher.grow_part(self.upload, self.part, arrived)

    def stalled(self) -> _Stalled:
        return _Stalled(
            InvalidRequest(
                f"{self.label}: nothing arrived for {self.publisher.body_timeout:g} s "
                f"(--upload-body-timeout) after {self.arrived} bytes; the upload of "
                f"{self.upload.model_id!r} was discarded"
            )
        )


async def _receive_messages(http: Request, fd: int, progress: _Progress) -> int:
    """The body from uvicorn's ASGI messages, gathered into writes of ``WRITE_BLOCK``."""
    written = 0
    pending: list[bytes] = []  # the body's messages since the last write, written with one writev
    pending_bytes = 0
    while True:
        # The ASGI messages themselves (not Request.stream): no copy, no generator per piece.
        try:
            message = await asyncio.wait_for(http.receive(), progress.publisher.body_timeout)
        except TimeoutError:
            raise progress.stalled() from None
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        body = message.get("body", b"")
        if body:
            pending.append(body)
            pending_bytes += len(body)
            written += len(body)
            progress.grow(written)
        more = message.get("more_body", False)
        if pending_bytes >= WRITE_BLOCK or (pending and not more):
            await run_in_threadpool(write_all, fd, pending, progress.hasher)
            pending, pending_bytes = [], 0
        if not more:
            return written


def _socket_reader(
    http: Request, declared: int | None, timeout: float
) -> tuple[SocketBodyReader, bytes, WeightserveApp] | None:
    """The body's reader from the connection's socket (service/transports/http/
    body_reader.py) where it can engage and a reading thread is free, with the bytes
    uvicorn had buffered; None: the ASGI messages carry it."""
    app = http.scope.get("app")
    cycle = http.scope.get(CYCLE_KEY)
    if not isinstance(app, WeightserveApp) or cycle is None or not app.reserve_body_reader():
        return None
    taken = SocketBodyReader.attach(cycle, declared, timeout)
    if taken is None:
        app.release_body_reader(None)
        return None
    reader, already = taken
    app.open_readers.add(reader)
    return reader, already, app


async def _receive_from_socket(
    fd: int,
    progress: _Progress,
    reader: SocketBodyReader,
    already: bytes,
    app: WeightserveApp,
) -> int:
    """The body from the connection's socket, on one of the app's reading threads (which
    releases the reader however it ends)."""

    def read() -> int:
        try:
            if already:
                progress.grow(len(already))
                write_all(fd, [already], progress.hasher)
            return len(already) + reader.read_into(
                fd, lambda n: progress.grow(len(already) + n), progress.hasher
            )
        finally:
            app.release_body_reader(reader)

    try:
        return await asyncio.get_running_loop().run_in_executor(app.body_reader_pool(), read)
    except TimeoutError:
        raise progress.stalled() from None
    except EOFError:
        raise ClientDisconnect() from None
    except asyncio.CancelledError:
        reader.abort()  # the thread must not go on writing a file the route gives up
        raise


async def _part_answer(http: Request, receiving: Any) -> Response:
    """The answer of a part's PUT: a stalled body's error closes the connection (the rest of
    its body is not read)."""
    try:
        answer: Response = await receiving
    except _Stalled as stalled:
        return error_response(http.scope, stalled.error, headers={"connection": "close"})
    return answer


async def _parts_ended(publisher: Publishing, upload: Upload) -> None:
    """Wait for the upload's parts still arriving, at most twice ``--upload-body-timeout`` (a
    stalled part is cut, and the upload discarded, before that); refused (409, naming them)
    if they go on longer, or if the upload was discarded meanwhile."""
    waited = COMMIT_WAIT_TIMEOUTS * publisher.body_timeout
    deadline = time.monotonic() + waited
    while upload.receiving and time.monotonic() < deadline:
        await asyncio.sleep(COMMIT_POLL_SECONDS)
    if not publisher.tracked(upload):
        raise PublishConflict(
            f"the upload of {upload.model_id!r} was discarded while its commit waited for its "
            "parts (one was cut off, stalled or refused): nothing was committed"
        )
    if upload.receiving:
        names = ", ".join(part_label(p) for p in upload.receiving)
        raise PublishConflict(
            f"the upload of {upload.model_id!r} is still receiving {names} after "
            f"{waited:g} s: commit once its PUT has answered"
        )


@contextlib.contextmanager
def _no_paths(upload: Upload) -> Iterator[None]:
    """Errors raised inside, their messages without the server's staging directory (a file
    is named as the revision names it)."""
    try:
        yield
    except WeightserveError as e:
        raise _without_paths(e, upload) from None


def _without_paths(exc: WeightserveError, upload: Upload) -> WeightserveError:
    directories = (str(upload.model_dir), str(upload.directory))

    def clean(text: str) -> str:
        for directory in directories:
            text = text.replace(directory + "/", "").replace(directory, "the upload")
        return text

    message = clean(str(exc))
    if message == str(exc):
        return exc
    scrubbed: WeightserveError = Exception.__new__(type(exc))
    Exception.__init__(scrubbed, message)
    scrubbed.__dict__.update(
        {k: clean(v) if isinstance(v, str) else v for k, v in vars(exc).items()}
    )
    return scrubbed


def add_publish_routes(app: FastAPI, state: ServiceState, access: AccessCheck) -> None:
    """Routes below ``/v1/models/{model}/-/``: uploads, revisions and holds."""

    def publisher(http: Request, model: str) -> Publishing:
        http.scope[OPERATION_KEY] = PUBLISH_OPERATION
        access(http).check_publish(model, allowed_openly=state.allow_publish)
        if state.publisher is None:
            raise InvalidRequest(
                f"this server serves {state.catalog.description}: it takes publishes only "
                "into a local directory root"
            )
        return state.publisher

    @app.post(f"{MODEL}/{UPLOADS_ROUTE}", tags=["publish"], status_code=201)
    async def begin_upload(http: Request, model: str) -> Response:
        """Start a publish of `model` (created if new): `{"base": REV, "message": ...,
        "metadata": {...}}`, all optional. Answers `{"upload": ID}`; then PUT its files or
        tensors and POST `.../commit`."""
        found = publisher(http, model)
        body = await _json_body(http)
        base = body.get("base")
        metadata = body.get("metadata") or {}
        if base is not None and not isinstance(base, str) or not isinstance(metadata, dict):
            raise InvalidRequest("base must be a revision (a string), metadata an object")
        message = str(body.get("message") or "")
        check_record_size(message, metadata)
        upload = await run_in_threadpool(found.begin, model, base, message, metadata)
        return JSONResponse({"upload": upload.id}, status_code=201)

    @app.put(f"{MODEL}/{UPLOADS_ROUTE}/{{upload}}/files/{{name:path}}", tags=["publish"])
    async def put_file(http: Request, model: str, upload: str, name: str) -> Response:
        """One file of the revision, as its raw bytes (a checkpoint, config, tokenizer...)."""
        found = publisher(http, model)
        pending = found.upload(model, upload)

        async def receive() -> Response:
            size = await _receive(http, found, pending, name)
            return JSONResponse({"name": name, "size": size})

        return await _part_answer(http, receive())

    @app.put(f"{MODEL}/{UPLOADS_ROUTE}/{{upload}}/tensors", tags=["publish"])
    async def put_tensors(http: Request, model: str, upload: str) -> Response:
        """The revision's tensors as one safetensors file: its weights without a base, or
        the tensors that replace (or are added to) the base's."""
        found = publisher(http, model)
        pending = found.upload(model, upload)

        async def receive() -> Response:
            size = await _receive(http, found, pending, None)
            return JSONResponse({"size": size})

        return await _part_answer(http, receive())

    @app.put(f"{MODEL}/{UPLOADS_ROUTE}/{{upload}}/patch", tags=["publish"])
    async def put_patch(http: Request, model: str, upload: str) -> Response:
        """The revision's tensors as a patch against the upload's base, in the delta stream's
        form (per tensor a JSON line, `same`, `patch` or `whole`, then its bytes), applied onto
        the base's tensors once received; each result must match the digest its line names,
        or the publish is refused (`412`, naming the tensors) and the upload discarded."""
        found = publisher(http, model)
        pending = found.upload(model, upload)
        target = found.patch_target(pending)

        async def receive() -> Response:
            size = await _receive_into(http, found, pending, target, PATCH_PART)
            with _no_paths(pending):
                await run_in_threadpool(found.apply_patch, pending, target)
            return JSONResponse({"size": size})

        return await _part_answer(http, receive())

    @app.post(f"{MODEL}/{UPLOADS_ROUTE}/{{upload}}/commit", tags=["publish"], status_code=201)
    async def commit_upload(http: Request, model: str, upload: str) -> Response:
        """Check the upload (the strict readers), name it by its content and make it `main`;
        answers the new revision. Refused: nothing is left and `main` stays."""
        found = publisher(http, model)
        pending = found.upload(model, upload)
        found.seal(pending)
        try:
            await _parts_ended(found, pending)
        except BaseException:
            found.unseal(pending)
            raise
        with _no_paths(pending):
            record = await run_in_threadpool(found.commit, pending)
        return JSONResponse(record, status_code=201)

    @app.delete(f"{MODEL}/{UPLOADS_ROUTE}/{{upload}}", tags=["publish"])
    async def abort_upload(http: Request, model: str, upload: str) -> Response:
        """Discard an upload in progress."""
        found = publisher(http, model)
        found.upload(model, upload)
        await run_in_threadpool(found.abort, upload)
        return JSONResponse({"upload": upload, "aborted": True})

    @get_and_head(app, f"{MODEL}/revisions", tags=["publish"])
    async def revisions(http: Request, model: str) -> Response:
        """The model's revisions, newest first (`main` first): commit, parent, created,
        bytes, message, metadata."""
        http.scope[OPERATION_KEY] = "model_info"

        def answer() -> Response:
            listed = state.revisions(access(http), model)
            return JSONResponse({"model": model, "revisions": listed})

        return await off_loop(answer, False)

    @app.get(f"{MODEL}/watch", tags=["publish"])
    async def watch(
        http: Request, model: str, since: str | None = None, after: int | None = None
    ) -> Response:
        """Each change of the model's `main` (a rollback included), one JSON object per line
        (NDJSON): first `{"event": "hello", "main": COMMIT, "sequence": N}`, then with
        `since=COMMIT` (or `after=SEQUENCE`) the changes missed since, then each new one as
        `{"event": "revision", "sequence": N, ...}`; a `{"event": "heartbeat"}` line every
        few seconds keeps the connection alive. A watcher whose connection drops reconnects
        with `after` = the last sequence (or `since` = the last commit) it saw; one whose
        point is no longer known gets the current `main` flagged `history_cut`. A node cache
        announces a revision once it holds its bytes."""
        http.scope[OPERATION_KEY] = "watch"
        caller = access(http)
        caller.check(model)
        log = revision_log()
        await run_in_threadpool(log.revisions, model)  # an unknown model: ModelNotFound now

        async def lines() -> AsyncIterator[bytes]:
            with state.feed.subscribe(model) as queue:
                start = await run_in_threadpool(watch_start, log, model, since, after)
                sent = start.sent
                yield event_line(start.hello)
                for record in start.backlog:
                    yield event_line({"event": "revision", **record})
                async for announced in _announced(queue):
                    if announced is None:
                        yield event_line({"event": "heartbeat"})
                    elif announced is OVERRUN or announced.sequence > sent:
                        sent = announced.sequence
                        yield announced.line  # serialized once for every watcher

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.get("/v1/watch", tags=["publish"])
    async def watch_all(http: Request) -> Response:
        """Every model's new revisions (those the token may read), as the model's watch
        sends them with `model` added: what a node cache follows its upstream by. No
        backlog: a watcher that reconnects lists the models again."""
        http.scope[OPERATION_KEY] = "watch"
        caller = access(http)
        revision_log()

        async def lines() -> AsyncIterator[bytes]:
            with state.feed.subscribe(EVERY_MODEL) as queue:
                yield event_line({"event": "hello"})
                async for announced in _announced(queue):
                    if announced is None:
                        yield event_line({"event": "heartbeat"})
                    elif announced is OVERRUN or caller.may_read(announced.record["model"]):
                        yield announced.line

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def _announced(watcher: AsyncSubscription) -> AsyncIterator[Announcement | None]:
        """The announcements for ``watcher``, and None when a heartbeat is due, until the
        server shuts down; ``OVERRUN`` last for a watcher that fell too far behind."""
        quiet = 0.0
        while not state.draining:
            try:
                announced = await watcher.get(DRAIN_CHECK_SECONDS)
            except TimeoutError:
                quiet += DRAIN_CHECK_SECONDS
                if quiet >= HEARTBEAT_SECONDS:
                    quiet = 0.0
                    yield None
                continue
            if announced is None:  # overrun: what it missed comes with its reconnect
                yield OVERRUN
                return
            yield announced

    def revision_log() -> RevisionLog:
        if state.revision_log is None:
            raise InvalidRequest("this server announces no revisions")
        return state.revision_log

    @get_and_head(app, f"{MODEL}/delta", tags=["publish"])
    async def delta(
        http: Request, model: str, since: str, revision: str = MAIN_REVISION
    ) -> Response:
        """What a worker holding revision `since` needs to hold `revision` (default `main`):
        per tensor, one JSON line (`kind` `same`, `patch` or `whole`) and its bytes
        (docs/protocol.md, "Delta updates"). A commit `since` the server does not hold gives
        every tensor whole (`x-weightserve-delta-base` empty); a `since` that is neither a ref
        it holds nor a commit's hex digits is a 400. A data route: it takes a stream slot
        as the tensor streams do, and holds both revisions' files while it runs."""
        http.scope[OPERATION_KEY] = "stream"
        return await run_in_threadpool(_start_delta, http, model, since, revision)

    def _start_delta(http: Request, model: str, since: str, revision: str) -> Response:
        caller = access(http)
        target = state.readable_model(caller, with_revision(model, revision))
        base = delta_base(lambda named: state.readable_model(caller, named), model, since)
        headers = {
            "x-weightserve-revision": target.revision,
            "x-weightserve-commit": target.commit,
            "x-weightserve-delta-base": base.commit if base is not None else "",
        }
        client = caller.client_key(http.client.host if http.client else "")
        with StreamLease(state, "http", counted=False) as lease:
            lease.admit(target, {e.file for e in target.tensors.values()}, client)
            if base is not None:
                lease.hold(base, {e.file for e in base.tensors.values()})
            if http.method == "HEAD":
                # The status and headers a GET gets (a full server answers 429 here too),
                # no body, and the slot free again at once.
                return Response(headers=headers, media_type=DELTA_MEDIA_TYPE)
            pieces = state.deltas.stream(target, base)
            return LeasedStreamResponse(lease.handed_over(), pieces, headers, DELTA_MEDIA_TYPE)

    @get_and_head(app, f"{MODEL}/delta/size", tags=["publish"])
    async def delta_size(
        http: Request, model: str, since: str, revision: str = MAIN_REVISION
    ) -> dict[str, Any]:
        """What the delta stream from `since` to `revision` weighs before it is sent:
        `{base, commit, bytes, whole_bytes}` (`bytes`: its body; `whole_bytes`: the tensors it
        sends whole). Every tensor's patch is computed for it, once for every worker, and the
        stream asked for next sends them. A node cache weighs this against filling the
        revision from its peers (docs/origins.md, "Peer fills")."""
        http.scope[OPERATION_KEY] = "stream"
        return await run_in_threadpool(_delta_size, http, model, since, revision)

    def _delta_size(http: Request, model: str, since: str, revision: str) -> dict[str, Any]:
        caller = access(http)
        target = state.readable_model(caller, with_revision(model, revision))
        base = delta_base(lambda named: state.readable_model(caller, named), model, since)
        client = caller.client_key(http.client.host if http.client else "")
        with StreamLease(state, "http", counted=False) as lease:  # the files held while read
            lease.admit(target, {e.file for e in target.tensors.values()}, client)
            if base is not None:
                lease.hold(base, {e.file for e in base.tensors.values()})
            total, whole = state.deltas.size(target, base)
        return {
            "base": base.commit if base is not None else "",
            "commit": target.commit,
            "bytes": total,
            "whole_bytes": whole,
        }

    @app.post(f"{MODEL}/holds", tags=["publish"])
    async def hold(http: Request, model: str) -> Response:
        """Keep a revision from retention: `{"commit": C, "seconds": S, "holder": ID}` (renew
        before it ends; 0 releases the caller's own hold). One hold per holder: the token's
        identity, or without a token file the `holder` id the client names (else its
        address); seconds from 0 to a week (service/sources/publishing/holds.py)."""
        http.scope[OPERATION_KEY] = "model_info"
        holder = access(http).check_hold(model)
        body = await _json_body(http)
        commit = body.get("commit")
        if not isinstance(commit, str):
            raise InvalidRequest('a hold is {"commit": COMMIT, "seconds": N >= 0}')
        seconds = hold_seconds(body.get("seconds", 0))
        if not holder:
            named = holder_name(body.get("holder"))
            address = http.client.host if http.client else ""
            holder = f"client {named}" if named else f"address {address}"
        if state.publisher is None:
            raise InvalidRequest("this server keeps no published revisions to hold")
        answer = await run_in_threadpool(state.publisher.hold, model, commit, seconds, holder)
        return JSONResponse(answer)
