"""Read-only routes in the Hugging Face Hub's layout, so Hub clients download from weightserve.

With ``HF_ENDPOINT=http://HOST:PORT``, ``huggingface_hub`` (``snapshot_download``,
``hf_hub_download``) and whatever loads through it (transformers, sentence-transformers,
vLLM, SGLang, TGI) fetch a model's files unchanged:

- ``GET /api/models/{repo}`` and ``/api/models/{repo}/revision/{revision}``: model info,
  ``sha`` the model's 40-hex commit, ``siblings`` its files;
- ``GET /api/models/{repo}/tree/{revision}[/{path}]`` and ``POST .../paths-info/{revision}``:
  file listings (one page, no pagination);
- ``GET|HEAD /{repo}/resolve/{revision}/{filename}``: the file, with ``X-Repo-Commit``,
  ``ETag``, ``Content-Length`` and Range, as the Hub answers for files it stores itself.

A repo id is a model id (any depth). A revision ``R`` is the model ``{repo}@R``, resolved as
every transport resolves a pinned load (``main`` or none: the model as served; its commit, its
revision or a prefix of at least 12 hex digits of them; a hub cache's refs and snapshots): one
not held is a 404 ``RevisionNotFound``. Errors carry the Hub's ``X-Error-Code``
(``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``; ``GatedRepo`` for a token not
granted the model) and ``X-Error-Message`` so the clients raise their usual exceptions with
the server's reason: huggingface_hub reports a 4xx it has no code for as a network failure.

A node cache's fill is never answered 503 here (the clients neither wait a Retry-After out nor
outlast a fill): a file streams as the fill lands it, a HEAD or model info is held in a way
the client waits (docs/protocol.md, "Hugging Face Hub routes").
"""

from __future__ import annotations

import contextlib
import itertools
import re
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, unquote, urlencode

import anyio
import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from weightserve.client.errors import (
    FileNotFound,
    ModelNotFound,
    NotFound,
    PermissionDenied,
    RevisionNotFound,
    Unauthenticated,
    WeightserveError,
)
from weightserve.client.wire.errors import WireError
from weightserve.client.wire.routes import (
    MAIN_REVISION,
    REVISION_SEPARATOR,
    VARIANT_SEPARATOR,
    with_revision,
)
from weightserve.service.serving import files
from weightserve.service.serving.auth import Access
from weightserve.service.serving.state import ServiceState
from weightserve.service.sources.model import Model
from weightserve.service.sources.origin.fill_wait import FillInProgress, following_fills
from weightserve.service.transports.http.common import ERROR_KEY, OPERATION_KEY, AccessCheck
from weightserve.service.transports.http.files import FILE_OPERATION, OCTET_STREAM, file_response
from weightserve.service.transports.http.routes import get_and_head
from weightserve.service.transports.http.streaming import GrowingFileResponse, HeldResponse

DEFAULT_REVISION = MAIN_REVISION
_API_ACTIONS = ("revision", "tree", "paths-info")
# A commit, or a prefix of at least 12 hex digits of one (service/sources/revisions/pinning.py).
_COMMIT_LIKE = re.compile(r"[0-9a-fA-F]{12,64}")
# A Hub revision holding these (``refs/pr/1``) names no model id's revision: by commit only.
_NOT_IN_IDS = ("/", REVISION_SEPARATOR, VARIANT_SEPARATOR)

# A node cache's fill outlasts every timeout of huggingface_hub, so no Hub route answers it
# 503 (the client does not wait a Retry-After out): each is held in a way its client waits.
# What the fill must answer first (a HEAD whose commit only the fill tells, a file whose copy
# has not started) is held HEAD_HOLD_SECONDS, under the client's 10 s for a HEAD and between
# a download's bytes, then redirected to itself (``?held=N`` counts the hops): the client
# follows 20 same-host redirects, each with a fresh timeout. The last hop it follows is held
# LAST_HOP_SECONDS instead: the client times out and retries as it retries a slow Hub (a HEAD
# again with 60 s a hop and backoff, a download resumed 5 times), each retry held again.
HEAD_HOLD_SECONDS = 7.0
LAST_HOP = 19
LAST_HOP_SECONDS = 65.0
HELD_QUERY = "held"
# Threads that may wait on fills at once, apart from the routes' pool: they sleep on a
# condition, and a node's many clients must not starve the other routes while they wait.
HELD_REQUESTS = 512
# Model info and listings: answered with their own status when the fill ends this soon, else
# 200 with a space every KEEPALIVE_SECONDS (leading whitespace is JSON) until it does.
HELD_QUIET_SECONDS = 2.0
KEEPALIVE_SECONDS = 5.0
# A file streamed as its fill lands it looks at its client this often while no byte comes.
FOLLOW_IDLE_SECONDS = 1.0


