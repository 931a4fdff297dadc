"""``Client``: one weightserve server; ``RemoteModel``: one model on it, fetched in bulk.

Fetching a set of tensors is one stream (or a few in parallel, split by bytes), never one
round trip per tensor. Arrays handed out are views of the buffers the data was received in.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterator, Mapping, MutableMapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np

from weightserve.client._device import DEFAULT_STAGING_BYTES, load_to_device
from weightserve.client._fetch import FetchOptions, Receiving, TensorFetcher
from weightserve.client._files import ModelFiles
from weightserve.client._models import (
    ModelInfo,
    ModelProblem,
    ModelSummary,
    RemoteFile,
    TensorInfo,
)
from weightserve.client._publish import (
    Publication,
    Revision,
    UploadSource,
    publish,
    revisions,
)
from weightserve.client._retry import OnWait, call_with_retry, retry_seconds_from
from weightserve.client._revisions import ModelRevisions
from weightserve.client._update import TensorUpdate
from weightserve.client.receive.window import DEFAULT_WINDOW_BYTES
from weightserve.client.transports.base import (
    DEFAULT_READ_TIMEOUT,
    Connection,
    TLSOptions,
    Transport,
)
from weightserve.client.transports.planes import (
    PlaneChooser,
    Planes,
    data_plane_from,
    make_transport,
)
from weightserve.client.wire.routes import ServerAddress, parse_url, split_revision, with_revision
from weightserve.client.wire.schema import ChunkHeader

if TYPE_CHECKING:
    from typing_extensions import Unpack

_SUMMARY_FIELDS = frozenset(f.name for f in fields(ModelSummary))


class PublishArgs(TypedDict, total=False):
    """``Client.publish``'s keyword arguments, which ``RemoteModel.publish`` hands on."""

    base: str | None
    base_tensors: Mapping[str, Any] | None
    files: Mapping[str, UploadSource] | None
    metadata: Mapping[str, Any] | None
    message: str


