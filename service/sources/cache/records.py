"""The node cache's book: what it holds, model by model (fill records, saved in one state file
per model), what runs (fills, streams holding models), and the names it accepts.

A file's fill record is the truth about it: the origin's identity of it (size, version) and
the content digest (xxh3-128) of the bytes verified when it was filled (integrity.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import threading
import time
import urllib.parse
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from weightserve.client.errors import (
    ModelUnavailable,
)
from weightserve.service.sources.cache.landing import Fill
from weightserve.service.sources.cache.stats import CacheStats
from weightserve.service.sources.files.stamps import FileStamp

if TYPE_CHECKING:
    from weightserve.service.sources.origin.base import OriginFile

log = logging.getLogger("weightserve.node_cache")


# 2: each file's record holds its content digest and stamp. Files recorded by format 1
# have no digest to be checked against, so they are filled again.
STATE_FORMAT = 2
PARTIAL_MARK = ".partial-"


@dataclass(frozen=True)
class FillRecord:
    """One cached file as it was filled: the origin's identity of it (``size``, ``version``),
    the xxh3-128 ``digest`` of the bytes verified then (what the node reports and serves),
    and the file's ``stamp`` once in place (a file with another stamp is hashed again)."""

    size: int
    version: str
    digest: str
    stamp: FileStamp


@dataclass
class ModelState:
    files: dict[str, FillRecord] = field(default_factory=dict)  # by file name
    complete: bool = False  # every file of the model's last listing is among ``files``
    last_used: float = 0.0  # time.time(); the state file's mtime across restarts

    @property
    def size(self) -> int:
        return sum(record.size for record in self.files.values())


