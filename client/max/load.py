"""``load_weights`` / ``weights_format`` that take weightserve URLs as well as local paths.

Local paths go to MAX's own loaders (``max.graph.weights.load_weights``); URLs of one model
on a weightserve server become a ``RemoteWeights``. The format of a URL comes from the
server's model info, the format of a path from its suffix.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from weightserve.client._client import Client, FetchOptions
from weightserve.client._extras import install_hint
from weightserve.client._models import WEIGHT_FILE_SUFFIXES
from weightserve.client.max.compat import max_available
from weightserve.client.max.weights import RemoteWeights
from weightserve.client.transports.base import TLSOptions
from weightserve.client.wire.routes import is_url, parse_url

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["WeightsFormat", "load_weights", "weights_format"]


class WeightsFormat(str, Enum):
    """Checkpoint formats; equal to MAX's ``WeightsFormat`` members of the same name."""

    gguf = "gguf"
    safetensors = "safetensors"
    pytorch = "pytorch"


_SUFFIXES = {
    ".gguf": WeightsFormat.gguf,
    ".safetensors": WeightsFormat.safetensors,
    ".bin": WeightsFormat.pytorch,
    ".pt": WeightsFormat.pytorch,
    ".pth": WeightsFormat.pytorch,
}


CHECKPOINT_SUFFIXES = WEIGHT_FILE_SUFFIXES  # a file of any other name is a side file


class ConnectionArgs(TypedDict, total=False):
    """The keyword arguments of ``Client`` (its ``Connection``) that the loaders take and
    hand on: ``load_weights(url, token=..., timeout=...)``."""

    token: str | None
    tls: TLSOptions | None
    timeout: float
    retry_seconds: float | None


def _as_list(paths_or_urls: Any) -> list[Any]:
    if isinstance(paths_or_urls, (str, os.PathLike)):
        return [paths_or_urls]
    if isinstance(paths_or_urls, Iterable):
        return list(paths_or_urls)
    raise TypeError(f"expected a list of paths or URLs, got {type(paths_or_urls).__name__}")


def _model_url(urls: list[str]) -> str:
    """The one model several URLs name (shards of one model name the same model)."""
    targets = set()
    for url in urls:
        server, model = parse_url(url)
        if not model:
            raise ValueError(
                f"{url!r} names a server, not a model: use http://HOST:PORT/v1/models/MODEL"
                " or grpc://HOST:PORT/MODEL"
            )
        targets.add((server, model))
    if len(targets) > 1:
        names = ", ".join(sorted(f"{s.url} {m}" for s, m in targets))
        raise ValueError(f"the URLs name more than one model ({names}); give URLs of one model")
    return urls[0]


def _split(paths_or_urls: Any) -> tuple[list[str], list[Path]]:
    items = _as_list(paths_or_urls)
    if not items:
        raise ValueError("no weight paths or URLs given; cannot infer the weights format.")
    urls = [str(p) for p in items if isinstance(p, str) and is_url(p)]
    if urls and len(urls) != len(items):
        raise ValueError("give either local paths or weightserve URLs, not both")
    return urls, [Path(p) for p in items] if not urls else []


def _local_files(paths: list[Path]) -> list[Path]:
    """Paths with directories expanded to the checkpoint files in them."""
    out: list[Path] = []
    for path in paths:
        if path.is_dir():
            found: list[Path] = []
            for suffixes in ((".safetensors",), (".gguf",), (".bin", ".pt", ".pth")):
                found = sorted(p for p in path.iterdir() if p.suffix in suffixes)
                if found:
                    break
            if not found:
                raise ValueError(f"no checkpoint files (.safetensors, .gguf, .bin) in {path}")
            out.extend(found)
        else:
            out.append(path)
    return out


def _format_of_paths(paths: list[Path]) -> WeightsFormat:
    formats = {_SUFFIXES.get(p.suffix) for p in paths}
    if None in formats or len(formats) != 1:
        raise ValueError(f"weights type cannot be inferred from {[str(p) for p in paths]}")
    return formats.pop()  # type: ignore[return-value]


def weights_format(
    paths_or_urls: Any, *, revision: str | None = None, **connection: Unpack[ConnectionArgs]
) -> WeightsFormat:
    """The format of local checkpoint files (by suffix; directories by their contents) or of
    the model several URLs name (asked from the server; ``revision`` as for ``load_weights``;
    ``token``, ``tls``, ``timeout`` and ``retry_seconds`` as for ``Client``)."""
    urls, paths = _split(paths_or_urls)
    if urls:
        url = _model_url(urls)
        _, model_id = parse_url(url)
        with Client(url, **connection) as c:
            info = c.model_info(model_id or "", revision=revision)
        return WeightsFormat(info.format)
    return _format_of_paths(_local_files(paths))


def load_weights(
    paths_or_urls: Any,
    *,
    use_max: bool | None = None,
    options: FetchOptions | None = None,
    verify: str | None = None,
    revision: str | None = None,
    **connection: Unpack[ConnectionArgs],
) -> Any:
    """``Weights`` for local checkpoint files or for a model on a weightserve server.

    URLs (``http://host:port/v1/models/NAME``, ``grpc://host:port/NAME``; several URLs must
    name one model) give a ``RemoteWeights``. Local paths are loaded by MAX's own
    ``load_weights`` (so they need the ``max`` package); a directory stands for the
    checkpoint files in it. ``token``, ``tls`` and ``timeout`` are as for ``Client``;
    ``retry_seconds`` bounds how long a busy or unreachable server
    is waited for (default ``WEIGHTSERVE_RETRY_SECONDS``, else 60 s; see ``Client``).
    ``verify`` says which chunk digests are checked: ``"full"``, ``"sample"`` or ``"none"``
    (default ``WEIGHTSERVE_VERIFY``, else ``"full"``; see ``FetchOptions``). ``revision``
    (or ``ID@R`` in the URLs: ``http://host:port/v1/models/NAME@COMMIT``) pins a revision:
    a commit (40 hex digits, or a prefix of at least 12) or a ref (``main``); the load gets
    exactly its bytes or ``RevisionNotFound``. Local paths take no revision.
    """
    urls, paths = _split(paths_or_urls)
    if urls:
        return RemoteWeights(
            _model_url(urls),
            use_max=use_max,
            options=options,
            verify=verify,
            revision=revision,
            **connection,
        )
    if revision is not None:
        raise ValueError("revision= pins a model on a weightserve server; local paths have none")
    files = _local_files(paths)
    fmt = _format_of_paths(files) if all(p.exists() for p in files) else None
    if fmt is WeightsFormat.pytorch:
        raise ValueError(
            "MAX does not load PyTorch checkpoints from files; serve them with"
            " `weightserve serve DIR` and pass the model URL instead"
        )
    if use_max is False or not max_available():
        raise ImportError(
            f"loading local checkpoint files needs the max package ({install_hint('max')});"
            " without it, serve them with `weightserve serve DIR` and pass the model URL"
        )
    from max.graph.weights import load_weights as max_load_weights

    return max_load_weights(files)