_HUB_ERROR_CODES: dict[type[WeightserveError], str] = {
    RevisionNotFound: "RevisionNotFound",
    FileNotFound: "EntryNotFound",
    ModelNotFound: "RepoNotFound",
    # The Hub's answer to a token not on a repo's access list: huggingface_hub raises
    # GatedRepoError with the message; an uncoded 403 it hides behind "check your connection".
    PermissionDenied: "GatedRepo",
}


def _hub_error(http: Request, exc: WeightserveError, commit: str | None = None) -> JSONResponse:
    """An error as the Hub sends it: JSON ``{"error": message}``, ``X-Error-Message`` (all a
    HEAD carries), ``X-Error-Code`` when the Hub has one for it, ``X-Repo-Commit`` on a
    missing file (clients cache its absence). A 401 has no code: huggingface_hub raises it
    as the HTTP error it is, message included."""
    error = WireError.from_exception(exc)  # the status and retry hint every transport gives it
    http.scope[ERROR_KEY] = error.type  # for CallMetrics
    message = error.message
    headers = {"x-error-message": message.encode("ascii", "replace").decode()[:500]}
    for cls, code in _HUB_ERROR_CODES.items():
        if isinstance(exc, cls):
            headers["x-error-code"] = code
            break
    if isinstance(exc, Unauthenticated) and http.headers.get("authorization"):
        headers["x-error-message"] = "Invalid credentials in Authorization header"
    if commit is not None:
        headers["x-repo-commit"] = commit
    headers.update(error.http_headers())
    return JSONResponse({"error": message}, status_code=error.http_status(), headers=headers)


def _segments(http: Request, prefix: str) -> list[str]:
    """The request path after ``prefix`` split at ``/`` as sent: the Hub's clients
    percent-encode a revision's and a path's own slashes (``refs%2Fpr%2F1``)."""
    raw = http.scope.get("raw_path") or http.url.path.encode()
    path = raw.decode("latin-1").partition("?")[0]
    return path[len(prefix) :].split("/") if path.startswith(prefix) else []


class HubRepos:
    """Repo ids and revisions of the Hub's URLs, resolved against the catalog."""

    def __init__(self, state: ServiceState) -> None:
        self.state = state

    def known(self, repo_id: str) -> bool:
        catalog = self.state.catalog
        return (
            repo_id in catalog.models
            or repo_id in catalog.problems
            or any(m.startswith(f"{repo_id}@") for m in list(catalog.models))
        )

    def split(self, parts: list[str], marker: Callable[[str], bool]) -> tuple[str, list[str]]:
        """(repo id, the parts after it) for a path whose repo id is followed by a part that
        ``marker`` accepts: the first such reading whose repo the catalog knows, else the
        first reading (its unknown repo then gets a RepoNotFound)."""
        readings = [
            ("/".join(unquote(p) for p in parts[:i]), parts[i:])
            for i in range(1, len(parts))
            if marker(parts[i])
        ]
        for repo_id, rest in readings:
            if self.known(repo_id):
                return repo_id, rest
        if readings:
            return readings[0]
        return "/".join(unquote(p) for p in parts), []

    def model(
        self,
        caller: Access,
        repo_id: str,
        revision: str,
        metadata: bool = False,
        file: str | None = None,
        commitless: bool = False,
    ) -> Model:
        """The model a repo id at a Hub revision names (see the module docstring). With
        ``metadata`` (model info, listings, one ``file`` to serve), a node cache's uncached
        model is described from its headers instead of filled, where its commit is known
        before a fill (Hub clients pin the commit they are given), or where the answer
        carries none (``commitless``: a side file's bytes, fetched alone)."""
        state = self.state

        def main() -> Model:
            if metadata:
                described = state.readable_metadata(caller, repo_id, file)
                if described.commit or commitless:
                    return described
            return state.readable_model(caller, repo_id)

        if revision in ("", DEFAULT_REVISION):
            return main()
        if metadata:
            if _COMMIT_LIKE.fullmatch(revision):
                # A commit is compared with main only where main's commit is known before a
                # fill (an upstream's listing): over object storage describing main would fill
                # it, and a node with room for one copy would trade it for R's, forever.
                listed = state.readable_metadata(caller, repo_id)  # no file: never a fill
                if listed.commit and revision in (listed.revision, listed.commit):
                    return main()
            else:
                current = main()  # a node cache's model, described before its fill
                if revision in (current.revision, current.commit):
                    return current
        if any(c in revision for c in _NOT_IN_IDS):  # refs/pr/1: reachable by commit only
            current = main()  # an unknown repo: RepoNotFound first
            raise RevisionNotFound(
                f"repository {repo_id!r} has no revision {revision!r} on this server: it "
                f"serves 'main' at commit {current.commit}"
            )
        return state.readable_model(caller, with_revision(repo_id, revision))


