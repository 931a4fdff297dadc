"""The HTTP API's URL layout: routes that no model id or tensor name can collide with.

A model id is a path (``org/name``) and a tensor name may hold anything (``enc/layer_0/kernel``,
``stream``, ``%``), so one path part is reserved: no model id has a part ``-``
(``validate_model_id``), and every route below a model starts with it
(``/v1/models/ID/-/stream``, ``/v1/models/ID/-/tensors/NAME``). URLs of the layout before it
(``/v1/models/ID/stream``, ``/v1/models/ID/tensors/NAME``) still work where the catalog
resolves them to one model (``resolve_legacy``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI
from starlette.convertors import Convertor, register_url_convertor

from weightserve.client.errors import InvalidRequest
from weightserve.client.wire.routes import RESERVED_PART, http_model_path

Endpoint = TypeVar("Endpoint", bound=Callable[..., Any])


class ModelIdConvertor(Convertor[str]):
    """``{model:model_id}``: path parts, none of them empty or ``-``, so in
    ``/v1/models/{model:model_id}/-/...`` the first ``/-/`` always ends the id, whatever
    the tensor name after it holds (``/v1/models/m/-/tensors/a/-/stream`` is tensor
    ``a/-/stream`` of model ``m``)."""

    _part = rf"(?!{RESERVED_PART}(?:/|$))[^/]+"
    regex = rf"{_part}(?:/{_part})*"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("model_id", ModelIdConvertor())


def get_and_head(app: FastAPI, path: str, **options: Any) -> Callable[[Endpoint], Endpoint]:
    """``app.get`` that answers HEAD too, with the same handler (uvicorn sends the headers
    and drops the body). HEAD stays out of the OpenAPI document: it mirrors every GET."""

    def register(endpoint: Endpoint) -> Endpoint:
        app.get(path, **options)(endpoint)
        app.head(path, **{**options, "include_in_schema": False})(endpoint)
        return endpoint

    return register


@dataclass(frozen=True)
class Target:
    """What a URL path below ``/v1/models/`` asks for."""

    kind: str  # "model" (its info), "stream" or "tensor"
    model: str
    tensor: str | None = None

    @property
    def path(self) -> str:
        if self.kind == "model":
            return http_model_path(self.model)
        if self.kind == "stream":
            return http_model_path(self.model, "stream")
        return http_model_path(self.model, "tensors", self.tensor or "")

    def describe(self) -> str:
        if self.kind == "model":
            return f"model {self.model!r}"
        if self.kind == "stream":
            return f"a stream of model {self.model!r}"
        return f"tensor {self.tensor!r} of model {self.model!r}"


def legacy_readings(path: str) -> list[Target]:
    """Every way ``path`` (below ``/v1/models/``) reads in the layout without ``-``: the
    model named by all of it, a stream (``ID/stream``), one tensor (``ID/tensors/NAME``,
    split at each ``/tensors/``)."""
    readings = [Target("model", path)]
    if path.endswith("/stream"):
        readings.append(Target("stream", path.removesuffix("/stream")))
    marker = "/tensors/"
    at = path.find(marker)
    while at != -1:
        readings.append(Target("tensor", path[:at], path[at + len(marker) :]))
        at = path.find(marker, at + 1)
    return readings


def resolve_legacy(path: str, known: Callable[[str], bool]) -> Target | None:
    """The reading of ``path`` whose model ``known`` confirms (one the caller may read).

    A model named by the whole path wins (``/v1/models/ID`` is that model's own route, even
    when the id ends in ``/stream``); None when no reading names a known model; when several
    of the old forms do, InvalidRequest naming the unambiguous URL of each.
    """
    readings = [r for r in legacy_readings(path) if r.model and known(r.model)]
    if not readings:
        return None
    if readings[0].kind == "model" or len(readings) == 1:
        return readings[0]
    choices = "; ".join(f"{r.describe()}: {r.path}" for r in readings)
    raise InvalidRequest(
        f"/v1/models/{path} is ambiguous, it could mean {choices}. Use one of those URLs "
        f"(routes below a model start with /{RESERVED_PART}/)"
    )
