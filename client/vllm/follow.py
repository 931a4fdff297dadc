"""A vLLM engine that follows a model's ``main``: each revision a trainer publishes is applied
through the engine's ``weightserve`` weight-transfer backend (client/vllm/transfer.py), and
the engine's weight version becomes its commit (vLLM tags each output with it).

    llm = LLM(model="smollm2", load_format="weightserve",
              weight_transfer_config={"backend": "weightserve"})
    for commit in follow(llm, "http://weights:8080/v1/models/smollm2"):
        ...  # the engine now serves `commit`

``engine`` is an ``LLM`` in this process, or the URL of a ``vllm serve`` started with
``VLLM_SERVER_DEV_MODE=1`` (which opens its weight-update routes); ``weightserve follow-vllm``
runs the loop beside such a server, with nothing of vLLM installed.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any, Protocol

from weightserve.client._client import Client
from weightserve.client.wire.routes import parse_url

__all__ = ["engine_control", "follow", "update_engine"]


class EngineControl(Protocol):
    """The weight-update steps of one vLLM engine."""

    def start(self) -> None: ...
    def update(self, info: dict[str, Any]) -> None: ...
    def finish(self, version: str) -> None: ...
    def version(self) -> str: ...


class _InProcess:
    """An ``LLM`` of this process."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def start(self) -> None:
        self.llm.start_weight_update()

    def update(self, info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": info})

    def finish(self, version: str) -> None:
        self.llm.finish_weight_update(weight_version=version)

    def version(self) -> str:
        return str(self.llm.get_weight_version())


class _OverHTTP:
    """A ``vllm serve`` through its weight-update routes (``VLLM_SERVER_DEV_MODE=1``)."""

    def __init__(self, url: str, timeout: float = 600) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _call(self, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.url}/{route}",
            data=data,
            method="GET" if route == "weight_info" else "POST",
            headers={"content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                return dict(json.loads(answer.read() or b"{}"))
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            if e.code == 404:
                detail = "no such route: start vllm serve with VLLM_SERVER_DEV_MODE=1"
            raise RuntimeError(f"{self.url}/{route}: {e.code} {detail}") from None

    def start(self) -> None:
        self._call("start_weight_update")

    def update(self, info: dict[str, Any]) -> None:
        self._call("update_weights", {"update_info": info})

    def finish(self, version: str) -> None:
        self._call("finish_weight_update", {"weight_version": version})

    def version(self) -> str:
        return str(self._call("weight_info").get("weight_version", ""))


def engine_control(engine: Any) -> EngineControl:
    """The update steps of ``engine``: an ``LLM``, or a ``vllm serve`` URL."""
    if isinstance(engine, str):
        return _OverHTTP(engine)
    return _InProcess(engine)


def update_engine(engine: Any, commit: str) -> None:
    """Bring ``engine`` to revision ``commit`` (all or nothing; nothing when it holds it) and
    make ``commit`` its weight version."""
    control = engine if hasattr(engine, "finish") else engine_control(engine)
    control.start()
    control.update({"revision": commit})  # a failure ends vLLM's update session itself
    control.finish(commit)


def follow(
    engine: Any, model_url: str, *, token: str | None = None, timeout: float | None = None
) -> Iterator[str]:
    """Keep ``engine`` on the model's ``main``: brought to it now, then to each revision
    announced, in order (``watch``: reconnects, misses none); yields each commit applied.
    Stops after ``timeout`` seconds (None: never)."""
    _, model_id = parse_url(model_url)
    if not model_id:
        raise ValueError(f"{model_url!r} names a server, not a model")
    control = engine_control(engine)
    with Client(model_url, token=token) as client:
        remote = client.model(model_id)
        now = remote.commit
        if control.version() != now:
            update_engine(control, now)
            yield now
        for revision in remote.watch(since=now, timeout=timeout):
            update_engine(control, revision.commit)
            yield revision.commit
