"""The files API over HTTP: ``/v1/models/ID/-/files`` lists a model's repository files,
``/v1/models/ID/-/files/NAME`` serves one with Range, ETag and conditional requests.

``file_response`` is shared with the Hub-compatible routes (service/transports/http/hub.py), which
add their own headers to the same answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from weightserve.client.errors import RangeNotSatisfiable
from weightserve.service.serving import files
from weightserve.service.serving.auth import Access
from weightserve.service.serving.lease import StreamLease
from weightserve.service.serving.state import ServiceState
from weightserve.service.serving.streams import FileMessage
from weightserve.service.sources.model import Model, RepoFile
from weightserve.service.transports.http.common import OPERATION_KEY, AccessCheck, error_response
from weightserve.service.transports.http.routes import get_and_head
from weightserve.service.transports.http.streaming import ArrowStreamResponse

OCTET_STREAM = "application/octet-stream"
FILE_OPERATION = "file"  # the metrics operation of every route that answers a file's bytes


def file_response(
    http: Request,
    state: ServiceState,
    caller: Access,
    model: Model,
    file: RepoFile,
    extra_headers: dict[str, str] | None = None,
) -> Response:
    """One file's bytes: 200, or 206 for a single satisfiable ``Range``; 304 for a matching
    ``If-None-Match``; ``If-Range`` with another ETag gets the whole file. The body streams
    from the shared mapping, holding a stream slot and cut when the client stops reading."""
    http.scope[OPERATION_KEY] = FILE_OPERATION
    etag = model.file_digest(file.path)
    headers = {
        "etag": f'"{etag}"',
        "accept-ranges": "bytes",
        "x-weightserve-revision": model.revision,
        **(extra_headers or {}),
    }
    if files.etag_matches(http.headers.get("if-none-match"), etag):
        return Response(status_code=304, headers=headers)
    if_range = http.headers.get("if-range")
    wanted = None
    if if_range is None or if_range.removeprefix("W/").strip('"') == etag:
        # An If-Range date never matches: the files have no Last-Modified to compare with.
        try:
            wanted = files.parse_range(http.headers.get("range"), file.size)
        except RangeNotSatisfiable as e:
            content_range = {"content-range": f"bytes */{file.size}"}
            return error_response(http.scope, e, {**headers, **content_range})
    byte_range = wanted or files.ByteRange(0, file.size)
    status = 200
    if wanted is not None:
        status = 206
        headers["content-range"] = wanted.content_range(file.size)
    files.pin_file(model, file)
    if http.method == "HEAD":
        # What a GET gets, without a body or a stream slot.
        headers["content-length"] = str(byte_range.length)
        return Response(status_code=status, headers=headers, media_type=OCTET_STREAM)
    client = caller.client_key(http.client.host if http.client else "")
    with StreamLease(state, "http", FILE_OPERATION, counted=False) as lease:
        lease.admit(model, {file.path}, client)
        messages = _file_messages(model, file, byte_range)
        return ArrowStreamResponse(
            lease.handed_over(),
            messages,
            byte_range.length,
            headers,
            status_code=status,
            media_type=OCTET_STREAM,
        )


def _file_messages(
    model: Model, file: RepoFile, byte_range: files.ByteRange
) -> Iterator[tuple[bytes | memoryview, ...]]:
    """The range's bytes as messages ``(b"", data)``, each saying where in the file its data
    lies (``FileMessage``), so a direct write sends it from the file with ``sendfile``."""
    mapped = model.mapped(file.path)
    at = byte_range.start
    for chunk in files.file_chunks(model, file, byte_range):
        # The mapping the chunk is a view of, not one a reload put in its place since.
        yield (
            FileMessage((b"", b""), chunk, mapped, at)
            if chunk.obj is mapped.view().obj
            else (b"", chunk)
        )
        at += len(chunk)


def add_file_routes(app: FastAPI, state: ServiceState, access: AccessCheck) -> None:
    """The files routes below a model (registered before the model's own catch-all route)."""

    @get_and_head(app, "/v1/models/{model:model_id}/-/files", tags=["files"])
    def list_files(http: Request, model: str) -> dict[str, Any]:
        """Every file of the model's repository (weights, index, config, tokenizer and other
        side files): `{id, revision, commit, files: [{name, size, etag}]}`."""
        # A node cache lists an uncached model from its origin's listing where that tells
        # every ETag (an upstream weightserve), without a fill.
        return files.file_list(files.listed_model(state, access(http), model))

    @get_and_head(
        app,
        "/v1/models/{model:model_id}/-/files/{name:path}",
        tags=["files"],
        response_class=Response,
        responses={
            200: {"content": {OCTET_STREAM: {}}},
            206: {"description": "the range the `Range` header asked for"},
            304: {"description": "`If-None-Match` names the file's ETag"},
            412: {"description": "the model is not at `revision`"},
            416: {"description": "the range starts past the end of the file"},
        },
    )
    def get_file(http: Request, model: str, name: str, revision: str | None = None) -> Response:
        """One file's bytes, exactly as in the model's directory. `Range: bytes=a-b`, `a-` or
        `-n` gives 206; `ETag` is the file's xxh3-128 digest (`If-None-Match`, `If-Range`);
        `revision` (the model's revision or commit) fails with 412 once the model changed."""
        caller = access(http)
        # A node cache serves a side file without a fill; a checkpoint's bytes fill it.
        m = files.file_model(state, caller, model, name, revision)
        files.check_revision(m, revision)
        return file_response(http, state, caller, m, files.repo_file(m, name))