class Client(AbstractContextManager["Client"]):
    """A connection to one weightserve server (``http(s)://host:port``, ``grpc(s)://...`` or
    ``unix:///path/to/socket``).

    A busy server (stream limit reached), one that refuses connections (restarting) and a
    broken stream are tried again with jittered backoff for up to ``retry_seconds`` (default:
    ``WEIGHTSERVE_RETRY_SECONDS``, else 60 s; 0: never); ``on_wait(reason, seconds)`` hears of
    each wait.

    Bulk tensor bytes take the fastest data plane the server advertises (``data_plane``,
    default ``WEIGHTSERVE_DATA_PLANE``, else ``auto``; see client/transports/planes.py): the same-node
    zero-copy handoff when this process runs on the server's node (arrays are then read-only
    views of the node's page cache), else the HTTP stream (for ``grpc://`` URLs too, when the
    server's HTTP port answers), else Arrow Flight, else gRPC StreamTensors. ``"handoff"``,
    ``"http"``, ``"flight"`` or ``"grpc"`` forces one.

    ``transport`` replaces the one the URL names (its address then is the client's): an
    in-process ``MemoryTransport`` (client/transports/memory.py) in tests, for instance.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        tls: TLSOptions | None = None,
        timeout: float = DEFAULT_READ_TIMEOUT,
        flight: bool | None = None,
        retry_seconds: float | None = None,
        on_wait: OnWait | None = None,
        data_plane: str | None = None,
        transport: Transport | None = None,
    ) -> None:
        address, _ = parse_url(url)
        self.connection = Connection(token, tls, timeout, flight, retry_seconds)
        self.retry_seconds = retry_seconds_from(retry_seconds)
        self.on_wait = on_wait
        self.transport: Transport = transport or make_transport(address, self.connection)
        self.address: ServerAddress = self.transport.address
        if data_plane is None and flight is not None and address.transport == "grpc":
            data_plane = "flight" if flight else "grpc"  # the older switch says which one
        self.data_plane = data_plane_from(data_plane)
        self._planes = PlaneChooser(self.transport, self.data_plane, self.connection)

    def planes(self) -> Planes:
        """The data planes bulk fetches use (chosen once, from the first model opened; see
        client/transports/planes.py)."""
        return self._planes.planes()

    def choose_planes_early(self) -> None:
        """Start choosing the data planes in the background (``PlaneChooser.choose_early``):
        a model about to be loaded calls it before reading its index."""
        self._planes.choose_early()

    def _with_retry(self, call: Callable[[], Any], what: str) -> Any:
        return call_with_retry(call, self.retry_seconds, what, self.on_wait)

    def model_info(self, model_id: str, *, revision: str | None = None) -> ModelInfo:
        """One model's format, revision and commit, metadata and tensor index; ``revision``
        (or ``ID@R``) asks for that revision of it (see ``model``)."""
        model_id = with_revision(model_id, revision)
        info = self._with_retry(
            lambda: self.transport.model_info(model_id), f"{self.address.url} model {model_id!r}"
        )
        return ModelInfo.from_json(info)

    def list_models(self) -> tuple[list[ModelSummary], list[ModelProblem]]:
        listing = self._with_retry(self.transport.list_models, f"{self.address.url} models")
        return (
            # Fields a newer server adds are left out: this client does not know them.
            [
                ModelSummary(**{k: v for k, v in m.items() if k in _SUMMARY_FIELDS})
                for m in listing["models"]
            ],
            [ModelProblem(**p) for p in listing["problems"]],
        )

    def model(
        self, model_id: str, options: FetchOptions | None = None, *, revision: str | None = None
    ) -> RemoteModel:
        """The model ``model_id`` on this server. ``revision`` (or ``ID@R`` in the id) pins
        one: a commit (40 hex digits, or a prefix of at least 12), the revision, or a ref
        (``main``: the newest). Every load of it then gets exactly that revision's bytes, on
        every transport, or ``RevisionNotFound`` naming the revisions the server holds;
        ``RemoteModel.commit`` says what was resolved (pin it on every tensor-parallel rank).
        """
        return RemoteModel(self, model_id, options, revision=revision)

    def publish(
        self,
        model_id: str,
        tensors: Mapping[str, Any] | None = None,
        *,
        base: str | None = None,
        base_tensors: Mapping[str, Any] | None = None,
        files: Mapping[str, UploadSource] | None = None,
        metadata: Mapping[str, Any] | None = None,
        message: str = "",
    ) -> Revision:
        """Publish a new revision of ``model_id`` (created if new) and make it ``main``:
        ``tensors`` maps names to arrays (NumPy, torch, DLPack, buffers; stored as
        safetensors), ``files`` adds files (name -> bytes or a path: config, tokenizer, or
        checkpoint files as they are). With ``base`` (a revision of the model), what is not
        given is the base's: tensors not given, files not given. ``base_tensors`` (with
        ``base``: the arrays published as that revision, as a trainer keeps them) sends each
        tensor as nothing, an element patch against its base array, or whole, whichever is
        smallest; the server checks every result against its digest and refuses the publish
        (``RevisionMismatch``) where ``base_tensors`` were not ``base``. The server checks the
        upload with its strict readers; a refused or interrupted publish leaves ``main`` as
        it was. ``MainMoved`` when another publish moved ``main`` after this one began
        (nothing committed: publish again on the new ``main``); the same bytes as ``main``
        publish nothing (``Revision.unchanged``, ``main``'s record kept). Over HTTP; needs a
        token granted ``publish=`` (or ``--allow-publish``)."""
        model_id = split_revision(model_id)[0]
        publication = Publication(model_id, tensors, base, base_tensors, files, metadata, message)
        return publish(self.transport, publication)

    def revisions(self, model_id: str) -> list[Revision]:
        """The model's revisions the server holds, ``main`` first, then newest first."""
        return self._with_retry(
            lambda: revisions(self.transport, split_revision(model_id)[0]),
            f"{self.address.url} revisions of {model_id!r}",
        )

    def close(self) -> None:
        self._planes.close()
        self.transport.close()

    def __exit__(self, *exc: object) -> None:  # ``with Client(url) as client:`` closes it
        self.close()


class RemoteModel:
    """One model on a server: its index (fetched once) and bulk tensor fetches.

    ``id`` is the id every request names (``ID@R`` when pinned to a revision); ``revision``
    and ``commit`` are the revision the server resolved it to when the index was read, which
    every stream of this model then pins."""

    def __init__(
        self,
        client: Client,
        model_id: str,
        options: FetchOptions | None = None,
        *,
        revision: str | None = None,
    ) -> None:
        self.client = client
        self.id = with_revision(model_id, revision)
        self.options = options or FetchOptions()
        client.choose_planes_early()
        self.info = client.model_info(self.id)
        self.last_update: dict[str, int] = {}  # what the last ``update`` did (by outcome)
        self.last_removed: list[str] = []  # the tensors it removed from the state
        # tensors the last ``to_device`` staged in its ring / gave memory of their own
        self.last_device_load: dict[str, int] = {}
        self._fetcher = TensorFetcher(self)
        self._revisions = ModelRevisions(client, self.id)
        self._files = ModelFiles(self)

    @property
    def revision(self) -> str:
        """The content revision (16 hex digits) this model's loads get."""
        return self.info.revision

    @property
    def commit(self) -> str:
        """The revision as a 40-hex commit: ``ID@COMMIT`` loads exactly these bytes from any
        server that holds them ("" from a server too old to say)."""
        return self.info.commit

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        return self.info.tensors

    def publish(
        self, tensors: Mapping[str, Any] | None = None, **how: Unpack[PublishArgs]
    ) -> Revision:
        """A new revision of this model: ``Client.publish`` with this model's id, the same
        keyword arguments (``base``, ``base_tensors``: send ``tensors`` as a patch against the
        arrays published as ``base``, ``files``, ``metadata``, ``message``); ``model(...)`` of
        a model that does not exist yet fails, so a first revision goes through
        ``Client.publish``."""
        return self.client.publish(self.id, tensors, **how)

    def revisions(self) -> list[Revision]:
        """This model's revisions on the server, ``main`` first, then newest first."""
        return self._revisions.revisions()

    def watch(self, since: str | None = None, timeout: float | None = None) -> Iterator[Revision]:
        """Each revision that becomes ``main`` from now on, in order, as the server
        announces it (``since=COMMIT``: every one after that first); reconnects through
        dropped connections and server restarts without missing or repeating one. Ends
        after ``timeout`` seconds (None: never). A worker's loop::

            for rev in model.watch():
                weights = RemoteWeights(url, revision=rev.commit)  # or fetch / iter_tensors
        """
        return self._revisions.watch(since, timeout)

    def iter_updates(self, *, since: str, revision: str | None = None) -> Iterator[TensorUpdate]:
        """What a worker holding revision ``since`` needs to hold ``revision`` (default
        ``main``), tensor by tensor, for engines with their own ``load_weights``: ``same``,
        ``patch`` (positions and new values) or ``whole`` (every byte); see ``update``."""
        return self._revisions.iter_updates(since, revision)

    def update(
        self, state: MutableMapping[str, Any], *, since: str, revision: str | None = None
    ) -> Revision:
        """Bring ``state`` (names to arrays holding revision ``since``: NumPy arrays, or torch
        tensors such as a module's ``state_dict()``, on any device) to ``revision`` (default
        ``main``) in place: per tensor the server sends nothing, an element patch or the
        whole tensor, whichever costs least (computed once for every worker; docs/protocol.md,
        "Delta updates"). Every tensor is then checked against the revision's digest; one that
        does not match (a wrong base) is fetched whole, never left wrong. A torch tensor off
        the CPU or not contiguous is patched in a host copy and copied back into it; a
        read-only NumPy array (a same-node load's pages) is replaced by its patched copy. A
        tensor whose dtype or shape changed, or that is new, gets a new array in ``state`` (a
        torch tensor on the same device where ``state`` held one: a state dict stays one).
        All or nothing: the whole stream is read and checked before any tensor of ``state``
        changes (a stream cut midway leaves ``state`` as it was), and a cut or refused stream
        is asked for again within ``retry_seconds``. Tensors the revision no longer has are
        removed from ``state`` and named in ``last_removed``. ``last_update`` counts what was
        done (``removed`` included) and what travelled."""
        found, self.last_update, self.last_removed = self._revisions.update(state, since, revision)
        return found

    def hold(self, commit: str, seconds: float) -> float | None:
        """Keep revision ``commit`` from the server's retention for ``seconds`` (renew it
        while you compute with it; 0 releases it): the time it is held until."""
        return self._revisions.hold(commit, seconds)

    def _retry_seconds(self) -> float:
        """How long this model's loads wait for a busy or unreachable server."""
        return self._fetcher._retry_seconds()

    def names(self, prefix: str = "") -> list[str]:
        return self._fetcher.names(prefix)

    def fetch(
        self,
        names: Sequence[str] | None = None,
        *,
        prefix: str | None = None,
        shard: tuple[int, int] | None = None,
        axis: int = 0,
        on_bytes: Callable[[int], None] | None = None,
        allocate: Callable[[ChunkHeader], np.ndarray] | None = None,
        on_wait: OnWait | None = None,
    ) -> dict[str, np.ndarray]:
        """Arrays (served dtype and shape; uint8 blocks for GGML types) by name.

        Give ``names`` or ``prefix`` (``prefix=""`` is the whole model). With ``shard=(k, n)``
        each array is part k of n along ``axis`` (tensors with fewer dims come whole).
        ``on_wait(reason, seconds)`` hears of each wait for a busy or unreachable server
        (default: the client's ``on_wait``).
        """
        how = Receiving(shard, axis, on_bytes, allocate, on_wait)
        return self._fetcher.fetch(names, prefix, how)

    def iter_tensors(
        self,
        names: Sequence[str] | None = None,
        *,
        prefix: str | None = None,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        shard: tuple[int, int] | None = None,
        axis: int = 0,
        on_bytes: Callable[[int], None] | None = None,
        allocate: Callable[[ChunkHeader], np.ndarray] | None = None,
        on_wait: OnWait | None = None,
    ) -> Generator[tuple[str, np.ndarray], None, None]:
        """``(name, array)`` of each tensor as it arrives, in stream order, with memory
        bounded by ``window_bytes`` (default 64 MiB): for loading layer by layer into an
        engine (``model.load_weights(remote.iter_tensors())``) without the whole model in
        memory first.

        The stream runs ahead of the consumer by at most ``window_bytes`` of tensors; a
        tensor larger than that is still delivered whole, alone. An array is the iterator's
        until the consumer asks for the next one; then the iterator lets it go (copy it, or
        keep a reference, to keep it; kept arrays are outside the window). ``allocate``
        gives the buffer for each tensor, as in ``fetch``: e.g. pinned host memory to copy
        to a GPU from. Names, ``prefix``, ``shard`` and ``axis`` are as in ``fetch``;
        stopping early (``break``) closes the stream.
        """
        how = Receiving(shard, axis, on_bytes, allocate, on_wait)
        return self._fetcher.iter_tensors(names, prefix, window_bytes, how)

    def to_device(
        self,
        device: Any = "cuda",
        names: Sequence[str] | None = None,
        *,
        prefix: str | None = None,
        into: Mapping[str, Any] | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        on_bytes: Callable[[int], None] | None = None,
    ) -> dict[str, Any]:
        """``{name: torch.Tensor}`` on ``device`` (as torch names it), received through one
        ring of page-locked host memory of ``staging_bytes``, each tensor copied to the
        device while the next arrives; host memory stays at the ring's size whatever the
        model's. ``into`` (e.g. a module's ``state_dict()``) is written in place, dtype and
        shape checked; the other tensors are new. dtypes are kept (bfloat16, float8); types
        torch lacks come as their raw bytes (uint8). Names and ``prefix`` as in ``fetch``
        (all tensors by default). Every tensor is on the device when this returns.
        """
        wanted = self._fetcher.wanted(names, prefix)
        if staging_bytes < 1:
            raise ValueError(f"staging_bytes must be at least 1, got {staging_bytes}")

        # A same-node handoff's tensors are views of the page cache already: copied from
        # there, not first into buffers of the ring's (that copy would hold them all at once).
        receive_into_ring = self.client.planes().handoff is None

        def received(allocate, window_bytes):
            return self.iter_tensors(
                wanted,
                window_bytes=window_bytes,
                allocate=allocate if receive_into_ring else None,
                on_bytes=on_bytes,
            )

        loaded, ring = load_to_device(received, wanted, self.tensors, device, into, staging_bytes)
        self.last_device_load = {"staged": ring.staged, "unstaged": ring.unstaged}
        return loaded

    def files(self) -> list[RemoteFile]:
        """Every file of the model's repository (weights, index, config, tokenizer...):
        name relative to the model directory, size and content digest (xxh3-128 hex)."""
        return self._files.list()

    def download(
        self,
        dest: str | os.PathLike[str],
        *,
        force: bool = False,
        since: str | None = None,
        on_bytes: Callable[[int], None] | None = None,
        on_wait: OnWait | None = None,
    ) -> Path:
        """Write the model's original files under ``dest`` (created if missing), each
        byte-identical to the server's, verified against its digest and renamed into place
        only when whole; returns ``dest``.

        An interrupted download goes on where it stopped on the next call (``NAME.partial``
        keeps what arrived); an identical file already in place is kept; a different one is
        refused with ``DestinationError`` unless ``force``. ``on_bytes(n)`` hears of the bytes
        transferred.

        ``since=R``: ``dest`` holds revision R's files (as a download wrote them) and is
        updated in place: unchanged files are kept, a changed safetensors file with the same
        tensor layout is patched from the delta stream (see ``update``), other changed files
        are fetched whole, R's files this revision lacks are removed; each file is verified
        and renamed into place alone. ``last_update`` then counts files by outcome and the
        bytes that travelled (``wire_bytes``).
        """
        path, counts = self._files.download(
            Path(dest), force=force, since=since, on_bytes=on_bytes, on_wait=on_wait
        )
        if counts is not None:
            self.last_update = counts
        return path
