"""The upstream's side of the swarm: it admits nodes to a revision's swarm and names them to
each other.

A join (``SwarmDesk.join``, the route ``POST /v1/models/ID/-/swarm``) comes with the node's
token, already checked against the model by the route: it names the revision, the node's peer
port and a certificate request. The answer is the revision's torrent (made once, torrents.py),
a peer certificate signed by that torrent's authority, the nodes that joined the same revision
recently, and the file digests the node checks its fill against.
"""

from __future__ import annotations

import base64
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightserve.service.sources.swarm.engine import ANNOUNCE_SECONDS
from weightserve.service.sources.swarm.torrents import TorrentShelf

# A node that has not re-announced for this long is no longer named to others.
PEER_TTL_SECONDS = 3 * ANNOUNCE_SECONDS
# At most this many peers in one answer: the most recently heard from first.
MAX_PEERS = 50


@dataclass(frozen=True)
class Revision:
    """What the desk needs of the model at the revision a join names."""

    model: str
    commit: str
    revision: str
    files: dict[str, Path]  # name below the model -> the file on this server's disk
    etags: dict[str, str]  # name below the model -> xxh3-128 digest


class SwarmDesk:
    """Torrents kept in ``shelf_dir``; nodes known per revision for ``PEER_TTL_SECONDS``."""

    def __init__(self, shelf_dir: Path) -> None:
        self.shelf = TorrentShelf(shelf_dir)
        self._lock = threading.Lock()
        # commit -> (address, port) -> (last heard from (monotonic), holds it whole)
        self._peers: dict[str, dict[tuple[str, int], tuple[float, bool]]] = {}
        self.joins = 0

    def join(
        self,
        revision: Revision,
        address: str,
        port: int,
        request_pem: bytes,
        leaving: bool = False,
        complete: bool = False,
    ) -> dict[str, Any]:
        torrent = self.shelf.get(revision.commit, lambda: revision.files)
        node = (address, port)
        now = time.monotonic()
        with self._lock:
            self.joins += 1
            known = self._peers.setdefault(revision.commit, {})
            for peer, (seen, _) in list(known.items()):
                if now - seen > PEER_TTL_SECONDS:
                    del known[peer]
            if leaving:
                known.pop(node, None)
            else:
                known[node] = (now, complete)
            others = sorted(
                (peer for peer in known if peer != node), key=lambda p: known[p][0], reverse=True
            )[:MAX_PEERS]
            wholes = {peer: known[peer][1] for peer in others}
        certificate = b"" if leaving else torrent.authority.sign(request_pem, f"{address}:{port}")
        return {
            "commit": revision.commit,
            "revision": revision.revision,
            "torrent": base64.b64encode(torrent.data).decode(),
            "certificate": certificate.decode(),
            "files": revision.etags,
            "peers": [{"address": a, "port": p, "complete": wholes[(a, p)]} for a, p in others],
            # How the upstream names this node among the peers (its share of a fill, engine.py).
            "you": {"address": address, "port": port},
        }

    def peers(self) -> int:
        """Nodes known across every revision (a gauge)."""
        with self._lock:
            return sum(len(known) for known in self._peers.values())
