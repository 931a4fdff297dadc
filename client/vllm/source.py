"""Where a vLLM engine's weights come from: the server, the model on it, the revision and the
token, taken from ``model_loader_extra_config`` or the environment the way vLLM users set
them; the one revision every rank of an engine loads; the side files vLLM read, checked
against the server's digests.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from weightserve.client._client import Client, RemoteModel
from weightserve.client.wire.digests import file_digest
from weightserve.client.wire.routes import parse_url, split_revision

__all__ = ["ServedSource", "agreed", "check_side_files"]

# Keys of ``model_loader_extra_config`` (and of the transfer backend's init info).
EXTRA_KEYS = ("url", "model", "revision", "token")


class SourceError(ValueError):
    """The engine's configuration does not say where its weights are."""


@dataclass(frozen=True)
class ServedSource:
    """One model on one weightserve server, as a vLLM engine loads it."""

    url: str  # the server: http(s)://host:port, grpc://host:port or unix://...
    model: str  # the model's id on the server
    revision: str | None  # a commit, a revision or a ref; None: main
    token: str | None

    @classmethod
    def from_config(cls, extra: Mapping[str, Any] | None, model_config: Any) -> ServedSource:
        """From ``model_loader_extra_config`` (``url``, ``model``, ``revision``, ``token``),
        else ``WEIGHTSERVE_URL`` / ``HF_ENDPOINT`` (the server's Hub routes, through which
        vLLM read the config), vLLM's ``model`` and ``revision``, ``WEIGHTSERVE_TOKEN`` /
        ``HF_TOKEN``."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise SourceError(
                f"model_loader_extra_config has {', '.join(unknown)}: the weightserve load "
                f"format takes {', '.join(EXTRA_KEYS)}"
            )
        url = extra.get("url") or os.environ.get("WEIGHTSERVE_URL") or os.environ.get("HF_ENDPOINT")
        if not url:
            raise SourceError(
                "--load-format weightserve needs the server: model_loader_extra_config="
                '{"url": "http://HOST:PORT"}, or WEIGHTSERVE_URL, or HF_ENDPOINT pointing at '
                "the server's Hub routes"
            )
        address, model_in_url = parse_url(url)
        model = extra.get("model") or model_in_url or _hub_id(model_config)
        if not model:
            raise SourceError(
                f"vLLM's model {getattr(model_config, 'model', None)!r} is a local directory: "
                'name the served model with model_loader_extra_config={"model": ID}'
            )
        model, pinned = split_revision(model)
        revision = extra.get("revision") or pinned or getattr(model_config, "revision", None)
        token = extra.get("token") or os.environ.get("WEIGHTSERVE_TOKEN") or None
        token = token or os.environ.get("HF_TOKEN") or None
        return cls(address.url, model, revision or None, token)

    def with_overrides(self, overrides: Mapping[str, Any]) -> ServedSource:
        """This source with the fields ``overrides`` gives (None: kept)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        unknown = sorted(set(given) - set(EXTRA_KEYS))
        if unknown:
            raise SourceError(f"unknown fields {', '.join(unknown)}: expected {EXTRA_KEYS}")
        return replace(self, **given)

    def client(self) -> Client:
        return Client(self.url, token=self.token)

    def open(self, client: Client, revision: str | None = None) -> RemoteModel:
        """The model at ``revision`` (default: this source's) on ``client``."""
        return client.model(self.model, revision=revision or self.revision)

    def commit(self, client: Client, revision: str | None = None) -> str:
        """The commit ``revision`` (default: this source's) names on ``client`` now."""
        remote = self.open(client, revision)
        if not remote.commit:
            raise RuntimeError(
                f"the server at {remote.client.address.url} does not name its revisions' "
                "commits; upgrade it to load from vLLM"
            )
        return remote.commit


def _hub_id(model_config: Any) -> str | None:
    """vLLM's ``model`` when it names a repository (the Hub routes' id), not a directory."""
    name = getattr(model_config, "model", None)
    if not name or Path(name).is_dir():
        return None
    return str(name)


def agreed(decide: Callable[[], str]) -> str:
    """``decide()`` run on the first rank of the engine's world, its answer (or its error)
    given to every rank: the ranks of one engine load one revision even while ``main``
    moves."""
    group = _world_group()
    if group is None or group.world_size == 1:
        return decide()
    answer: tuple[str, str] | None = None
    if group.rank_in_group == 0:
        try:
            answer = ("ok", decide())
        except Exception as e:  # every rank must hear of it, or the others wait for ever
            answer = ("error", f"{type(e).__name__}: {e}")
            group.broadcast_object(answer, src=0)
            raise
    outcome, value = group.broadcast_object(answer, src=0)
    if outcome != "ok":
        raise RuntimeError(f"the first rank could not resolve the revision: {value}")
    return str(value)


def _world_group() -> Any:
    try:
        from vllm.distributed import parallel_state
    except ImportError:
        return None
    if parallel_state._WORLD is None:  # outside an engine (a test, a script)
        return None
    return parallel_state.get_world_group()


def check_side_files(remote: RemoteModel, model_config: Any) -> list[str]:
    """The side files (config, tokenizer...) vLLM read for this engine, each checked against
    the server's digest for the revision loaded: the names checked. A file that differs (a
    cache holding another revision's, a proxy that changed it) is refused by name."""
    served = {f.name: f for f in remote.files() if f.is_side_file}
    checked = []
    for name, remote_file in sorted(served.items()):
        path = _local_copy(model_config, name)
        if path is None:
            continue
        digest = file_digest(path)
        if digest != remote_file.etag:
            raise ValueError(
                f"{path}: vLLM read a {name} that is not the server's for {remote.id} at "
                f"{remote.commit} (xxh3-128 {digest}, the server's {remote_file.etag}); "
                "pin the revision (--revision COMMIT) or clear the cached copy"
            )
        checked.append(name)
    return checked


def _local_copy(model_config: Any, name: str) -> Path | None:
    """Where vLLM found ``name``: its model directory, or the Hugging Face cache."""
    model = str(getattr(model_config, "model", "") or "")
    if model and Path(model).is_dir():
        path = Path(model) / name
        return path if path.is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(model, name, revision=getattr(model_config, "revision", None))
    return Path(found) if isinstance(found, str) else None