def _tree_entries(model: Model, under: str, recursive: bool) -> list[dict[str, Any]]:
    """The Hub's tree listing of the files below ``under`` ("" for the top), with their
    folders: files as ``{type: file, path, size, oid}``, folders as ``{type: directory}``."""
    prefix = f"{under.strip('/')}/" if under.strip("/") else ""
    entries: dict[str, dict[str, Any]] = {}
    for f in model.repo_files.values():
        if not f.name.startswith(prefix):
            continue
        rest = f.name[len(prefix) :].split("/")
        folders = rest[:-1] if recursive else rest[:1] if len(rest) > 1 else []
        for depth in range(len(folders)):
            path = prefix + "/".join(rest[: depth + 1])
            entries.setdefault(path, {"type": "directory", "oid": model.commit, "path": path})
        if recursive or len(rest) == 1:
            entries[f.name] = {
                "type": "file",
                "oid": model.file_digest(f.path),
                "size": f.size,
                "path": f.name,
            }
    if prefix and not entries:
        raise FileNotFound(f"no folder {under!r} in model {model.id!r}")
    return list(entries.values())


def _model_info(model: Model, repo_id: str) -> dict[str, Any]:
    """What ``huggingface_hub.ModelInfo`` reads; ``sha`` is the commit Hub clients pin."""
    return {
        "_id": model.commit[:24],
        "id": repo_id,
        "modelId": repo_id,
        "sha": model.commit,
        "private": False,
        "gated": False,
        "disabled": False,
        "tags": [model.format],
        "siblings": [
            {"rfilename": f.name, "size": f.size, "blobId": model.file_digest(f.path)}
            for f in model.repo_files.values()
        ],
    }


def _held(http: Request, answer: Callable[[], Response], waits: anyio.CapacityLimiter) -> Response:
    """``answer()``, or, while a node cache's fill it needs runs, a ``HeldResponse`` that
    gives it once the fill ended (the fill's error where it failed): model info and listings
    over object storage, whose commit the fill alone tells."""
    following: list[FillInProgress] = []

    def attempt() -> Response | None:
        try:
            with following_fills():
                return answer()
        except FillInProgress as fill:
            following[:] = [fill]
            return None

    def poll(seconds: float) -> Response | None:
        try:
            if not following[0].wait(seconds):
                return None
        except WeightserveError as e:
            return _hub_error(http, e)
        return attempt()  # filled: answered from the cache (or a newer fill is followed)

    first = attempt()
    if first is not None:
        return first
    return HeldResponse(poll, HELD_QUIET_SECONDS, KEEPALIVE_SECONDS, waits)


def _hold_seconds(http: Request) -> float:
    """How long this hop of a held request may wait (see HEAD_HOLD_SECONDS)."""
    try:
        hop = int(http.query_params.get(HELD_QUERY, "0"))
    except ValueError:
        hop = 0
    return LAST_HOP_SECONDS if hop >= LAST_HOP else HEAD_HOLD_SECONDS


