"""A stream's lease (service/serving/lease.py) is released exactly once, however its call
ends: refused, failing at any stage, cancelled, cut idle or finished; and a gRPC ReadFile cut
before its first message gives its stream slot back."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from safetensors.numpy import save_file

from weightserve.client.errors import ResourceExhausted, TensorNotFound
from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2 as pb
from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2_grpc as pb_grpc
from weightserve.service.server import ServerConfig, WeightServer
from weightserve.service.serving.lease import StreamLease
from weightserve.service.serving.request import TensorRequest
from weightserve.service.serving.state import Limits, ServiceState
from weightserve.service.sources.local.catalog import Catalog

MODEL = "m"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lease-root")
    (root / MODEL).mkdir()
    arrays = {"a": np.arange(64, dtype=np.float32), "b": np.ones((4, 4), dtype=np.float16)}
    save_file(arrays, str(root / MODEL / "model.safetensors"))
    return root


class CountingState(ServiceState):
    """A ServiceState that counts how often a stream slot is taken and given back."""

    def __init__(self, catalog: Catalog, limits: Limits) -> None:
        super().__init__(catalog, limits)
        self.taken = 0
        self.returned = 0

    @contextlib.contextmanager
    def stream_slot(self, transport: str, client: str = "") -> Iterator[None]:
        with super().stream_slot(transport, client):
            self.taken += 1
            try:
                yield
            finally:
                self.returned += 1


@pytest.fixture
def state(root: Path) -> CountingState:
    return CountingState(Catalog(root), Limits(max_streams=1, idle_timeout=0.2))


def counted(state: ServiceState, transport: str = "grpc") -> dict[tuple[str, str], float]:
    """weightserve_requests_total of ``transport`` by (code, error class or "")."""
    found: dict[tuple[str, str], float] = {}
    for metric in state.metrics.registry.collect():
        for sample in metric.samples:
            labels = sample.labels
            if sample.name == "weightserve_requests_total" and labels["transport"] == transport:
                key = (labels["code"], "")
                found[key] = found.get(key, 0) + sample.value
            if sample.name == "weightserve_errors_total" and labels["transport"] == transport:
                key = ("error", labels["error"])
                found[key] = found.get(key, 0) + sample.value
    return {k: v for k, v in found.items() if v}


def plan_one(lease: StreamLease, state: ServiceState, name: str = "a") -> None:
    lease.plan(state.catalog.get(MODEL), TensorRequest(names=(name,)), "client")


def stage_plan_fails(lease: StreamLease, state: ServiceState) -> None:
    plan_one(lease, state, "no such tensor")


def stage_after_admit(lease: StreamLease, state: ServiceState) -> None:
    plan_one(lease, state)
    raise ResourceExhausted("raised while holding the slot")


def stage_after_idle_watch(lease: StreamLease, state: ServiceState) -> None:
    plan_one(lease, state)
    lease.watch_idle(lambda: None)
    raise RuntimeError("a bug while streaming")


def stage_cancelled(lease: StreamLease, state: ServiceState) -> None:
    plan_one(lease, state)
    lease.progress(10)
    raise GeneratorExit  # what grpc throws into a stream's generator on cancel


def stage_left_unfinished(lease: StreamLease, state: ServiceState) -> None:
    plan_one(lease, state)  # returns without finishing: the client went away


def stage_finished(lease: StreamLease, state: ServiceState) -> None:
    plan_one(lease, state)
    lease.progress(256)
    lease.finished()


STAGES: list[tuple[Callable[[StreamLease, ServiceState], None], type | None, tuple]] = [
    (stage_plan_fails, TensorNotFound, ("error", "TensorNotFound")),
    (stage_after_admit, ResourceExhausted, ("error", "ResourceExhausted")),
    (stage_after_idle_watch, RuntimeError, ("error", "Internal")),
    (stage_cancelled, GeneratorExit, ("error", "Cancelled")),
    (stage_left_unfinished, None, ("error", "Cancelled")),
    (stage_finished, None, ("OK", "")),
]


@pytest.mark.parametrize(
    ("body", "raised", "outcome"), STAGES, ids=lambda s: getattr(s, "__name__", "")
)
def test_lease_is_released_exactly_once(
    state: CountingState, body: Callable, raised: type | None, outcome: tuple
) -> None:
    lease = StreamLease(state, "grpc")
    with contextlib.ExitStack() as guard:
        if raised is not None:
            guard.enter_context(pytest.raises(raised))
        with lease:
            body(lease, state)
    lease.close()  # again, and once more by hand: nothing more is given back or counted
    lease.release()
    assert state.returned == state.taken <= 1
    assert state.open_streams == 0
    assert counted(state)[outcome] == 1
    assert sum(v for (code, _), v in counted(state).items() if code != "error") == 1
    # The slot is free: the only one (max_streams=1) is taken again at once.
    with StreamLease(state, "grpc") as again:
        plan_one(again, state)
        again.finished()
    assert state.returned == state.taken


def test_refused_lease_holds_nothing(state: CountingState) -> None:
    with StreamLease(state, "grpc") as first:
        plan_one(first, state)
        with pytest.raises(ResourceExhausted), StreamLease(state, "grpc") as second:
            plan_one(second, state)  # the one slot is taken
        first.finished()
    assert state.taken == state.returned == 1
    assert counted(state) == {("OK", ""): 1, ("RESOURCE_EXHAUSTED", ""): 1,
                              ("error", "ResourceExhausted"): 1}  # fmt: skip


def test_handed_over_lease_is_closed_by_its_new_owner_once(state: CountingState) -> None:
    with StreamLease(state, "http", counted=False) as lease:
        plan_one(lease, state)
        owned = lease.handed_over()
    assert state.open_streams == 1  # the response holds it now
    owned.release()  # a small answer frees the slot before it sends ...
    assert state.open_streams == 0
    owned.close()  # ... and closes the lease when it ends
    owned.close()
    assert state.taken == state.returned == 1


def test_an_idle_lease_is_cut_once(state: CountingState) -> None:
    cuts: list[float] = []
    with StreamLease(state, "grpc") as lease:
        plan_one(lease, state)
        lease.watch_idle(lambda: cuts.append(time.monotonic()))
        deadline = time.monotonic() + 5
        while not cuts and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # more than idle_timeout again: no second cut
    assert len(cuts) == 1 and lease.idle_cut
    assert counted(state)[("error", "IdleTimeout")] == 1


# ----------------------------------------------------------------- gRPC ReadFile, cut early


@pytest.fixture(scope="module")
def one_stream_server(root: Path) -> Iterator[WeightServer]:
    config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=None, rescan_seconds=0, watch=False,
        limits=Limits(max_streams=1),
    )  # fmt: skip
    with WeightServer(config) as srv:
        yield srv


def open_grpc_streams(srv: WeightServer) -> float:
    for metric in srv.state.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == "weightserve_open_streams" and sample.labels["transport"] == "grpc":
                return sample.value
    return 0.0


def eventually(check: Callable[[], bool], what: str, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def read_whole_file(srv: WeightServer) -> bytes:
    with grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}") as channel:
        stub = pb_grpc.WeightServiceStub(channel)
        request = pb.FileRequest(model=MODEL, name="model.safetensors")
        return b"".join(chunk.data for chunk in stub.ReadFile(request, timeout=10))


def assert_slot_given_back(srv: WeightServer, root: Path) -> None:
    eventually(lambda: srv.state.open_streams == 0, "the stream slot is given back")
    assert open_grpc_streams(srv) == 0
    # The only slot (max_streams=1) serves the next call.
    assert read_whole_file(srv) == (root / MODEL / "model.safetensors").read_bytes()


def test_read_file_failing_at_its_initial_metadata_frees_its_slot(
    one_stream_server: WeightServer, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(self: object, metadata: object) -> None:
        raise grpc.RpcError()  # what grpc raises once the client has cancelled

    monkeypatch.setattr(grpc._server._Context, "send_initial_metadata", fail)
    with pytest.raises(grpc.RpcError):
        read_whole_file(one_stream_server)
    monkeypatch.undo()
    assert_slot_given_back(one_stream_server, root)


def test_read_file_cancelled_before_its_first_message_frees_its_slot(
    one_stream_server: WeightServer, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = one_stream_server
    admitted, cancelled = threading.Event(), threading.Event()
    take_slot = srv.state.stream_slot

    @contextlib.contextmanager
    def slot_then_wait(transport: str, client: str = "") -> Iterator[None]:
        with take_slot(transport, client):
            admitted.set()
            cancelled.wait(10)  # the client cancels here, before the initial metadata
            yield

    monkeypatch.setattr(srv.state, "stream_slot", slot_then_wait)
    with grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}") as channel:
        stub = pb_grpc.WeightServiceStub(channel)
        call = stub.ReadFile(pb.FileRequest(model=MODEL, name="model.safetensors"), timeout=10)
        assert admitted.wait(10)
        call.cancel()
        time.sleep(0.3)  # the cancellation reaches the server
        cancelled.set()
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() == grpc.StatusCode.CANCELLED
    monkeypatch.undo()
    assert_slot_given_back(srv, root)
    assert counted(srv.state).get(("error", "Cancelled")) == 1
