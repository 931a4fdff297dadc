"""``Client``: one weightserve server; ``RemoteModel``: one model on it, fetched in bulk.

Fetching a set of tensors is one stream (or a few in parallel, split by bytes), never one
round trip per tensor. Arrays handed out are views of the buffers the data was received in.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Generator, Iterator, Mapping, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from weightserve.client._device import DEFAULT_STAGING_BYTES, load_to_device
from weightserve.client._download import download_files
from weightserve.client._models import (
    ModelInfo,
    ModelProblem,
    ModelSummary,
    RemoteFile,
    TensorInfo,
)
from weightserve.client._publish import (
    Revision,
    UploadSource,
    hold,
    publish,
    revisions,
    watch,
)
from weightserve.client._pull_since import pull_since
from weightserve.client._retry import OnWait, call_with_retry, retry_seconds_from
from weightserve.client._update import TensorUpdate, apply_updates, iter_updates
from weightserve.client.errors import InvalidRequest, TensorNotFound, TransportError
from weightserve.client.receive.stream import (
    ReceivedTensor,
    arena_allocator,
    receive,
    verify_policy,
)
from weightserve.client.receive.window import DEFAULT_WINDOW_BYTES, iter_received
from weightserve.client.transports.base import (
    DEFAULT_READ_TIMEOUT,
    StreamParams,
    TLSOptions,
    Transport,
    bearer_token,
)
from weightserve.client.transports.handoff import Handoff, HandoffClient
from weightserve.client.transports.planes import (
    PlaneChooser,
    Planes,
    data_plane_from,
    make_transport,
)
from weightserve.client.wire.dtypes import numpy_dtype, wire_dtype
from weightserve.client.wire.hints import did_you_mean
from weightserve.client.wire.routes import ServerAddress, parse_url, split_revision, with_revision
from weightserve.client.wire.schema import ChunkHeader

_SUMMARY_FIELDS = frozenset(f.name for f in fields(ModelSummary))

# Loads below this many bytes use one stream: a second one costs a small load a connection, a
# thread and an arena, and on the 2-core bench machine it barely helped large ones
# (docs/performance.md). Above this, two streams keep a client with more cores from being one
# thread's pace.
PARALLEL_MIN_BYTES = 256 << 20


@dataclass(frozen=True)
class FetchOptions:
    parallel: int = 2  # concurrent streams for a bulk fetch (split by bytes)
    # At most this many retries of one stream; None: as many as retry_seconds allows.
    retries: int | None = None
    chunk_bytes: int | None = None
    # How long a busy or unreachable server is waited for; None: the client's retry_seconds.
    retry_seconds: float | None = None
    # Chunk digests checked: "full" (every chunk), "sample" (each tensor's first and one in
    # eight of the others) or "none"; default WEIGHTSERVE_VERIFY, else "full" (_receive.py).
    verify: str = field(default_factory=verify_policy)

    def __post_init__(self) -> None:
        verify_policy(self.verify)  # a wrong value fails here, naming the choices


def as_array(t: ReceivedTensor | np.ndarray, info: TensorInfo) -> np.ndarray:
    """The received bytes viewed as the tensor's served dtype and shape (no copy)."""
    buffer = t.buffer if isinstance(t, ReceivedTensor) else t
    spec = wire_dtype(info.dtype)
    if spec.numpy_name is None:  # packed sub-byte types stay raw bytes
        return buffer
    return buffer.view(numpy_dtype(info.dtype)).reshape(info.shape)


