"""The control verbs over HTTP (``ControlTransport``): publishing's uploads, revisions,
watches, holds and the delta stream, each one route of docs/protocol.md. ``HttpTransport``
carries them over its requests; a watch's silence is bounded here."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import quote, urlencode

from weightserve.client.errors import ServerUnreachable
from weightserve.client.transports.base import CONTROL_VERBS, LineStream, UploadPart
from weightserve.client.wire.routes import MAIN_REVISION, UPLOADS_ROUTE, http_model_path
from weightserve.client.wire.watch import WATCH_SILENCE, read_events

# Who holds a revision, where the server has no token file (with one, the token says): one id
# per process, so another process's hold or release never changes this one's.
HOLDER_ID = uuid.uuid4().hex


class HttpControl:
    """The control verbs, over the three kinds of exchange an HTTP transport offers."""

    control_verbs = CONTROL_VERBS

    # The three exchanges are the host transport's (``HttpTransport`` documents them).
    def request_json(
        self, method: str, path: str, ok: tuple[int, ...] = (200,), body: dict | None = None
    ) -> dict[str, Any]:
        raise NotImplementedError

    upload_to: Callable[
        [str, Iterable[bytes | memoryview], int, Callable[[int], None] | None], dict[str, Any]
    ]

    def _lines(self, path: str) -> LineStream:
        raise NotImplementedError

    def start_upload(
        self, model: str, base: str | None, message: str, metadata: Mapping[str, Any]
    ) -> str:
        body = {"base": base, "message": message, "metadata": dict(metadata)}
        path = http_model_path(model, UPLOADS_ROUTE)
        return str(self.request_json("POST", path, ok=(201,), body=body)["upload"])

    def upload(
        self, part: UploadPart, on_bytes: Callable[[int], None] | None = None
    ) -> dict[str, Any]:
        path = http_model_path(part.model, UPLOADS_ROUTE, part.upload)
        path += "/" + quote(part.part, safe="/")
        return self.upload_to(path, part.chunks, part.length, on_bytes)

    def commit_upload(self, model: str, upload: str) -> dict[str, Any]:
        path = http_model_path(model, UPLOADS_ROUTE, upload, "commit")
        return self.request_json("POST", path, ok=(201,))

    def discard_upload(self, model: str, upload: str) -> None:
        self.request_json("DELETE", http_model_path(model, UPLOADS_ROUTE, upload))

    def list_revisions(self, model: str) -> list[dict[str, Any]]:
        return list(self.request_json("GET", http_model_path(model, "revisions"))["revisions"])

    def hold(self, model: str, commit: str, seconds: float) -> float | None:
        body = {"commit": commit, "seconds": seconds, "holder": HOLDER_ID}
        answer = self.request_json("POST", http_model_path(model, "holds"), body=body)
        return answer.get("held_until")

    def open_watch(
        self, model: str | None, since: str | None, after: int | None = None
    ) -> LineStream:
        fields = {"since": since, "after": after}
        given = {k: v for k, v in fields.items() if v is not None and v != ""}
        query = f"?{urlencode(given)}" if given else ""
        path = "/v1/watch" if model is None else http_model_path(model, "watch")
        return self._lines(path + query)

    def watch_revisions(
        self, model: str, since: str | None, timeout: float | None, after: int | None = None
    ) -> Iterator[dict[str, Any]]:
        deadline = None if timeout is None else time.monotonic() + timeout
        lines = self.open_watch(model, since, after)
        silence = WATCH_SILENCE

        def before_read() -> bool:
            nonlocal silence
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            # Silence longer than a few heartbeats: the connection is dead, reconnect.
            silence = WATCH_SILENCE if left is None else min(WATCH_SILENCE, left)
            return True

        try:
            yield from read_events(lambda: lines.readline(silence=silence), before_read)
        except ServerUnreachable:
            if deadline is None or time.monotonic() < deadline:
                raise
        finally:
            lines.close()

    def delta_size(self, model: str, since: str, revision: str | None) -> dict[str, Any]:
        """``{base, commit, bytes, whole_bytes}``: what ``open_delta`` would send."""
        query = urlencode({"since": since, "revision": revision or MAIN_REVISION})
        return self.request_json("GET", http_model_path(model, "delta", "size") + "?" + query)

    def open_delta(self, model: str, since: str, revision: str | None) -> LineStream:
        query = urlencode({"since": since, "revision": revision or MAIN_REVISION})
        return self._lines(http_model_path(model, "delta") + "?" + query)
