"""weightserve contenders, client side (each runs inside a fresh ``bench.worker`` process).

- ``max_load``: the MAX pipeline path, ``RemoteWeights(url)`` then ``w.data()`` for every
  ``name, w in items()`` (with ``how="state_dict"``: ``RemoteWeights(url).state_dict()``).
  When ``RemoteWeights`` is not importable yet, both fall back to
  ``RemoteModel.fetch(prefix="")`` and the result says ``impl: fetch-fallback``.
- ``fetch_load``: ``Client(url).model(id).fetch(...)``, the bulk API underneath (whole model,
  a prefix, or a tensor-parallel shard), default ``FetchOptions`` (2 parallel streams).
  ``flight=False`` keeps a gRPC client on ``StreamTensors`` instead of the Flight endpoint.
- ``small_requests``: sequential single-tensor fetches of the norm vectors, per-request
  latency recorded (p50/p99), or just a count for the 8-client throughput run;
  ``small_requests_raw_socket``: the same GETs from a raw socket, the floor under them.

Every timed load includes building the client and fetching the model index, as a real load
does. The server runs in its own process (``bench.server``).

The bench server also listens on a same-node socket, and on this one machine every client is
on its node, so ``auto`` would take the zero-copy handoff everywhere. Each contender therefore
names its data plane (``plane_for``): ``unix://`` bases take the handoff (``data_plane``
overrides, e.g. ``http`` for HTTP over the socket), ``http://`` and ``grpc://`` bases the
``network`` plane (what a client on another node gets: HTTP, for grpc:// too), ``flight=True``
/ ``False`` Arrow Flight / gRPC StreamTensors.
"""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np


def plane_for(base: str, flight: bool | None, data_plane: str | None) -> str:
    if data_plane is not None:
        return data_plane
    if base.startswith("unix://"):
        return "handoff"
    if flight is not None:
        return "flight" if flight else "grpc"
    return "network"


def use_plane(base: str, flight: bool | None = None, data_plane: str | None = None) -> None:
    """Every client of this worker process takes the contender's data plane."""
    os.environ["WEIGHTSERVE_DATA_PLANE"] = plane_for(base, flight, data_plane)


def import_transport(base: str) -> None:
    """Import what the client needs for ``base`` before the clock starts.

    The client imports gRPC, protobuf and Flight lazily (an HTTP-only user never pays for
    them); a pipeline that loads over gRPC pays ~130 ms of imports once per process, which
    is start-up, not load time. Timing it would mostly measure the import system.
    """
    try:
        from weightserve.client.transports import base as _transport  # noqa: F401
    except ImportError:  # an older tree's client (``--against REF --client ref``)
        import weightserve.client  # noqa: F401

    if base.startswith("grpc"):
        import grpc  # noqa: F401
        import grpc._channel  # noqa: F401  - grpc imports it at the first channel
        import pyarrow.flight  # noqa: F401

        from weightserve.client.transports import flight as _flight  # noqa: F401
        from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2  # noqa: F401

        # The transport imports the method table at its construction (an older tree's
        # client has none).
        with contextlib.suppress(ImportError):
            from weightserve.client.wire import grpc_methods  # noqa: F401


def remote_weights_class():
    """``RemoteWeights`` if the client has it yet, else None."""
    try:
        from weightserve.client.max.weights import RemoteWeights
    except ImportError:
        try:
            from weightserve.client import RemoteWeights  # type: ignore[attr-defined]
        except ImportError:
            return None
    return RemoteWeights


def model_url(base: str, model_id: str) -> str:
    """The URL ``RemoteWeights`` takes: ``http://H:P/v1/models/ID`` or ``grpc://H:P/ID``
    (``unix://SOCKET/v1/models/ID`` on the same node)."""
    if base.startswith(("http", "unix")):
        return f"{base}/v1/models/{model_id}"
    return f"{base}/{model_id}"


def max_load(base: str, model_id: str, how: str = "items", data_plane: str | None = None):
    RemoteWeights = remote_weights_class()
    if RemoteWeights is None:
        run = fetch_load(base, model_id)

        def fallback():
            info, keep = run()
            return {**info, "impl": "fetch-fallback"}, keep

        return fallback
    url = model_url(base, model_id)
    use_plane(base, data_plane=data_plane)
    import_transport(base)
    try:  # import MAX (when installed) before the clock starts, as a pipeline has it already
        from weightserve.client.max.compat import backend
    except ImportError:
        try:  # an older tree's client (``--against REF --client ref``)
            from weightserve.client._max_compat import backend  # type: ignore[no-redef]
        except ImportError:
            backend = None  # type: ignore[assignment]
    if backend is not None:
        backend()

    def run_max():
        weights = RemoteWeights(url)
        if how == "state_dict":
            out = dict(weights.state_dict())
        else:
            out = {name: w.data() for name, w in weights.items()}
        index = weights.remote_model.info.tensors
        return {"bytes": sum(index[n].nbytes for n in out), "impl": "RemoteWeights"}, out

    return run_max


