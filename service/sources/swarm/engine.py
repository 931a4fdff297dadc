"""A node's side of the swarm: one libtorrent session that fills revisions from peers and the
upstream's web seed at once, and seeds the revisions the node holds.

The session speaks only TLS to peers (SSL torrents, certs.py): it listens on the peer port with
libtorrent's SSL flag, and each torrent carries the certificate the upstream signed for this
node. DHT, local peer discovery, UPnP, NAT-PMP and uTP are off: peers are the ones the upstream
names. Every peer, on the LAN or not, is in libtorrent's global peer class, so the upload cap
holds for all of them (LAN peers are exempt from rate limits by default).
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightserve.service.sources.swarm.certs import NodeKey, dh_params_pem
from weightserve.service.sources.swarm.torrents import (
    libtorrent_missing,
    lt,
    torrent_files,
    torrent_names,
)

log = logging.getLogger("weightserve.swarm")

DEFAULT_PEER_PORT = 6881
# A filling node asks the upstream for newly arrived peers this often; a seeding node
# re-announces itself (the upstream forgets a node not heard from in 3 of these).
ANNOUNCE_SECONDS = 10.0
# How often a running fill looks at its torrent (progress, bytes by source, the end).
POLL_SECONDS = 0.05
# A fill that gains no verified byte for this long is abandoned: the upstream alone fetches
# what is missing (the ordinary fill).
DEFAULT_STALL_SECONDS = 30.0


# A filling node asks again soon after it joined (the nodes of a rollout join within moments
# of each other, and each one's share depends on how many fill at once), then less often.
_ANNOUNCES_WHILE_FILLING = (0.3, 0.6, 1.2, 2.5, 5.0)


# No peer connected, or peers bringing no verified byte, for this long: the upstream gives
# what is missing (a peer gone, a share that stopped). Peers on one network answer in
# milliseconds; a node whose cores are busy with other work may want longer.
DEFAULT_PEER_PATIENCE_SECONDS = 1.0
# Reads of the upstream in flight per fill (its pieces are 256 KiB and up).
_FEED_STREAMS = 4


# Reads of the upstream's files route: (name below the model, offset, length) -> the bytes.
ReadRange = Callable[[str, int, int], bytes]


def _piece_spans(layout: Any, files: dict[int, str]) -> dict[int, tuple[str, int, int]]:
    """Piece -> (file name below the model, offset, length) of the pieces of ``files`` (index
    -> name), in order (a v2 torrent aligns every file to a piece)."""
    length = layout.piece_length()
    spans: dict[int, tuple[str, int, int]] = {}
    for i, name in sorted(files.items()):
        size = layout.file_size(i)
        first = layout.piece_index_at_file(i)
        for j in range(-(-size // length)):
            spans[first + j] = (name, j * length, min(length, size - j * length))
    return spans


class _Feeder:
    """Pieces read from the upstream on a few threads and handed to libtorrent, which checks
    each against the torrent's Merkle tree and tells the peers it has it."""

    def __init__(self, handle: Any, read: ReadRange, spans: dict[int, tuple[str, int, int]]):
        self.handle, self.read, self.spans = handle, read, spans
        self.total = sum(length for _, _, length in spans.values())
        self.fed = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(_FEED_STREAMS, "swarm-feed")
        self._running: dict[int, concurrent.futures.Future[None]] = {}

    def want(self, pieces: list[int]) -> None:
        """Read these pieces (in this order) as reads in flight allow."""
        for piece in pieces:
            if len(self._running) >= _FEED_STREAMS:
                return
            if piece not in self._running:
                self._running[piece] = self._pool.submit(self._feed, piece)

    def _feed(self, piece: int) -> None:
        name, offset, length = self.spans[piece]
        data = self.read(name, offset, length)
        if len(data) != length:
            raise SwarmUnavailable(f"the upstream gave {len(data)} bytes of {name} at {offset}")
        self.handle.add_piece(piece, data, 0)
        self.fed += length

    def check(self) -> None:
        """Forget the reads that ended; the first that failed raises."""
        for piece, future in list(self._running.items()):
            if future.done():
                del self._running[piece]
                error = future.exception()
                if error is not None:
                    raise SwarmUnavailable(f"reading from the upstream failed: {error}") from error

    def __enter__(self) -> _Feeder:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class SwarmUnavailable(Exception):
    """The swarm cannot fill this (no answer, a refusal, a stall): fill from the upstream."""