def _to_itself(http: Request) -> Response:
    """A redirect to the request's own URL, its hop counted (relative, so the client stays on
    this host): a Hub client follows it with a fresh timeout."""
    raw = http.scope.get("raw_path") or http.url.path.encode()
    query = dict(http.query_params)
    try:
        hop = int(query.get(HELD_QUERY, "0")) + 1
    except ValueError:
        hop = 1
    query[HELD_QUERY] = str(min(hop, LAST_HOP))
    location = raw.decode("latin-1").partition("?")[0] + "?" + urlencode(query)
    return Response(status_code=307, headers={"location": location, "cache-control": "no-store"})


def _resolve_during_fill(
    http: Request,
    state: ServiceState,
    caller: Access,
    described: Model | None,
    name: str,
    fill: FillInProgress,
    waits: anyio.CapacityLimiter,
) -> Response | None:
    """``/resolve`` of a file of a model a fill is copying now, never 503: answered from the
    listing at once where the commit is known before the fill (``described``: an upstream
    weightserve lists content digests), a GET's body following the bytes as they land; a HEAD
    whose commit only the fill tells, or a GET whose bytes do not come, is held
    HEAD_HOLD_SECONDS, then redirected to itself so the client asks again. None when the fill
    ended meanwhile: answer as for a cached model."""
    listed = fill.origin_file(name)
    if described is not None:
        file = files.repo_file(described, name)  # EntryNotFound as for a cached model
    elif listed is None:
        raise FileNotFound(f"No file {name!r} in model {fill.model_id!r}.")
    landed = fill.landed(name)
    if landed is None or (described is None and http.method == "HEAD"):
        return None if fill.wait(_hold_seconds(http)) else _to_itself(http)
    headers = {"accept-ranges": "bytes"}
    etag = ""
    if described is not None:
        etag = described.file_digest(file.path)
        headers.update({"x-repo-commit": described.commit, "etag": f'"{etag}"'})
        headers["x-weightserve-revision"] = described.revision
        if files.etag_matches(http.headers.get("if-none-match"), etag):
            return Response(status_code=304, headers=headers)
    wanted = None
    if_range = http.headers.get("if-range")
    if if_range is None or (etag and if_range.removeprefix("W/").strip('"') == etag):
        wanted = files.parse_range(http.headers.get("range"), landed.size)
    byte_range = wanted or files.ByteRange(0, landed.size)
    status = 200 if wanted is None else 206
    if wanted is not None:
        headers["content-range"] = wanted.content_range(landed.size)
    if http.method == "HEAD":
        headers["content-length"] = str(byte_range.length)
        return Response(status_code=status, headers=headers, media_type=OCTET_STREAM)
    http.scope[OPERATION_KEY] = FILE_OPERATION
    pieces = landed.follow(byte_range.start, byte_range.stop, FOLLOW_IDLE_SECONDS)
    # The answer starts once its bytes flow: a file whose copy has not started (a fill copies
    # files one after another) is held, then redirected to itself as a HEAD is, so the
    # client's 10 s between bytes starts again with each hop instead of running out.
    first = b""
    deadline = time.monotonic() + _hold_seconds(http)
    while byte_range.length and not first and time.monotonic() < deadline:
        first = next(pieces)  # the fill's error, if it failed, is this request's answer
    if byte_range.length and not first:
        pieces.close()
        return _to_itself(http)
    slot = contextlib.ExitStack()
    client = caller.client_key(http.client.host if http.client else "")
    slot.enter_context(state.stream_slot("http", client))

    def ended(sent: int) -> None:
        slot.close()
        state.metrics.child(state.metrics.bytes_served, "http", fill.model_id).inc(sent)

    body = itertools.chain([first], pieces)
    return GrowingFileResponse(body, byte_range.length, headers, status, ended, waits, OCTET_STREAM)