class CacheBook:
    """What the node cache knows of its models, under one ``lock``: each model's fill records
    (saved in its state file, read back at start), the fills running, the streams holding
    models, the files verified in this process and why files were dropped, and the counters.
    The fills, the room and the integrity checks (fills.py, room.py, integrity.py) read and
    change it under that lock."""

    def __init__(self, directory: Path, pins: frozenset[str]) -> None:
        self.directory = directory
        self.data_dir = directory / "data"
        self.state_dir = directory / "state"
        self.pins = pins
        self.stats = CacheStats()
        self.lock = threading.Lock()
        self.states: dict[str, ModelState] = {}
        self.fills: dict[str, Fill] = {}
        self.holds: dict[str, int] = {}
        # Why a model's file was dropped, until it is filled again (for a clear refusal).
        self.corruptions: dict[str, str] = {}
        # Files whose bytes this process hashed at this stamp (filled, or checked since).
        self.verified: set[tuple[str, FileStamp]] = set()
        for folder in (self.data_dir, self.state_dir):
            folder.mkdir(parents=True, exist_ok=True)
        self.data_real = self.data_dir.resolve()  # catalogs name files by resolved paths

    def model_path(self, model_id: str) -> Path:
        """Where the model lies in the cache: its directory, or its file for a one-file model."""
        return self.data_dir / _checked_name(model_id, "model id")

    def touch(self, model_id: str) -> None:
        """Mark the model used now (least-recently-used order survives a restart)."""
        with self.lock:
            state = self.states.get(model_id)
            if state is None:
                return
            state.last_used = time.time()
        with contextlib.suppress(OSError):
            os.utime(self.state_path(model_id), (state.last_used, state.last_used))

    def cached_models(self) -> list[str]:
        """Ids of the models held whole (servable even while the origin is down)."""
        with self.lock:
            return sorted(m for m, state in self.states.items() if state.complete)

    def holds_whole(self, model_id: str, files: Collection[OriginFile]) -> bool:
        """Whether the model is held whole as ``files`` (the origin's listing of it) name it:
        by its fill records, each file of the listed size and version and no other file."""
        with self.lock:
            state = self.states.get(model_id)
            if state is None or not state.complete:
                return False
            recorded = {name: (r.size, r.version) for name, r in state.files.items()}
        return recorded == {f.name: (f.size, f.version) for f in files}

    def records(self, model_id: str) -> dict[str, FillRecord]:
        """The fill records of the model held whole, by file name ({} when it is not)."""
        with self.lock:
            state = self.states.get(model_id)
            return dict(state.files) if state is not None and state.complete else {}

    def state_path(self, model_id: str) -> Path:
        return self.state_dir / (urllib.parse.quote(model_id, safe="") + ".json")

    def save(self, model_id: str) -> None:
        state = self.states[model_id]
        document = {
            "format": STATE_FORMAT,
            "model": model_id,
            "complete": state.complete,
            "files": {
                name: {
                    "size": record.size,
                    "version": record.version,
                    "digest": record.digest,
                    "stamp": list(record.stamp),
                }
                for name, record in sorted(state.files.items())
            },
        }
        path = self.state_path(model_id)
        temporary = path.with_name(f".{path.name}{PARTIAL_MARK}{secrets.token_hex(6)}")
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump(document, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)

    def remove_data(self, name: str) -> None:
        path = self.data_dir / name
        path.unlink(missing_ok=True)
        # Empty directories left behind would shadow nothing but clutter listings.
        for parent in path.parents:
            if parent == self.data_dir or not parent.is_relative_to(self.data_dir):
                break
            try:
                parent.rmdir()
            except OSError:
                break

    def bytes_used(self) -> int:
        used = 0
        for model_id, state in self.states.items():
            fill = self.fills.get(model_id)
            used += state.size + (fill.remaining if fill else 0)
        return used

    def bytes_on_disk(self) -> int:
        """The cache's bytes on its file system now: whole files and the files being written
        (allocated whole before their first byte)."""
        held = sum(state.size for state in self.states.values())
        return held + sum(fill.writing for fill in self.fills.values())

    def count_use(self, model_id: str, *, hit: bool) -> None:
        if hit:
            self.stats.hits += 1
        else:
            self.stats.misses += 1  # waited for another caller's fill

    def load(self) -> list[tuple[str, str, FillRecord]]:
        """Read the state files (partials and unreadable ones removed): every file recorded,
        as (model id, name, record), for the caller to check against the disk before
        ``remove_unrecorded``."""
        recorded: list[tuple[str, str, FillRecord]] = []
        for path in sorted(self.state_dir.iterdir()):
            if PARTIAL_MARK in path.name or path.suffix != ".json":
                path.unlink(missing_ok=True)
                continue
            try:
                document = json.loads(path.read_text(encoding="utf-8"))
                model_id = _checked_name(document["model"], "model id")
                if document.get("format") == 1:
                    # No digest to check the files against: they are filled again.
                    log.info("node cache state %s has no fill digests; refilling", path)
                    files: dict[str, FillRecord] = {}
                elif document.get("format") != STATE_FORMAT:
                    raise ValueError(f"unknown format {document.get('format')!r}")
                else:
                    files = {
                        _checked_name(name, "file name"): FillRecord(
                            int(entry["size"]),
                            str(entry["version"]),
                            str(entry["digest"]),
                            FileStamp(*(int(n) for n in entry["stamp"])),
                        )
                        for name, entry in document["files"].items()
                    }
                complete = bool(document["complete"]) and bool(files)
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                log.warning("ignoring unreadable node cache state %s: %s", path, e)
                path.unlink(missing_ok=True)
                continue
            self.states[model_id] = ModelState(
                dict(files), complete, last_used=path.stat().st_mtime
            )
            recorded += [(model_id, name, record) for name, record in files.items()]
        return recorded

    def remove_unrecorded(self) -> None:
        """Remove the files under the data directory that no whole model records."""
        recorded = {name for state in self.states.values() for name in state.files}
        for root, _, names in os.walk(self.data_dir):
            for name in names:
                path = Path(root, name)
                if path.relative_to(self.data_dir).as_posix() not in recorded:
                    log.info("removing %s from the node cache: no whole model records it", path)
                    self.remove_data(path.relative_to(self.data_dir).as_posix())


def _checked_name(name: str, what: str) -> str:
    """``name`` if it is a plain relative '/'-separated path, else a clear error: a name from
    an origin must never reach outside the cache directory or pass for a partial file."""
    parts = name.split("/")
    if (
        not name
        or "\\" in name
        or "\0" in name
        or any(part in ("", ".", "..") for part in parts)
        or PARTIAL_MARK in parts[-1]
    ):
        raise ModelUnavailable(
            f"{what} {name!r} cannot be kept in the node cache: it must be a relative path "
            f"with '/' between non-empty parts, no '.' or '..' part, and no {PARTIAL_MARK!r}"
        )
    return name