@dataclass(frozen=True)
class PeerSettings:
    """How a node takes part: where it listens for peers, what it tells the upstream, how
    fast it may upload to all peers together (bytes/s, 0: no cap), how long a fill waits on
    silent peers before the upstream gives what is missing, and before it is abandoned."""

    port: int = DEFAULT_PEER_PORT
    host: str = "0.0.0.0"
    advertise: str | None = (
        None  # the address peers reach this node at; None: as the upstream sees it
    )
    upload_limit: int = 0
    stall_seconds: float = DEFAULT_STALL_SECONDS
    patience_seconds: float = DEFAULT_PEER_PATIENCE_SECONDS


@dataclass
class PeerCounters:
    """Payload bytes a node received by source, and what the engine refused."""

    from_peers: int = 0
    from_upstream: int = 0
    uploaded: int = 0
    fills: int = 0
    fills_abandoned: int = 0
    hash_failures: int = 0
    peers_banned: int = 0
    seeding: int = 0


# Join: (model id on the upstream, request body) -> the upstream's answer (docs/protocol.md,
# "Peer fills"); raises on refusal or when the upstream cannot be reached.
Join = Callable[[str, dict[str, Any]], dict[str, Any]]


@dataclass
class Admission:
    """What the upstream answered a join with."""

    model: str
    commit: str
    revision: str
    torrent: bytes
    certificate: str
    etags: dict[str, str]  # name below the model -> xxh3-128 digest
    peers: list[tuple[str, int]]
    seeds: frozenset[tuple[str, int]] = frozenset()  # the peers that hold the revision whole
    you: tuple[str, int] | None = None  # this node, as the upstream names it among peers

    def share(self) -> tuple[int, int]:
        """(k, n): this node is k of the n nodes filling the revision now. Each takes the
        pieces ``i % n == k`` from the web seed first and the others from its peers, so a
        rollout costs the upstream about one copy; (0, 1) where seeds exist or alone."""
        if self.you is None or self.seeds:
            return 0, 1
        filling = sorted({*self.peers, self.you})
        return filling.index(self.you), len(filling)

    def files(self) -> dict[str, int]:
        """The revision's files the torrent lists, by name below the model, with sizes."""
        return torrent_files(self.torrent, self.commit, self.etags)

    def names(self) -> dict[int, str]:
        """The torrent's file indexes -> names below the model."""
        return torrent_names(self.torrent, self.commit, self.etags)


@dataclass
class _Seeded:
    admission: Admission
    handle: Any


