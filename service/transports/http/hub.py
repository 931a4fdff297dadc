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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, unquote

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
from weightserve.service.transports.http.common import ERROR_KEY, OPERATION_KEY, AccessCheck
from weightserve.service.transports.http.files import file_response
from weightserve.service.transports.http.routes import get_and_head

DEFAULT_REVISION = MAIN_REVISION
_API_ACTIONS = ("revision", "tree", "paths-info")
# A Hub revision holding these (``refs/pr/1``) names no model id's revision: by commit only.
_NOT_IN_IDS = ("/", REVISION_SEPARATOR, VARIANT_SEPARATOR)


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
    ) -> Model:
        """The model a repo id at a Hub revision names (see the module docstring). With
        ``metadata`` (model info, listings, one ``file`` to serve), a node cache's uncached
        model is described from its headers instead of filled, where its commit is known
        before a fill: Hub clients pin the commit they are given."""
        state = self.state

        def main() -> Model:
            if metadata:
                described = state.readable_metadata(caller, repo_id, file)
                if described.commit:
                    return described
            return state.readable_model(caller, repo_id)

        if revision in ("", DEFAULT_REVISION):
            return main()
        if metadata:
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


def add_hub_routes(app: FastAPI, state: ServiceState, access: AccessCheck) -> None:
    """The Hub-compatible routes; registered last, so every other route keeps its paths (the
    resolve route only matches a path with a ``resolve`` part after a model id's parts)."""
    repos = HubRepos(state)

    @get_and_head(app, "/api/models/{path:path}", tags=["hub"])
    def hub_api(http: Request, path: str, recursive: str = "false") -> Response:
        """Model info (`/api/models/{repo}`, `.../revision/{revision}`) and file listings
        (`.../tree/{revision}[/{path}]`) in the Hugging Face Hub's format."""
        http.scope[OPERATION_KEY] = "model_info"
        parts = _segments(http, "/api/models/")
        repo_id, rest = repos.split(parts, lambda p: p in _API_ACTIONS)
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
        except WeightserveError as e:
            return _hub_error(http, e)

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
            except WeightserveError as e:
                return _hub_error(http, e)

        return await run_in_threadpool(answer)

    @get_and_head(app, "/{repo:model_id}/resolve/{rest:path}", tags=["hub"])
    def hub_resolve(http: Request, repo: str, rest: str) -> Response:
        """`/{repo}/resolve/{revision}/{filename}`: the file, with `X-Repo-Commit`, `ETag`,
        `Content-Length` and Range, as the Hub answers."""
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
            model = repos.model(caller, repo_id, unquote(after[1]), metadata=True, file=name)
            commit = model.commit
            file = files.repo_file(model, name)
            return file_response(http, state, caller, model, file, {"x-repo-commit": commit})
        except WeightserveError as e:
            return _hub_error(http, e, commit)
