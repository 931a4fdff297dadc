"""What a node cache knew of each model's revisions: per commit, each file's size, origin
version, content digest and object version id as filled, kept across restarts, so a load of
a revision the origin has moved on from can be filled from the object versions recorded then.

A past revision's copy lies in the cache's data directory under ``.revisions/COMMIT/ID`` (a
hidden folder: the catalog of the data directory never sees it), filled and evicted by the
node cache like any model.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from weightserve.client.wire.routes import is_content_name
from weightserve.service.sources.origin.base import ObjectVersion
from weightserve.service.sources.revisions.content import COMMIT_CHARS, content_revision

log = logging.getLogger("weightserve.node_cache")

# The folder of past revisions' copies in the cache's data directory.
PAST_COPIES = ".revisions"
# Revisions remembered per model, newest kept: a model rewritten every few minutes must not
# grow its history file without bound.
KEEP_REVISIONS = 64
HISTORY_FORMAT = 1


def model_file_name(model_id: str, name: str) -> str:
    """The name an origin file ``name`` of the model has within the model, as a local root
    names it: relative to ``ID/``, or its base name for a file model (a GGUF, a split GGUF's
    part) that lies beside the id."""
    directory = model_id + "/"
    return name.removeprefix(directory) if name.startswith(directory) else name.rpartition("/")[2]


@dataclass(frozen=True)
class PastFile:
    """One file of a revision as it was filled: its origin name, size and version (ETag), the
    xxh3-128 of its bytes, and the object store's version id of them (None where the store
    keeps no versions)."""

    name: str
    size: int
    version: str
    digest: str
    version_id: str | None


@dataclass(frozen=True)
class PastRevision:
    """A revision of a model as the node filled it: ``digest`` is its full content digest
    (the revision and commit are its first characters)."""

    model_id: str
    digest: str
    files: tuple[PastFile, ...]

    @property
    def commit(self) -> str:
        return self.digest[:COMMIT_CHARS]

    @property
    def versioned(self) -> bool:
        """Whether every file's object version is known: the revision can be filled again."""
        return bool(self.files) and all(f.version_id for f in self.files)

    @property
    def copy_id(self) -> str:
        """The node cache's id of this revision's copy (its path below the data directory)."""
        return f"{PAST_COPIES}/{self.commit}/{self.model_id}"

    def copies(self) -> tuple[ObjectVersion, ...]:
        """The files of the copy, each to be fetched as the object version recorded."""
        prefix = f"{PAST_COPIES}/{self.commit}/"
        return tuple(
            ObjectVersion(prefix + f.name, f.size, f.version, f.name, f.version_id or "", f.digest)
            for f in self.files
        )


def revision_of(model_id: str, files: Iterable[PastFile]) -> PastRevision:
    """The revision ``files`` make: the digest a local root computes for the same bytes."""
    files = tuple(sorted(files, key=lambda f: f.name))
    digest = content_revision((model_file_name(model_id, f.name), f.size, f.digest) for f in files)
    return PastRevision(model_id, digest, files)


class RevisionHistory:
    """The revisions a node cache filled, per model, in ``directory`` (one JSON file a
    model, written whole and renamed); newest last, at most KEEP_REVISIONS each."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._revisions: dict[str, list[PastRevision]] = {}
        for path in sorted(self.directory.iterdir()):
            if path.suffix != ".json" or path.name.startswith("."):
                path.unlink(missing_ok=True)  # a write cut short
                continue
            try:
                document = json.loads(path.read_text(encoding="utf-8"))
                if document.get("format") != HISTORY_FORMAT:
                    raise ValueError(f"unknown format {document.get('format')!r}")
                model_id = str(document["model"])
                self._revisions[model_id] = [
                    revision_of(
                        model_id,
                        (
                            PastFile(
                                str(name),
                                int(f["size"]),
                                str(f["version"]),
                                str(f["digest"]),
                                None if f.get("version_id") is None else str(f["version_id"]),
                            )
                            for name, f in entry["files"].items()
                        ),
                    )
                    for entry in document["revisions"]
                ]
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                log.warning("ignoring unreadable revision history %s: %s", path, e)

    def record(self, model_id: str, files: Iterable[PastFile]) -> PastRevision:
        """Remember the revision ``files`` make as the newest of the model. A file whose
        version id is not known now keeps the one recorded with the same bytes before."""
        with self._lock:
            known = self._revisions.get(model_id, [])
            earlier = {
                (f.name, f.version, f.digest): f.version_id
                for revision in known
                for f in revision.files
                if f.version_id
            }
            revision = revision_of(
                model_id,
                (
                    f
                    if f.version_id
                    else PastFile(
                        f.name,
                        f.size,
                        f.version,
                        f.digest,
                        earlier.get((f.name, f.version, f.digest)),
                    )
                    for f in files
                ),
            )
            if known[-1:] == [revision]:
                return revision  # nothing new: a refill of the same bytes
            kept = [r for r in known if r.digest != revision.digest] + [revision]
            self._revisions[model_id] = kept[-KEEP_REVISIONS:]
            self._save(model_id)
            return revision

    def find(self, model_id: str, name: str) -> PastRevision | None:
        """The revision of the model ``name`` names (its commit, revision or a prefix of at
        least MIN_PREFIX_CHARS hex digits), if it is the one recorded revision that does."""
        if not is_content_name(name):
            return None
        name = name.lower()
        with self._lock:
            found = [r for r in self._revisions.get(model_id, []) if r.digest.startswith(name)]
        return found[0] if len(found) == 1 else None

    def revisions(self, model_id: str) -> list[PastRevision]:
        with self._lock:
            return list(self._revisions.get(model_id, []))

    def _save(self, model_id: str) -> None:
        document = {
            "format": HISTORY_FORMAT,
            "model": model_id,
            "revisions": [
                {
                    "commit": revision.commit,
                    "files": {
                        f.name: {
                            "size": f.size,
                            "version": f.version,
                            "digest": f.digest,
                            "version_id": f.version_id,
                        }
                        for f in revision.files
                    },
                }
                for revision in self._revisions[model_id]
            ],
        }
        path = self.directory / (urllib.parse.quote(model_id, safe="") + ".json")
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}")
        try:
            with open(temporary, "w", encoding="utf-8") as f:
                json.dump(document, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, path)
        except OSError as e:  # what is lost is a past revision's refill, not service
            temporary.unlink(missing_ok=True)
            log.warning("revision history of %r not saved (%s): kept in memory", model_id, e)
