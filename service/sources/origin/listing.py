"""The models an origin's listing names, by the local root's rules applied to file names alone
(service/sources/layout.py): a directory holding weight files is a model with every file below
it except sub-directories that are models themselves; each ``*.gguf`` file is a model (a split
GGUF's parts one, offered once every part is listed); weight files directly under the prefix
are models named by their file; hub cache repositories (revisions published into a bucket)
are models once the snapshot their ``refs/main`` names is listed."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from weightserve.client.errors import WeightserveError
from weightserve.service.sources.base import Problem
from weightserve.service.sources.layout import (
    checkpoint_format,
    gguf_models,
    hub_repo_file,
    is_served_name,
    is_weight_file,
    weight_format,
)
from weightserve.service.sources.origin.base import Origin, OriginFile

log = logging.getLogger("weightserve.service")


@dataclass(frozen=True)
class RemoteModel:
    """A model of the origin's listing, by name alone (not indexed until it is filled)."""

    id: str
    files: tuple[OriginFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def format(self) -> str:
        formats = {checkpoint_format(f.name) for f in self.files}
        return next((f for f in ("safetensors", "gguf", "pytorch") if f in formats), "")


def hub_repo_models(
    files: list[OriginFile], read_ref: Callable[[OriginFile], str] | None
) -> tuple[dict[str, list[OriginFile]], set[str]]:
    """Repositories in the hub cache's layout (revisions published into a bucket,
    service/sources/publishing/publisher.py): each is its model id with ``refs/main`` and the files of
    the snapshot it names (so the node's copy is laid out as the local catalog reads a hub
    cache), offered only once that snapshot is listed: the pointer is written last. Also
    every name inside such a repository, taken out of the other rules."""
    repos: dict[str, tuple[str, dict[str, OriginFile], dict[str, list[OriginFile]]]] = {}
    taken: set[str] = set()
    for f in files:
        found = hub_repo_file(f.name)
        if found is None:
            continue
        taken.add(f.name)
        _, refs, snapshots = repos.setdefault(found.folder, (found.model_id, {}, {}))
        if found.rest == "refs/main":
            refs["main"] = f
        elif found.rest.startswith("snapshots/"):
            commit, _, inner = found.rest.removeprefix("snapshots/").partition("/")
            if inner:
                snapshots.setdefault(commit, []).append(f)
    models: dict[str, list[OriginFile]] = {}
    for model_id, refs, snapshots in repos.values():
        pointer = refs.get("main")
        if pointer is None or read_ref is None:
            continue
        snapshot = snapshots.get(read_ref(pointer))
        if snapshot:
            models[model_id] = [pointer, *snapshot]
    return models, taken


def group_models(
    listing: list[OriginFile], read_ref: Callable[[OriginFile], str] | None = None
) -> tuple[dict[str, RemoteModel], dict[str, Problem]]:
    """Model id -> its files, from the origin's file names (the rules in the module docstring),
    and the models refused: a split GGUF (``NAME-00001-of-00002.gguf`` ...) is one model,
    ``NAME.gguf``, offered only when every part is listed, as from a local root. Hub cache
    repositories (``models--ORG--NAME``) are read with ``read_ref`` (``hub_repo_models``)."""
    files = [f for f in listing if is_served_name(f.name)]
    published, taken = hub_repo_models(files, read_ref)
    files = [f for f in files if f.name not in taken]
    weight_dirs = {
        directory
        for f in files
        if (directory := f.name.rpartition("/")[0]) and is_weight_file(f.name)
    }
    grouped: dict[str, list[OriginFile]] = {}
    plain, splits = gguf_models((f.name, f) for f in files)
    for name, f in plain:
        grouped[name] = [f]
    for f in files:
        directory, _, base = f.name.rpartition("/")
        if checkpoint_format(base) == "gguf":
            continue
        if not directory:
            if weight_format(base) is not None:
                grouped[f.name] = [f]
            continue
        parts = directory.split("/")
        for depth in range(len(parts), 0, -1):  # the deepest model directory holds the file
            owner = "/".join(parts[:depth])
            if owner in weight_dirs:
                grouped.setdefault(owner, []).append(f)
                break
    problems: dict[str, Problem] = {}
    for split in splits:
        if not split.whole:
            first = split.parts[min(split.parts)]
            problems[split.model] = Problem(
                split.model, first.name, split.refusal(" at the origin")
            )
        elif split.model not in grouped:  # a plain NAME.gguf beside the parts keeps its id
            grouped[split.model] = split.ordered()
    grouped.update(published)
    models = {model_id: RemoteModel(model_id, tuple(fs)) for model_id, fs in grouped.items()}
    return models, problems


class PublishedRefs:
    """The commits the ``refs/main`` objects of repositories published into the origin name,
    read once per version of each."""

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self._refs: dict[tuple[str, str], str] = {}  # (refs/main object, version) -> commit

    def read(self, pointer: OriginFile) -> str:
        """The commit a published repository's ``refs/main`` object names (read once per
        version of it); "" when it cannot be read."""
        key = (pointer.name, pointer.version)
        found = self._refs.get(key)
        if found is None:
            try:
                found = self.origin.read_range(pointer, 0, 256).decode("ascii").strip()
            except (WeightserveError, OSError, UnicodeDecodeError) as e:
                log.warning("cannot read %s at the origin: %s", pointer.name, e)
                return ""
            self._refs[key] = found
        return found
