"""A revision described as a torrent: BitTorrent v2 only (a SHA-256 Merkle tree per file, so a
piece is checked as it lands), private (no DHT, no peer exchange outside the peers the upstream
names), and an SSL torrent whose root certificate belongs to this torrent alone (certs.py).

The torrent is named by the revision's commit and lists the model's files below it
(``COMMIT/config.json``, ``COMMIT/model.safetensors``): with the upstream's Hub route
``/{model}/resolve/`` as web seed, BEP 19 asks ``/{model}/resolve/COMMIT/{file}``, exactly the
revision's bytes. The upstream makes it once per revision and keeps it, with its authority, in
a shelf directory (``TorrentShelf``): the same revision keeps the same info-hash across
restarts, so nodes seeding it stay one swarm.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from weightserve.service.sources.swarm.certs import SwarmAuthority

try:
    import libtorrent as lt
except ImportError:  # the `peers` extra is not installed: no swarm, fills from the upstream
    lt = None  # type: ignore[assignment]

_COMMIT_CHARS = frozenset("0123456789abcdef")
MIN_PIECE_BYTES = 256 << 10
MAX_PIECE_BYTES = 16 << 20
MAX_PIECES = 1 << 16


def libtorrent_missing() -> str | None:
    """Why a swarm cannot run here (None: it can)."""
    if lt is None:
        # The wording of client/_extras.py's hints (the service imports no private client module).
        return (
            "libtorrent is not installed: install weightserve's peers extra (pip install -e "
            "'.[peers]' in a checkout, or the wheel python -m build makes there with [peers])"
        )
    return None


@dataclass(frozen=True)
class RevisionTorrent:
    """A revision's torrent (bencoded) and the authority that admits its peers."""

    commit: str
    data: bytes
    authority: SwarmAuthority

    def files(self, names: Iterable[str] = ()) -> dict[str, int]:
        """The model's files it lists, by name below the model, with their sizes."""
        return torrent_files(self.data, self.commit, names)


def torrent_names(data: bytes, commit: str, names: Iterable[str] = ()) -> dict[int, str]:
    """A revision torrent's files (pad files left out): index -> name below the model.

    A torrent of several files is named by the commit and lists ``COMMIT/NAME``; libtorrent
    makes a torrent of one file a single-file torrent named by that file's base name, which
    is then matched against ``names`` (the revision's files). ValueError when it is neither."""
    info = lt.torrent_info(data)
    layout = info.layout()
    files = [
        i for i in range(layout.num_files()) if not layout.file_flags(i) & layout.flag_pad_file
    ]
    if info.name() == commit:
        prefix = commit + "/"
        found = {i: layout.file_path(i) for i in files}
        if all(path.startswith(prefix) for path in found.values()):
            return {i: path.removeprefix(prefix) for i, path in found.items()}
    elif len(files) == 1:
        matches = [n for n in names if n.rpartition("/")[2] == info.name()]
        if len(matches) == 1:
            return {files[0]: matches[0]}
    raise ValueError(f"the torrent {info.name()!r} does not describe the revision {commit!r}")


def torrent_files(data: bytes, commit: str, names: Iterable[str] = ()) -> dict[str, int]:
    """A revision torrent's files by name below the model, with their sizes."""
    layout = lt.torrent_info(data).layout()
    return {name: layout.file_size(i) for i, name in torrent_names(data, commit, names).items()}


def piece_bytes(total: int) -> int:
    """The piece size for a revision of ``total`` bytes: small enough that peers start
    trading early and a web seed request fetches little that another node also fetches,
    large enough that a 1 TB model has under 250,000 pieces."""
    size = MIN_PIECE_BYTES
    while size < MAX_PIECE_BYTES and total // size > MAX_PIECES:
        size *= 2
    return size


def describe(commit: str, files: dict[str, Path]) -> RevisionTorrent:
    """The torrent of a revision whose files (name below the model -> the file on disk) are
    ``files``; their pieces hashed here (libtorrent reads each file once)."""
    if not commit or not set(commit) <= _COMMIT_CHARS:
        raise ValueError(f"a revision torrent is named by a hex commit, not {commit!r}")
    authority = SwarmAuthority.create(commit)
    with tempfile.TemporaryDirectory(prefix="ws-torrent-") as tmp:
        # set_piece_hashes reads PARENT/NAME/FILE: links to the files where they lie.
        top = Path(tmp) / commit
        entries = []
        for name, path in sorted(files.items()):
            link = top / name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(path.resolve())
            entries.append(lt.create_file_entry(f"{commit}/{name}", path.stat().st_size))
        total = sum(path.stat().st_size for path in files.values())
        creator = lt.create_torrent(entries, piece_bytes(total), lt.create_torrent.v2_only)
        creator.set_priv(True)
        creator.set_creator("weightserve")
        creator.set_root_cert(authority.certificate_pem.decode())
        lt.set_piece_hashes(creator, tmp)
        data = lt.bencode(creator.generate())
    return RevisionTorrent(commit, data, authority)


class TorrentShelf:
    """Revision torrents kept in ``directory`` (``COMMIT.torrent`` and ``COMMIT.json``, the
    authority, readable by this user alone), each made once however many nodes ask at once."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._making: dict[str, threading.Lock] = {}
        self._held: dict[str, RevisionTorrent] = {}

    def get(self, commit: str, files: Callable[[], dict[str, Path]]) -> RevisionTorrent:
        """The torrent of ``commit``, made from ``files()`` the first time it is asked for."""
        with self._lock:
            held = self._held.get(commit)
            if held is not None:
                return held
            making = self._making.setdefault(commit, threading.Lock())
        with making:
            with self._lock:
                held = self._held.get(commit)
            if held is None:
                held = self._load(commit) or self._make(commit, files())
                with self._lock:
                    self._held[commit] = held
            return held

    def _load(self, commit: str) -> RevisionTorrent | None:
        torrent, keys = self._paths(commit)
        try:
            data = torrent.read_bytes()
            authority = json.loads(keys.read_text())
        except (OSError, ValueError):
            return None  # absent or torn: made again (a new info-hash; nothing else changes)
        return RevisionTorrent(
            commit,
            data,
            SwarmAuthority(authority["key"].encode(), authority["certificate"].encode()),
        )

    def _make(self, commit: str, files: dict[str, Path]) -> RevisionTorrent:
        made = describe(commit, files)
        torrent, keys = self._paths(commit)
        self.directory.mkdir(parents=True, exist_ok=True)
        authority = {
            "key": made.authority.key_pem.decode(),
            "certificate": made.authority.certificate_pem.decode(),
        }
        _write_atomically(keys, json.dumps(authority).encode(), 0o600)
        _write_atomically(torrent, made.data, 0o644)
        return made

    def _paths(self, commit: str) -> tuple[Path, Path]:
        return self.directory / f"{commit}.torrent", self.directory / f"{commit}.json"


def _write_atomically(path: Path, data: bytes, mode: int) -> None:
    partial = path.with_name(f".{path.name}.partial")
    with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
