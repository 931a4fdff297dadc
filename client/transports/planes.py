"""Which transport a URL names (``make_transport``), and which data plane carries a client's
bulk tensor bytes.

Metadata (model list, model info, files) always goes to the URL the client was given. Bulk
data goes over the fastest plane the server advertises that this client can reach:

1. ``handoff``: the server's same-node socket passes file descriptors; nothing is copied
   (client/transports/handoff.py). Found at the socket a ``unix://`` URL names, at ``WEIGHTSERVE_UDS``
   (where this pod mounts the node's socket), or at the path the server advertises; used
   only when that socket answers with the same server instance.
2. ``http``: the HTTP stream (for a ``grpc://`` URL, at the HTTP port the server advertises,
   with the same host and TLS settings), the transport closest to the TCP limit.
3. ``flight``, then ``grpc``: Arrow Flight, then gRPC StreamTensors.

``data_plane=`` (or ``WEIGHTSERVE_DATA_PLANE``) forces one; ``auto`` (the default) falls back
down the list by itself when a plane is missing or stops answering; ``network`` is ``auto``
without the handoff (what a client off the server's node gets; for measuring the network).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from dataclasses import dataclass

from weightserve.client.errors import TransportError, WeightserveError
from weightserve.client.transports.base import Connection, Transport
from weightserve.client.transports.grpc import GrpcTransport
from weightserve.client.transports.handoff import HandoffClient, handoff_socket_path
from weightserve.client.transports.http import HttpTransport
from weightserve.client.wire.routes import ServerAddress

log = logging.getLogger("weightserve.client")

DATA_PLANES = ("auto", "network", "handoff", "http", "flight", "grpc")


def make_transport(address: ServerAddress, connection: Connection | None = None) -> Transport:
    """The transport the URL's scheme names, for metadata (and for bulk data unless a faster
    plane is found)."""
    if address.transport == "http":
        return HttpTransport(address, connection)
    return GrpcTransport(address, connection)


def data_plane_from(value: str | None) -> str:
    """The data plane asked for: the argument, else ``WEIGHTSERVE_DATA_PLANE``, else auto."""
    plane = value if value is not None else os.environ.get("WEIGHTSERVE_DATA_PLANE") or "auto"
    plane = plane.strip().lower()
    if plane not in DATA_PLANES:
        raise ValueError(f"data_plane must be one of {', '.join(DATA_PLANES)}, got {plane!r}")
    return plane


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


@dataclass
class Planes:
    """The planes chosen: ``handoff`` (None: not on this node, or not wanted) and the
    transport that carries streams."""

    handoff: HandoffClient | None
    streams: Transport
    description: str


class PlaneChooser:
    """Chooses once (beside the first model's index read, else at the first bulk fetch), then
    keeps the choice; ``handoff_failed`` drops the handoff for the rest of the client's
    life."""

    def __init__(self, transport: Transport, plane: str, connection: Connection) -> None:
        self.transport = transport
        self.plane = plane
        self.connection = connection
        self._lock = threading.Lock()
        self._planes: Planes | None = None
        self._extra: list[Transport] = []  # transports opened here, closed with the client
        self._early: threading.Thread | None = None
        self._early_error: BaseException | None = None

    def choose_early(self) -> None:
        """Start choosing in the background, so that the server's answer (and, for a
        ``grpc://`` URL, the check of its HTTP port) comes while the caller reads the model's
        index instead of after it: a load's first stream then starts one or two round trips
        sooner. ``planes()`` waits for it; an error it met is raised there."""
        with self._lock:
            if self._planes is not None or self._early is not None:
                return
            self._early = threading.Thread(
                target=self._choose_early, name="weightserve-planes", daemon=True
            )
            self._early.start()

    def _choose_early(self) -> None:
        try:
            self._settle()
        except BaseException as e:  # noqa: BLE001 - raised to the first planes() call
            self._early_error = e

    def planes(self) -> Planes:
        early = self._early
        if early is not None:
            early.join()
            self._early = None
            error, self._early_error = self._early_error, None
            if error is not None:
                raise error
        return self._settle()

    def _settle(self) -> Planes:
        """The planes chosen, choosing them if none are yet."""
        with self._lock:
            if self._planes is None:
                planes, settled = self._choose()
                log.debug("weightserve data plane: %s", planes.description)
                if not settled:  # the server did not say: copy over the URL, ask again later
                    return planes
                self._planes = planes
            return self._planes

    def handoff_failed(self, error: WeightserveError) -> None:
        with self._lock:
            if self._planes is not None and self._planes.handoff is not None:
                if self.plane == "handoff":
                    return  # forced: the caller sees the error
                log.info(
                    "same-node handoff at %s unavailable (%s); copying over %s instead",
                    self._planes.handoff.path,
                    error,
                    self._planes.description,
                )
                self._planes.handoff = None

    def close(self) -> None:
        early = self._early
        if early is not None:  # it may still open a transport to close here
            early.join(self.connection.timeout)
        for t in self._extra:
            t.close()

    def _info(self) -> dict | None:
        """What the server advertises ({} from a server that predates it); None when it could
        not be asked now (unreachable for a moment): the fetch itself then retries."""
        try:
            return self.transport.server_info()
        except WeightserveError as e:
            log.debug("server info from %s: %s", self.transport.address.url, e)
            return None

    def _choose(self) -> tuple[Planes, bool]:
        """The planes, and whether the choice is settled (the server answered)."""
        plane = self.plane
        address = self.transport.address
        if plane in ("flight", "grpc"):
            if not isinstance(self.transport, GrpcTransport):
                raise ValueError(
                    f"data_plane={plane!r} needs a grpc:// URL (the Flight port is found "
                    f"through gRPC), not {address.url}"
                )
            self.transport.use_flight = plane == "flight"
            return Planes(None, self.transport, plane), True
        answered = self._info()
        info = answered if answered is not None else {}
        handoff = None
        if plane in ("auto", "handoff"):
            handoff = self._find_handoff(address, info)
            if handoff is None and plane == "handoff":
                raise TransportError(
                    f"data_plane='handoff': no same-node socket of the server at {address.url} "
                    "was found (give a unix:// URL, or set WEIGHTSERVE_UDS to the path where "
                    "the node's socket is mounted)"
                )
        streams: Transport = self.transport
        description = "http" if isinstance(streams, HttpTransport) else "flight/grpc"
        if isinstance(self.transport, GrpcTransport) and plane in ("auto", "network", "http"):
            http = self._advertised_http(address, info)
            if http is not None:
                streams, description = http, "http"
            elif plane == "http":
                raise TransportError(
                    f"data_plane='http': the server at {address.url} advertises no HTTP port "
                    "this client can reach"
                )
        if handoff is not None:
            description = f"handoff ({handoff.path}), else {description}"
        return Planes(handoff, streams, description), answered is not None

    def _find_handoff(self, address: ServerAddress, info: dict) -> HandoffClient | None:
        candidates = []
        if address.socket_path is not None:
            candidates.append(handoff_socket_path(address.socket_path))
        if os.environ.get("WEIGHTSERVE_UDS"):
            candidates.append(handoff_socket_path(os.environ["WEIGHTSERVE_UDS"]))
        if info.get("uds"):
            candidates.append(handoff_socket_path(info["uds"]))
        instance = info.get("instance")
        for path in dict.fromkeys(candidates):
            if not _is_socket(path):
                continue
            client = HandoffClient(
                path, token=self.connection.bearer, timeout=self.connection.timeout
            )
            try:
                answer = client.hello()
            except WeightserveError as e:
                log.debug("handoff socket %s: %s", path, e)
                continue
            # Another server's socket (a second weightserve on the node, a stale mount)
            # would hand out other files: only this server's counts.
            if instance and answer.get("instance") == instance:
                return client
            log.debug("handoff socket %s belongs to another server", path)
        return None

    def _advertised_http(self, address: ServerAddress, info: dict) -> HttpTransport | None:
        port = info.get("http_port")
        if not port:
            return None
        http = HttpTransport(
            ServerAddress("http", address.tls, address.host, int(port)), self.connection
        )
        try:
            same = http.server_info().get("instance") == info.get("instance")
        except WeightserveError as e:
            # Not reachable from here (a port not published, a proxy in between): stay on
            # gRPC, which this client does reach.
            log.debug("advertised HTTP port %s unreachable: %s", port, e)
            same = False
        if not same:
            http.close()
            return None
        self._extra.append(http)
        return http