def add_hub_routes(app: FastAPI, state: ServiceState, access: AccessCheck) -> None:
    """The Hub-compatible routes; registered last, so every other route keeps its paths (the
    resolve route only matches a path with a ``resolve`` part after a model id's parts)."""
    repos = HubRepos(state)
    waits = anyio.CapacityLimiter(HELD_REQUESTS)  # what waits on a fill (HELD_REQUESTS)

    @get_and_head(app, "/api/models/{path:path}", tags=["hub"])
    def hub_api(http: Request, path: str, recursive: str = "false") -> Response:
        """Model info (`/api/models/{repo}`, `.../revision/{revision}`) and file listings
        (`.../tree/{revision}[/{path}]`) in the Hugging Face Hub's format."""
        http.scope[OPERATION_KEY] = "model_info"
        parts = _segments(http, "/api/models/")
        repo_id, rest = repos.split(parts, lambda p: p in _API_ACTIONS)

        def answer() -> Response:
            try:
                caller = access(http)
                action = rest[0] if rest else "revision"
                revision = unquote(rest[1]) if len(rest) > 1 else DEFAULT_REVISION
                if action not in ("revision", "tree") or (action == "revision" and len(rest) > 2):
                    raise NotFound(f"no Hub route /api/models/{path}")
                model = repos.model(caller, repo_id, revision, metadata=True)
                if action == "revision":
                    return JSONResponse(_model_info(model, repo_id))
                under = "/".join(unquote(p) for p in rest[2:])
                deep = recursive.lower() in ("true", "1")
                return JSONResponse(_tree_entries(model, under, deep))
            except FillInProgress:
                raise  # held until the fill ends (_held)
            except WeightserveError as e:
                return _hub_error(http, e)

        return _held(http, answer, waits)

    @app.post("/api/models/{path:path}", tags=["hub"])
    async def hub_paths_info(http: Request, path: str) -> Response:
        """`POST /api/models/{repo}/paths-info/{revision}` with form field `paths` (repeated):
        the listed files and folders, as the Hub answers."""
        http.scope[OPERATION_KEY] = "model_info"
        parts = _segments(http, "/api/models/")
        repo_id, rest = repos.split(parts, lambda p: p == "paths-info")
        form = parse_qs((await http.body()).decode("utf-8", "replace"))

        def answer() -> Response:  # a file never hashed before is read for its digest
            try:
                caller = access(http)
                if len(rest) != 2:
                    raise NotFound(f"no Hub route POST /api/models/{path}")
                model = repos.model(caller, repo_id, unquote(rest[1]), metadata=True)
                wanted = {p.strip("/") for p in form.get("paths", [])}
                listing = _tree_entries(model, "", recursive=True)
                return JSONResponse([e for e in listing if e["path"] in wanted])
            except FillInProgress:
                raise  # held until the fill ends (_held)
            except WeightserveError as e:
                return _hub_error(http, e)

        return await run_in_threadpool(_held, http, answer, waits)

    @get_and_head(app, "/{repo:model_id}/resolve/{rest:path}", tags=["hub"])
    async def hub_resolve(http: Request, repo: str, rest: str) -> Response:
        """`/{repo}/resolve/{revision}/{filename}`: the file, with `X-Repo-Commit`, `ETag`,
        `Content-Length` and Range, as the Hub answers."""
        # On a thread of its own pool: it may be held for a fill.
        return await anyio.to_thread.run_sync(resolve, http, limiter=waits)

    def resolve(http: Request) -> Response:
        http.scope[OPERATION_KEY] = "file"
        parts = _segments(http, "/")
        repo_id, after = repos.split(parts, lambda p: p == "resolve")
        commit = None
        try:
            caller = access(http)
            if len(after) < 3:
                raise FileNotFound(
                    f"a Hub file URL is /REPO/resolve/REVISION/FILE, got {http.url.path}"
                )
            name = "/".join(unquote(p) for p in after[2:])
            revision = unquote(after[1])
            # A download needs no commit (a HEAD does): over object storage a side file's
            # bytes come without a fill.
            commitless = http.method == "GET"
            try:
                with following_fills():
                    model = repos.model(caller, repo_id, revision, True, name, commitless)
            except FillInProgress as fill:
                described = None
                with contextlib.suppress(FillInProgress), following_fills():
                    described = repos.model(caller, repo_id, revision, metadata=True)
                commit = described.commit if described is not None else None
                held = _resolve_during_fill(http, state, caller, described, name, fill, waits)
                if held is not None:
                    return held
                model = repos.model(caller, repo_id, revision, True, name, commitless)
            commit = model.commit or None
            file = files.repo_file(model, name)
            extra = {"x-repo-commit": commit} if commit else {}
            return file_response(http, state, caller, model, file, extra)
        except WeightserveError as e:
            return _hub_error(http, e, commit)