class PeerEngine:
    """The libtorrent session of one node. ``fill`` takes a revision's wanted files into a
    staging directory; ``seed`` serves a revision held whole; ``stop`` ends a model's seeding
    (eviction, or a new revision about to replace its files)."""

    def __init__(self, settings: PeerSettings, join: Join) -> None:
        why = libtorrent_missing()
        if why is not None:
            raise RuntimeError(f"peer fills need libtorrent: {why}")
        self.settings = settings
        self._join = join
        self._key = NodeKey.create()
        self._dh = dh_params_pem()
        self._lock = threading.Lock()
        self._seeded: dict[str, _Seeded] = {}
        self._removed: dict[str, threading.Event] = {}
        self.counters = PeerCounters()
        self._listening = threading.Event()
        self._listen_error: str | None = None
        self._closing = threading.Event()  # no more announcements
        # The alert pump stops last: closing waits on its torrent_removed alerts.
        self._alerts_stop = threading.Event()
        # The binding takes a settings dict (its stubs name only settings_pack).
        self._session = lt.session(_session_settings(settings))  # type: ignore[call-overload]
        everyone = lt.ip_filter()
        global_class = 1 << lt.session.global_peer_class_id
        everyone.add_rule("0.0.0.0", "255.255.255.255", global_class)
        everyone.add_rule("::", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", global_class)
        self._session.set_peer_class_filter(everyone)
        self._alerts = threading.Thread(target=self._pump_alerts, name="swarm-alerts", daemon=True)
        self._alerts.start()
        if not self._listening.wait(10) or self._listen_error is not None:
            self.close()
            raise OSError(
                f"cannot listen for peers on {settings.host}:{settings.port}: "
                f"{self._listen_error or 'no answer from libtorrent'}"
            )
        self._announcer = threading.Thread(
            target=self._announce, name="swarm-announce", daemon=True
        )
        self._announcer.start()

    @property
    def certificate_request(self) -> bytes:
        """This node's certificate request (PEM), which an upstream signs per revision."""
        return self._key.request_pem

    @property
    def port(self) -> int:
        """The peer port bound (the SSL listener's)."""
        return int(self._session.ssl_listen_port())

    # -- admission ---------------------------------------------------------------------------

    def admit(
        self, model: str, revision: str | None, *, leaving: bool = False, complete: bool = False
    ) -> Admission:
        body = {
            "revision": revision,
            "port": self.port,
            "address": self.settings.advertise,
            "certificate_request": self._key.request_pem.decode(),
            "leaving": leaving,
            "complete": complete,
        }
        answer = self._join(model, body)
        try:
            return Admission(
                model=model,
                commit=answer["commit"],
                revision=answer["revision"],
                torrent=base64.b64decode(answer["torrent"]),
                certificate=answer["certificate"],
                etags=dict(answer["files"]),
                peers=[(p["address"], int(p["port"])) for p in answer["peers"]],
                seeds=frozenset(
                    (p["address"], int(p["port"])) for p in answer["peers"] if p.get("complete")
                ),
                you=(answer["you"]["address"], int(answer["you"]["port"]))
                if answer.get("you")
                else None,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise SwarmUnavailable(f"the upstream's answer to a join is malformed: {e}") from e

    # -- filling -----------------------------------------------------------------------------

    def fill(
        self,
        admission: Admission,
        wanted: dict[str, int],
        staging: Path,
        read: ReadRange,
        on_bytes: Callable[[int], None],
        on_sources: Callable[[int, int], None] | None = None,
    ) -> dict[str, Path]:
        """The ``wanted`` files (name below the model -> size) of the admitted revision, in
        ``staging``: pieces from peers, and from the upstream through ``read`` (its files
        route) those of this node's share and those no peer brings; every piece checked
        against the torrent's Merkle tree as it lands. Files the torrent does not list at that
        size are left out (the caller fetches them). SwarmUnavailable when the fill stalls or
        the upstream fails; what it placed in ``staging`` is the caller's. ``on_sources(from
        peers, from upstream)`` hears the payload bytes by source when the fill ends, however
        it ends."""
        listed = admission.files()
        wanted = {name: size for name, size in wanted.items() if listed.get(name) == size}
        if not wanted:
            return {}
        info = lt.torrent_info(admission.torrent)
        layout = info.layout()
        index = {name: i for i, name in admission.names().items()}
        params = self._params(info)
        params.save_path = str(staging)
        priorities = [0] * layout.num_files()
        for name in wanted:
            priorities[index[name]] = 4
        params.file_priorities = priorities
        spans = _piece_spans(layout, {index[n]: n for n in wanted})
        with self._lock:
            self.counters.fills += 1
        handle = self._session.add_torrent(params)
        handle.set_ssl_certificate_buffer(
            admission.certificate, self._key.key_pem.decode(), self._dh
        )
        for peer in admission.peers:
            handle.connect_peer(peer)
        try:
            with _Feeder(handle, read, spans) as feeder:
                self._follow(handle, admission, feeder, on_bytes, on_sources)
        except BaseException:
            with self._lock:
                self.counters.fills_abandoned += 1
            raise
        finally:
            self._remove(handle)  # its files closed before the caller hashes and moves them
        return {name: staging / layout.file_path(index[name]) for name in wanted}

    def _follow(
        self,
        handle: Any,
        admission: Admission,
        feeder: _Feeder,
        on_bytes: Callable[[int], None],
        on_sources: Callable[[int, int], None] | None,
    ) -> None:
        """Until every wanted piece is had: this node's share fed from the upstream, the rest
        left to peers while they bring bytes, fed from the upstream once they stop."""
        pieces = list(feeder.spans)
        started = time.monotonic()
        known_peers = set(admission.peers)
        try:
            self._until_had(handle, admission, feeder, on_bytes, pieces, known_peers, started)
        finally:
            # Every piece had that the upstream did not give came from a peer (a piece both
            # gave counts once, as the upstream's).
            have = handle.status(lt.torrent_handle.query_pieces).pieces
            had = sum(length for piece, (_, _, length) in feeder.spans.items() if have[piece])
            from_peers = max(0, had - feeder.fed)
            with self._lock:
                self.counters.from_peers += from_peers
                self.counters.from_upstream += feeder.fed
            if on_sources is not None:
                on_sources(from_peers, feeder.fed)
        log.info(
            "filled %s@%s from the swarm in %.2f s: %d bytes from peers, %d from the upstream",
            admission.model, admission.commit[:12], time.monotonic() - started, from_peers,
            feeder.fed,
        )  # fmt: skip

    def _until_had(
        self,
        handle: Any,
        admission: Admission,
        feeder: _Feeder,
        on_bytes: Callable[[int], None],
        pieces: list[int],
        known_peers: set[tuple[str, int]],
        started: float,
    ) -> None:
        """The loop of ``_follow``."""
        reported, last_gain, last_announce = 0, started, started
        announces = iter(_ANNOUNCES_WHILE_FILLING)
        next_announce = next(announces)
        current = admission
        position = {piece: i for i, piece in enumerate(pieces)}
        while True:
            status = handle.status(lt.torrent_handle.query_pieces)
            if status.errc.value():
                raise SwarmUnavailable(f"libtorrent: {status.errc.message()}")
            feeder.check()
            have = status.pieces
            missing = [p for p in pieces if not have[p]]
            done = feeder.total - sum(feeder.spans[p][2] for p in missing)
            now = time.monotonic()
            if done > reported:
                on_bytes(done - reported)
                reported, last_gain = done, now
            if not missing:
                break
            k, n = current.share()
            peered = any(
                p.connection_type == lt.peer_info.standard_bittorrent
                for p in handle.get_peer_info()
            )
            patience = self.settings.patience_seconds
            alone = not current.peers or (not peered and now - started > patience)
            if alone or now - last_gain > patience:
                # Alone, or the peers stopped bringing bytes: the upstream gives what no
                # connected peer has (all of it, alone), then what is still missing.
                availability = handle.piece_availability()
                feeder.want([p for p in missing if not availability[p]] or missing)
            elif not current.seeds:
                feeder.want([p for p in missing if position[p] % n == k])
            if now - last_gain > self.settings.stall_seconds:
                raise SwarmUnavailable(
                    f"no verified byte from peers or the upstream for "
                    f"{self.settings.stall_seconds:g} s"
                )
            if now - last_announce > next_announce:
                last_announce = now
                next_announce = next(announces, ANNOUNCE_SECONDS)
                try:
                    current = self.admit(admission.model, admission.commit)
                except Exception as e:  # noqa: BLE001 - the peers known go on
                    log.info("re-announcing %s to the upstream failed: %s", admission.model, e)
                else:
                    for peer in set(current.peers) - known_peers:
                        handle.connect_peer(peer)
                    known_peers |= set(current.peers)
            time.sleep(POLL_SECONDS)

    # -- seeding -----------------------------------------------------------------------------

    def seed(self, admission: Admission, paths: dict[str, Path]) -> None:
        """Serve the revision to admitted peers from ``paths`` (name below the model -> the
        node's verified file; every file of the torrent), until ``stop``."""
        info = lt.torrent_info(admission.torrent)
        params = self._params(info)
        params.flags |= lt.torrent_flags.seed_mode  # verified against the listing's digests
        renamed = {}
        for i, name in admission.names().items():
            if name not in paths:
                raise ValueError(f"cannot seed {admission.model}@{admission.commit}: no {name}")
            renamed[i] = str(paths[name].resolve())
        params.renamed_files = renamed
        params.save_path = str(next(iter(paths.values())).resolve().parent)
        self.stop(admission.model)
        handle = self._session.add_torrent(params)
        handle.set_ssl_certificate_buffer(
            admission.certificate, self._key.key_pem.decode(), self._dh
        )
        with self._lock:
            self._seeded[admission.model] = _Seeded(admission, handle)
            self.counters.seeding = len(self._seeded)
        log.info("seeding %s at commit %s to peers", admission.model, admission.commit)
        # Named to the nodes that join next as a seed, not as a node still filling.
        self._announce_seed(admission)

    def _announce_seed(self, admission: Admission) -> None:
        try:
            self.admit(admission.model, admission.commit, complete=True)
        except Exception as e:  # noqa: BLE001 - the next round of announcements tries again
            log.info("announcing %s as a seed failed: %s", admission.model, e)

    def stop(self, model: str) -> None:
        """End the model's seeding (before its files are replaced or removed)."""
        with self._lock:
            seeded = self._seeded.pop(model, None)
            self.counters.seeding = len(self._seeded)
        if seeded is not None:
            uploaded = seeded.handle.status().total_payload_upload
            self._remove(seeded.handle)
            with self._lock:
                self.counters.uploaded += uploaded
            threading.Thread(
                target=self._leave, args=(seeded.admission,), name="swarm-leave", daemon=True
            ).start()

    def seeding(self) -> dict[str, str]:
        """Model -> the commit this node seeds."""
        with self._lock:
            return {model: s.admission.commit for model, s in self._seeded.items()}

    def _leave(self, admission: Admission) -> None:
        try:
            self.admit(admission.model, admission.commit, leaving=True)
        except Exception as e:  # noqa: BLE001 - the upstream forgets it in a while anyway
            log.debug("telling the upstream %s stopped seeding failed: %s", admission.model, e)

    def _announce(self) -> None:
        """Re-announce every seeded revision: the upstream keeps naming this node, and its
        certificate is renewed long before it expires."""
        while not self._closing.wait(ANNOUNCE_SECONDS):
            with self._lock:
                seeded = list(self._seeded.values())
            for s in seeded:
                try:
                    fresh = self.admit(s.admission.model, s.admission.commit, complete=True)
                except Exception as e:  # noqa: BLE001 - tried again at the next round
                    log.info("re-announcing %s failed: %s", s.admission.model, e)
                    continue
                if fresh.commit == s.admission.commit:
                    s.handle.set_ssl_certificate_buffer(
                        fresh.certificate, self._key.key_pem.decode(), self._dh
                    )

    # -- the session -------------------------------------------------------------------------

    @staticmethod
    def _params(info: Any) -> Any:
        params = lt.add_torrent_params()
        params.ti = info
        params.flags &= ~lt.torrent_flags.auto_managed
        params.flags &= ~lt.torrent_flags.paused
        return params

    def _remove(self, handle: Any) -> None:
        """Remove the torrent and wait until libtorrent closed its files."""
        key = str(handle.info_hashes().get_best())
        done = threading.Event()
        with self._lock:
            self._removed[key] = done
        self._session.remove_torrent(handle)
        if not done.wait(30):
            log.warning("libtorrent took over 30 s to remove torrent %s", key)
        with self._lock:
            self._removed.pop(key, None)

    def _pump_alerts(self) -> None:
        while not self._alerts_stop.is_set():
            if self._session.wait_for_alert(200) is None:
                continue
            for alert in self._session.pop_alerts():
                self._on_alert(alert)

    def _on_alert(self, alert: Any) -> None:
        if isinstance(alert, lt.listen_succeeded_alert):
            if alert.socket_type == lt.socket_type_t.tcp_ssl:
                self._listening.set()
        elif isinstance(alert, lt.listen_failed_alert):
            self._listen_error = alert.message()
            self._listening.set()
        elif isinstance(alert, lt.torrent_removed_alert):
            with self._lock:
                done = self._removed.get(str(alert.info_hashes.get_best()))
            if done is not None:
                done.set()
        elif isinstance(alert, lt.hash_failed_alert):
            with self._lock:
                self.counters.hash_failures += 1
            log.warning("swarm: %s", alert.message())
        elif isinstance(alert, lt.peer_ban_alert):
            with self._lock:
                self.counters.peers_banned += 1
            log.warning("swarm: %s", alert.message())
        elif isinstance(alert, lt.peer_error_alert | lt.torrent_error_alert):
            log.info("swarm: %s", alert.message())

    def snapshot(self) -> PeerCounters:
        """The counters, with the bytes uploaded so far by the revisions seeded now."""
        with self._lock:
            counters = dataclasses.replace(self.counters)
            handles = [s.handle for s in self._seeded.values()]
        counters.uploaded += sum(h.status().total_payload_upload for h in handles)
        return counters

    def close(self) -> None:
        """Stop announcing, remove every seeded torrent (each waits for libtorrent's alert
        that its files are closed, so the pump runs until they are), then pause."""
        self._closing.set()
        with self._lock:
            models = list(self._seeded)
        for model in models:
            self.stop(model)
        self._alerts_stop.set()
        self._alerts.join(5)
        self._session.pause()


def _session_settings(settings: PeerSettings) -> dict[str, Any]:
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    category = lt.alert.category_t
    return {
        # "s": TLS only, the one way into an SSL torrent.
        "listen_interfaces": f"{host}:{settings.port}s",
        "enable_dht": False,
        "enable_lsd": False,
        "enable_upnp": False,
        "enable_natpmp": False,
        "enable_incoming_utp": False,
        "enable_outgoing_utp": False,
        # Nodes of a test, or pods behind one address, share an IP.
        "allow_multiple_connections_per_ip": True,
        "upload_rate_limit": settings.upload_limit,
        "user_agent": "weightserve",
        "alert_mask": (
            category.error_notification
            | category.status_notification
            | category.peer_notification
            | category.storage_notification
        ),  # fmt: skip
    }
