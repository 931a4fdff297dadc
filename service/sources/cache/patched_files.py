"""A node cache's changed safetensors files built from its copy of the base revision and the
upstream's delta stream, so an upstream weightserve sends patches, not files: the held file
copied in the kernel, the new header written, each tensor's update applied at its offset, the
result checked against the upstream's ETag before the fill puts it in place.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from weightserve.client.errors import WeightserveError
from weightserve.client.wire.delta import TensorUpdate
from weightserve.client.wire.file_patch import (
    SAFETENSORS_SUFFIX,
    PatchedCopy,
    Places,
    apply_to_files,
    patched_copy,
)
from weightserve.service.sources.files.stamps import file_stamp
from weightserve.service.sources.origin.base import Origin, OriginFile
from weightserve.service.sources.origin.past_revisions import model_file_name
from weightserve.service.sources.origin.upstream import UpstreamOrigin
from weightserve.service.sources.revisions.content import COMMIT_CHARS, content_revision, hash_file

log = logging.getLogger("weightserve.node_cache")

PATCH_BYTES = "patch"  # the kind the upstream's bytes for this are counted under


@dataclass
class _Building:
    """One file being built: its new version and its copy."""

    file: OriginFile
    copy: PatchedCopy


def commit_of(model_id: str, files: Iterable[tuple[str, int, str]]) -> str:
    """The commit of a model's files given as (origin name, size, version): the upstream's
    name for that revision (service/sources/revisions/content.py content_revision)."""
    named = ((model_file_name(model_id, name), size, version) for name, size, version in files)
    return content_revision(named)[:COMMIT_CHARS]


def build_from_patches(
    origin: Origin,
    model_id: str,
    held: list[tuple[str, int, str]],
    files: list[OriginFile],
    stale: list[OriginFile],
    data_dir: Path,
    partial_for: Callable[[OriginFile], Path],
    worth: Callable[[int, int], bool] | None = None,
) -> dict[str, tuple[Path, str]]:
    """Build each of ``stale`` that can be: a safetensors file of the model held (``held``: the
    whole copy's files as (name, size, version)) whose tensor layout the new version keeps.
    Returns, by name, the built file (``partial_for(file)``, not yet in place) and its
    xxh3-128, which is its listed version; any other file is left to be fetched whole.
    ``worth(delta bytes, bytes of the files to build)``: whether patching is worth it (a node
    whose peers could bring the files instead asks); False leaves every file to be fetched."""
    if not isinstance(origin, UpstreamOrigin):
        return {}  # only a weightserve upstream serves the delta stream
    versions = {name: version for name, _, version in held}
    candidates = [
        f
        for f in stale
        if f.name.endswith(SAFETENSORS_SUFFIX) and versions.get(f.name, f.version) != f.version
    ]
    if not candidates:
        return {}
    building: list[_Building] = []
    try:
        for file in candidates:
            found = _buildable(origin, file, data_dir / file.name, partial_for(file))
            if found is not None:
                building.append(found)
        if not building:
            return {}
        since, target = commit_of(model_id, held), commit_of(model_id, _named(files))
        if worth is not None and not _worth(origin, worth, building, since, target):
            log.info("the update of %r is fetched whole: its peers bring it for less", model_id)
            _discard(building)
            return {}
        return _build(origin, model_id, building, since, target)
    except WeightserveError as e:
        log.warning(
            "building %r from the upstream's patches failed (%s); fetching whole", model_id, e
        )
        _discard(building)
        return {}
    except OSError as e:
        log.warning("building %r from patches failed (%s); fetching whole", model_id, e)
        _discard(building)
        return {}


def _worth(
    origin: UpstreamOrigin,
    worth: Callable[[int, int], bool],
    building: list[_Building],
    since: str,
    target: str,
) -> bool:
    """``worth`` of the delta's size; True where the upstream cannot tell it (patching is
    what a node without peers does)."""
    try:
        delta = origin.delta_bytes(building[0].file, since, target)
    except WeightserveError as e:
        log.info("the upstream did not tell the update's size (%s): patching", e)
        return True
    return worth(delta, sum(b.file.size for b in building))


def _named(files: Iterable[OriginFile]) -> Iterator[tuple[str, int, str]]:
    return ((f.name, f.size, f.version) for f in files)


def _buildable(
    origin: UpstreamOrigin, file: OriginFile, held: Path, partial: Path
) -> _Building | None:
    """The file to build, when the held copy is a safetensors file with the new one's layout."""

    def read_range(offset: int, length: int) -> bytes:
        data = origin.read_range(file, offset, length)
        origin.requests.received(PATCH_BYTES, len(data))
        return data

    copy = patched_copy(held, partial, file.size, read_range)
    return None if copy is None else _Building(file, copy)


def _build(
    origin: UpstreamOrigin, model_id: str, building: list[_Building], since: str, target: str
) -> dict[str, tuple[Path, str]]:
    update, updates = origin.open_delta(building[0].file, since, target)
    if not update.base or not update.commit.startswith(target):
        # The upstream no longer holds the base, or moved on: the files come whole.
        with contextlib.suppress(WeightserveError):
            updates.close()
        _discard(building)
        return {}
    try:
        try:
            places = _open_copies(building)
        except BaseException:
            updates.close()
            raise
        try:
            _apply(origin, updates, places)
        except WeightserveError as e:  # the stream was cut: what it did not reach comes whole
            log.warning("the update of %r stopped (%s); fetching the rest whole", model_id, e)
        finally:
            updates.close()
            places.clear()  # no view of a mapping outlives it
        built: dict[str, tuple[Path, str]] = {}
        for b in building:
            b.copy.close()
            partial = b.copy.partial
            digest = hash_file(partial, file_stamp(partial.stat()))
            if b.copy.complete and digest == b.file.version:
                built[b.file.name] = (partial, digest)
                continue
            log.warning(
                "%s built from the held copy and the upstream's patch is %s, not the listed %s "
                "(the held copy was not the base); fetching it whole",
                b.file.name, digest, b.file.version,
            )  # fmt: skip
            partial.unlink(missing_ok=True)
        return built
    except BaseException:
        _discard(building)
        raise


def _open_copies(building: list[_Building]) -> Places:
    """Each file's copy, started from the held one (``open_patched_copy``); the tensors'
    places in them by name."""
    places: Places = {}
    for b in building:
        b.copy.open_into(places)
    return places


def _apply(origin: UpstreamOrigin, updates: Iterator[TensorUpdate], places: Places) -> None:
    apply_to_files(updates, places, lambda n: origin.requests.received(PATCH_BYTES, n))


def _discard(building: list[_Building]) -> None:
    for b in building:
        b.copy.discard()