class Client:
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
    ) -> None:
        address, _ = parse_url(url)
        self.address: ServerAddress = address
        self.retry_seconds = retry_seconds_from(retry_seconds)
        self.on_wait = on_wait
        self.transport: Transport = make_transport(
            address, token=token, tls=tls, timeout=timeout, flight=flight
        )
        token = bearer_token(token)
        if data_plane is None and flight is not None and address.transport == "grpc":
            data_plane = "flight" if flight else "grpc"  # the older switch says which one
        self.data_plane = data_plane_from(data_plane)
        self._planes = PlaneChooser(self.transport, self.data_plane, token, tls, timeout)

    def planes(self) -> Planes:
        """The data planes bulk fetches use (chosen at the first; see client/transports/planes.py)."""
        return self._planes.planes()

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
        it was. Over HTTP; needs a token granted ``publish=`` (or ``--allow-publish``)."""
        return publish(
            self.transport,
            split_revision(model_id)[0],
            tensors,
            base=base,
            base_tensors=base_tensors,
            files=files,
            metadata=metadata,
            message=message,
        )

    def revisions(self, model_id: str) -> list[Revision]:
        """The model's revisions the server holds, ``main`` first, then newest first."""
        return self._with_retry(
            lambda: revisions(self.transport, split_revision(model_id)[0]),
            f"{self.address.url} revisions of {model_id!r}",
        )

    def close(self) -> None:
        self._planes.close()
        self.transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
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
        self.info = client.model_info(self.id)
        self._lock = threading.Lock()
        self.last_update: dict[str, int] = {}  # what the last ``update`` did (by outcome)
        # tensors the last ``to_device`` staged in its ring / gave memory of their own
        self.last_device_load: dict[str, int] = {}

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
        self,
        tensors: Mapping[str, Any] | None = None,
        *,
        base: str | None = None,
        base_tensors: Mapping[str, Any] | None = None,
        files: Mapping[str, UploadSource] | None = None,
        metadata: Mapping[str, Any] | None = None,
        message: str = "",
    ) -> Revision:
        """A new revision of this model (see ``Client.publish``; ``base_tensors``: send
        ``tensors`` as a patch against the arrays published as ``base``); ``model(...)`` of a
        model that does not exist yet fails, so a first revision goes through
        ``Client.publish``."""
        return self.client.publish(
            self.id,
            tensors,
            base=base,
            base_tensors=base_tensors,
            files=files,
            metadata=metadata,
            message=message,
        )

    def revisions(self) -> list[Revision]:
        """This model's revisions on the server, ``main`` first, then newest first."""
        return self.client.revisions(self.id)

    def watch(self, since: str | None = None, timeout: float | None = None) -> Iterator[Revision]:
        """Each revision that becomes ``main`` from now on, in order, as the server
        announces it (``since=COMMIT``: every one after that first); reconnects through
        dropped connections and server restarts without missing or repeating one. Ends
        after ``timeout`` seconds (None: never). A worker's loop::

            for rev in model.watch():
                weights = RemoteWeights(url, revision=rev.commit)  # or fetch / iter_tensors
        """
        return watch(self.client.transport, split_revision(self.id)[0], since, timeout)

    def iter_updates(self, *, since: str, revision: str | None = None) -> Iterator[TensorUpdate]:
        """What a worker holding revision ``since`` needs to hold ``revision`` (default
        ``main``), tensor by tensor, for engines with their own ``load_weights``: ``same``,
        ``patch`` (positions and new values) or ``whole`` (every byte); see ``update``."""
        return iter_updates(self.client.transport, split_revision(self.id)[0], since, revision)[1]

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
        tensor whose dtype or shape changed, or that is new, gets a new array in ``state``.
        ``last_update`` counts what was done and what travelled."""
        plain = split_revision(self.id)[0]
        target, updates = iter_updates(self.client.transport, plain, since, revision)

        def fetch_whole(names: list[str]) -> dict[str, np.ndarray]:
            fetched = self.client.model(plain, revision=target.commit).fetch(names)
            return {name: np.asarray(array) for name, array in fetched.items()}

        self.last_update = apply_updates(state, updates, fetch_whole)
        found = [r for r in self.client.revisions(plain) if r.commit == target.commit]
        return found[0] if found else Revision(target.commit, None, 0.0, 0)

    def hold(self, commit: str, seconds: float) -> float | None:
        """Keep revision ``commit`` from the server's retention for ``seconds`` (renew it
        while you compute with it; 0 releases it): the time it is held until."""
        return hold(self.client.transport, split_revision(self.id)[0], commit, seconds)

    def names(self, prefix: str = "") -> list[str]:
        return [n for n in self.info.tensors if n.startswith(prefix)]

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
        wanted = self._wanted(names, prefix)
        if not wanted:
            return {}
        with self.client.transport.receiving(self._bytes(wanted)):
            received = self._fetch_parallel(wanted, shard, axis, on_bytes, allocate, on_wait)
        out: dict[str, np.ndarray] = {}
        for name in wanted:
            r = received[name]
            h = r.header
            info = TensorInfo(name, h.dtype, h.shape, h.logical_shape, h.encoding, h.total_bytes)
            out[name] = as_array(r, info)
        return out

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
        wanted = self._wanted(names, prefix)  # checked now, not at the first next()
        if shard is not None and not 0 <= shard[0] < shard[1]:
            raise InvalidRequest(f"shard {shard[0]}/{shard[1]}: need 0 <= index < count")
        if window_bytes < 1:
            raise ValueError(f"window_bytes must be at least 1, got {window_bytes}")
        return self._iterate(wanted, window_bytes, shard, axis, on_bytes, allocate, on_wait)

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
        wanted = self._wanted(names, prefix)
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

    def _iterate(
        self,
        wanted: list[str],
        window_bytes: int,
        shard: tuple[int, int] | None,
        axis: int,
        on_bytes: Callable[[int], None] | None,
        allocate: Callable[[ChunkHeader], np.ndarray] | None,
        on_wait: OnWait | None,
    ) -> Generator[tuple[str, np.ndarray], None, None]:
        if not wanted:
            return
        planes = self.client.planes()
        handoff = planes.handoff
        handed = self._handoff(handoff, wanted, shard, axis, on_wait) if handoff else None
        if handed is not None:
            yield from self._iterate_handed(
                handed,
                planes.streams,
                wanted,
                window_bytes,
                shard,
                axis,
                on_bytes,
                allocate,
                on_wait,
            )
            return
        received = self._windowed(
            planes.streams, wanted, window_bytes, shard, axis, on_bytes, allocate, on_wait
        )
        try:
            for h, buffer in received:
                info = TensorInfo(
                    h.name, h.dtype, h.shape, h.logical_shape, h.encoding, h.total_bytes
                )
                yield h.name, as_array(buffer, info)
                del buffer  # the iterator holds no view once the consumer moves on
        finally:
            received.close()

    def _iterate_handed(
        self,
        handed: Handoff,
        streams: Transport,
        wanted: list[str],
        window_bytes: int,
        shard: tuple[int, int] | None,
        axis: int,
        on_bytes: Callable[[int], None] | None,
        allocate: Callable[[ChunkHeader], np.ndarray] | None,
        on_wait: OnWait | None,
    ) -> Generator[tuple[str, np.ndarray], None, None]:
        """Handed-off views (no window to bound: they are the node's page cache) and, in
        their places in stream order, the tensors the handoff could not give (strided
        sources), streamed within the window."""
        placed = _taken(handed, on_bytes, allocate)
        copied = [n for n in wanted if n in set(handed.copy)]
        streamed = (
            self._windowed(streams, copied, window_bytes, shard, axis, on_bytes, allocate, on_wait)
            if copied
            else iter(())
        )
        try:
            for name in wanted:
                if name in placed:
                    r = placed.pop(name)
                    h, buffer = r.header, r.buffer
                    del r
                else:
                    h, buffer = next(streamed)
                info = TensorInfo(
                    h.name, h.dtype, h.shape, h.logical_shape, h.encoding, h.total_bytes
                )
                yield h.name, as_array(buffer, info)
                del buffer
        finally:
            close = getattr(streamed, "close", None)
            if close is not None:
                close()

    def _windowed(
        self,
        streams: Transport,
        names: list[str],
        window_bytes: int,
        shard: tuple[int, int] | None,
        axis: int,
        on_bytes: Callable[[int], None] | None,
        allocate: Callable[[ChunkHeader], np.ndarray] | None,
        on_wait: OnWait | None,
    ) -> Generator[tuple[ChunkHeader, np.ndarray], None, None]:
        """One stream of ``names`` over ``streams``, received within the window."""
        return iter_received(
            lambda p: streams.open_chunks(self.id, p),
            self._stream_params(names, shard, axis),
            names,
            window_bytes=window_bytes,
            receiving=streams.receiving(min(window_bytes, self._bytes(names))),
            retries=self.options.retries,
            retry_seconds=self._retry_seconds(),
            on_bytes=on_bytes,
            allocate=allocate,
            on_wait=on_wait or self.client.on_wait,
            verify=self.options.verify,
        )

    def _stream_params(
        self, names: list[str], shard: tuple[int, int] | None, axis: int
    ) -> StreamParams:
        """A stream request for ``names``, pinned to the revision the index was read at."""
        return StreamParams(
            names=tuple(names),
            shard=shard,
            axis=axis,
            chunk_bytes=self.options.chunk_bytes,
            revision=self.info.revision,
        )

    def files(self) -> list[RemoteFile]:
        """Every file of the model's repository (weights, index, config, tokenizer...):
        name relative to the model directory, size and content digest (xxh3-128 hex)."""
        listing = self.client._with_retry(
            lambda: self.client.transport.list_files(self.id),
            f"{self.client.address.url} files of {self.id!r}",
        )
        return [RemoteFile.from_json(f) for f in listing["files"]]

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
        if since is not None:
            self.last_update = pull_since(
                self, Path(dest), since, on_bytes=on_bytes, on_wait=on_wait
            ).as_counts()
            return Path(dest)
        return download_files(self, Path(dest), force=force, on_bytes=on_bytes, on_wait=on_wait)

    def _wanted(self, names: Sequence[str] | None, prefix: str | None) -> list[str]:
        """The tensors asked for: ``names`` (each checked to exist), else those under
        ``prefix`` (``None``: every tensor)."""
        if names is None:
            return self.names(prefix or "")
        wanted = list(names)
        for n in wanted:
            if n not in self.info.tensors:
                hint = did_you_mean(n, self.info.tensors)
                raise TensorNotFound(f"No weight named {n!r} in model {self.id!r}.{hint}")
        return wanted

    def _retry_seconds(self) -> float:
        if self.options.retry_seconds is not None:
            return retry_seconds_from(self.options.retry_seconds)
        return self.client.retry_seconds

    def _part_bound(self, name: str, shard: tuple[int, int] | None, axis: int) -> int:
        """Bytes of the tensor's part in a shard, or a close upper bound of them."""
        info = self.info.tensors[name]
        if shard is None or info.encoding is not None or len(info.shape) <= axis:
            return info.nbytes  # whole, or GGML blocks (split in whole blocks): at most all
        length = info.shape[axis]
        if length == 0:
            return 0
        # numpy.array_split: the largest part has ceil(length / n) slices along the axis
        return -(-length // shard[1]) * (info.nbytes // length)

    def _bytes(self, names: list[str]) -> int:
        return sum(self.info.tensors[n].nbytes for n in names)

    def _groups(self, names: list[str]) -> list[list[str]]:
        """Split into up to ``parallel`` groups of about equal bytes, keeping stream order."""
        parallel = max(1, self.options.parallel)
        total = self._bytes(names)
        if parallel == 1 or len(names) < 2 or total < PARALLEL_MIN_BYTES:
            return [names]
        groups: list[list[str]] = [[]]
        target, acc = total / parallel, 0
        for n in names:
            if acc >= target * len(groups) and len(groups) < parallel:
                groups.append([])
            groups[-1].append(n)
            acc += self.info.tensors[n].nbytes
        return [g for g in groups if g]

    def _fetch_parallel(
        self,
        names: list[str],
        shard: tuple[int, int] | None,
        axis: int,
        on_bytes: Callable[[int], None] | None,
        allocate: Callable[[ChunkHeader], np.ndarray] | None = None,
        on_wait: OnWait | None = None,
    ) -> dict[str, ReceivedTensor]:
        if shard is not None and not 0 <= shard[0] < shard[1]:
            raise InvalidRequest(f"shard {shard[0]}/{shard[1]}: need 0 <= index < count")
        planes = self.client.planes()
        if planes.handoff is not None:
            handed = self._handoff(planes.handoff, names, shard, axis, on_wait)
            if handed is not None:
                result = _taken(handed, on_bytes, allocate)
                if handed.copy:  # strided sources: not a byte range of a file
                    rest = [n for n in names if n in set(handed.copy)]
                    result.update(
                        self._fetch_streams(rest, shard, axis, on_bytes, allocate, on_wait)
                    )
                return result
        return self._fetch_streams(names, shard, axis, on_bytes, allocate, on_wait)

    def _handoff(
        self,
        handoff: HandoffClient,
        names: list[str],
        shard: tuple[int, int] | None,
        axis: int,
        on_wait: OnWait | None,
    ) -> Handoff | None:
        """The tensors as views of the node's page cache, or None when the handoff socket
        stopped answering (the client copies over a stream from then on)."""
        verify = self.options.verify
        try:
            return call_with_retry(
                lambda: handoff.open(
                    self.id, names=names, shard=shard, axis=axis,
                    revision=self.info.revision, verify=verify,
                ),
                self._retry_seconds(),
                f"{handoff.path} model {self.id!r}",
                on_wait or self.client.on_wait,
            )  # fmt: skip
        except TransportError as e:
            self.client._planes.handoff_failed(e)
            if self.client.data_plane == "handoff":
                raise
            return None

    def _fetch_streams(
        self,
        names: list[str],
        shard: tuple[int, int] | None,
        axis: int,
        on_bytes: Callable[[int], None] | None,
        allocate: Callable[[ChunkHeader], np.ndarray] | None = None,
        on_wait: OnWait | None = None,
    ) -> dict[str, ReceivedTensor]:
        transport = self.client.planes().streams
        groups = self._groups(names)
        retry_seconds = self._retry_seconds()
        counted = on_bytes
        if on_bytes is not None and len(groups) > 1:
            progress_lock = threading.Lock()

            def counted(n: int) -> None:  # one stream per thread, one caller's callback
                with progress_lock:
                    on_bytes(n)

        def one(group: list[str]) -> dict[str, ReceivedTensor]:
            params = self._stream_params(group, shard, axis)
            place = allocate
            if place is None and len(group) > 1:
                # One tensor alone gets the same aligned buffer without an arena.
                place = arena_allocator({n: self._part_bound(n, shard, axis) for n in group})
            return receive(
                lambda p: transport.open_chunks(self.id, p),
                params,
                group,
                retries=self.options.retries,
                retry_seconds=retry_seconds,
                on_bytes=counted,
                allocate=place,
                on_wait=on_wait or self.client.on_wait,
                verify=self.options.verify,
            )

        if len(groups) == 1:
            return one(groups[0])
        result: dict[str, ReceivedTensor] = {}
        with ThreadPoolExecutor(len(groups), thread_name_prefix="weightserve-fetch") as pool:
            for part in pool.map(one, groups):
                result.update(part)
        return result


def _taken(
    handed: Handoff,
    on_bytes: Callable[[int], None] | None,
    allocate: Callable[[ChunkHeader], np.ndarray] | None,
) -> dict[str, ReceivedTensor]:
    """A handoff's tensors, counted as arrived, as they are (read-only views of the page
    cache), or copied into the caller's buffers when it gives ``allocate`` (an output file,
    pinned memory): the one copy the caller asked for. The handoff keeps none of them."""
    tensors, handed.tensors = handed.tensors, {}
    if on_bytes is not None and handed.nbytes:
        on_bytes(handed.nbytes)
    if allocate is None:
        return tensors
    placed = {}
    for name, t in tensors.items():
        buffer = allocate(t.header)
        np.copyto(buffer[: t.header.total_bytes], t.buffer)
        own = ReceivedTensor(t.header, buffer[: t.header.total_bytes])
        own.received = t.received
        placed[name] = own
    return placed