def fetch_load(
    base: str,
    model_id: str,
    prefix: str = "",
    shard: list[int] | None = None,
    parallel: int | None = None,
    chunk_bytes: int | None = None,
    flight: bool | None = None,
    data_plane: str | None = None,
):
    from weightserve.client._client import Client, FetchOptions

    use_plane(base, flight, data_plane)
    import_transport(base)
    options = FetchOptions()
    if parallel is not None:
        options = FetchOptions(parallel=parallel, chunk_bytes=options.chunk_bytes)
    if chunk_bytes is not None:
        options = FetchOptions(parallel=options.parallel, chunk_bytes=chunk_bytes)

    def run():
        client = Client(base, flight=flight)
        model = client.model(model_id, options)
        arrays = model.fetch(prefix=prefix, shard=tuple(shard) if shard else None)
        client.close()
        return {"bytes": sum(a.nbytes for a in arrays.values())}, arrays

    return run


def layers_load(base: str, model_id: str, flight: bool | None = None, verify: str | None = None):
    """Layer by layer, as engines load (vLLM's ``load_weights(iterable)``): every tensor
    from ``RemoteModel.iter_tensors()`` (default window) copied into its place in memory
    allocated up front, the stand-in for the engine's parameters. ``bytes`` counts those
    parameters, so peak RSS above them is what the iteration itself holds."""
    from weightserve.client._client import Client, FetchOptions

    use_plane(base, flight, None)
    import_transport(base)
    options = FetchOptions() if verify is None else FetchOptions(verify=verify)

    def run():
        client = Client(base, flight=flight)
        model = client.model(model_id, options)
        info = model.tensors
        params = {n: np.empty(t.nbytes, np.uint8) for n, t in info.items()}  # untouched
        for name, array in model.iter_tensors():
            params[name][:] = array.reshape(-1).view(np.uint8)
        client.close()
        return {"bytes": sum(a.nbytes for a in params.values())}, params

    return run


def small_requests(
    base: str,
    model_id: str,
    names: list[str],
    requests: int,
    flight: bool | None = None,
    data_plane: str | None = None,
):
    """``requests`` sequential single-tensor fetches, cycling through ``names``."""
    from weightserve.client._client import Client

    use_plane(base, flight, data_plane)
    client = Client(base, flight=flight)
    model = client.model(model_id)
    model.fetch([names[0]])  # warm: connection / channel set up, code paths loaded

    def run():
        latencies = np.empty(requests)
        total = 0
        for i in range(requests):
            t = time.perf_counter()
            arrays = model.fetch([names[i % len(names)]])
            latencies[i] = time.perf_counter() - t
            total += next(iter(arrays.values())).nbytes
        client.close()
        return latency_result(latencies, total), None

    return run


def latency_result(latencies: np.ndarray, total: int) -> dict:
    """A sequential small-request run's figures from each request's seconds."""
    ms = latencies * 1e3
    return {
        "bytes": total,
        "requests": len(latencies),
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
    }


def small_requests_raw_socket(base: str, model_id: str, names: list[str], requests: int):
    """The floor under ``small_requests``: the same GETs (TensorLane's route) prebuilt and
    written on one kept-alive socket, each answer read by its Content-Length and dropped; no
    client library, no Arrow, no digest. What the server and the loopback cost alone."""
    import socket
    from urllib.parse import urlsplit

    from weightserve.client.wire.routes import http_model_path

    where = urlsplit(base)
    host, port = where.hostname or "127.0.0.1", where.port or 80
    gets = [
        f"GET {http_model_path(model_id, 'tensors', n)} HTTP/1.1\r\nHost: {host}\r\n"
        "Accept: application/vnd.apache.arrow.stream\r\n\r\n".encode()
        for n in names
    ]
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(1 << 20)
    view = memoryview(buf)

    def one(get: bytes) -> int:
        sock.sendall(get)
        have = sock.recv_into(view)
        while (end := buf.find(b"\r\n\r\n", 0, have)) < 0:
            have += sock.recv_into(view[have:])
        head = bytes(buf[:end]).lower()
        at = head.index(b"content-length:") + 15
        stop = head.find(b"\r\n", at)
        size = int(head[at : stop if stop >= 0 else len(head)])
        while have < end + 4 + size:
            have += sock.recv_into(view[have:])
        return size

    one(gets[0])  # warm, as small_requests does

    def run():
        latencies = np.empty(requests)
        total = 0
        for i in range(requests):
            t = time.perf_counter()
            total += one(gets[i % len(gets)])
            latencies[i] = time.perf_counter() - t
        sock.close()
        return latency_result(latencies, total), None

    return run


def drain(base: str, model_id: str, chunk_bytes: int | None = None):
    """Diagnostic: the whole-model stream (one stream, prefix "") read into a reused 16 MiB
    scratch buffer and discarded: no parsing, no digests, no allocation. What the server
    (and, for gRPC, grpcio's receive path) delivers to the cheapest possible consumer.
    ``chunk_bytes``: the stream's chunk size (None: the server's default)."""
    from weightserve.client._client import Client
    from weightserve.client.transports.base import StreamParams

    client = Client(base)
    scratch = memoryview(bytearray(16 << 20))
    params = StreamParams(prefix="", chunk_bytes=chunk_bytes)

    def run():
        source = client.transport.open_stream(model_id, params)
        total = 0
        while n := source.readinto(scratch):
            total += n
        source.close()
        client.close()
        return {"bytes": total}, None

    return run
