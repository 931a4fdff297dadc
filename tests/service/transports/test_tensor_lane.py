"""The small-tensor lane: ``GET /v1/models/ID/-/tensors/NAME`` (optionally ``?revision=``) is
answered before FastAPI's routing, with the route's bytes, errors and metrics; every other
request (a shard, HEAD, an unknown query key) goes to the route as before."""

from __future__ import annotations

import time
from collections.abc import Callable
from urllib.parse import quote

from tests.support._util import http_request
from weightserve.service.transports.http.app import TensorLane


def lane_answers(server, path: str, method: str = "GET"):
    before = TensorLane.answered
    reply = http_request(server.http_port, path, method=method)
    return reply, TensorLane.answered - before


def test_one_tensor_through_the_lane_is_the_routes_answer(server, reference) -> None:
    want = reference("mixed")
    for name in ("float32", "bfloat16", "scalar.int64", "empty.float32"):
        reply, lane = lane_answers(server, f"/v1/models/mixed/-/tensors/{quote(name)}")
        assert lane == 1, name
        assert reply.rows()[name] == want[name].array.tobytes(), name
    # A name with slashes and a model id with one.
    name = sorted(reference("org/sharded"))[0]
    reply, lane = lane_answers(server, f"/v1/models/org/sharded/-/tensors/{quote(name, safe='')}")
    assert lane == 1 and reply.rows()[name] == reference("org/sharded")[name].array.tobytes()


def test_lane_errors_are_the_routes_errors(server) -> None:
    revision = http_request(server.http_port, "/v1/models/mixed").json()["revision"]
    reply, lane = lane_answers(server, f"/v1/models/mixed/-/tensors/float32?revision={revision}")
    assert (reply.status, lane) == (200, 1)
    reply, lane = lane_answers(server, "/v1/models/mixed/-/tensors/float32?revision=0000")
    assert (reply.status, lane) == (412, 1)
    assert reply.error()[0] == "RevisionMismatch"
    reply, lane = lane_answers(server, "/v1/models/mixed/-/tensors/no.such.tensor")
    assert (reply.status, lane) == (404, 1)
    assert reply.error()[0] == "TensorNotFound"
    reply, lane = lane_answers(server, "/v1/models/no/such-model/-/tensors/w")
    assert (reply.status, lane) == (404, 1)
    assert reply.error()[0] == "ModelNotFound"


def test_anything_else_goes_to_the_route(server, reference) -> None:
    for path, method in (
        ("/v1/models/org/sharded/-/tensors/model.embed_tokens.weight?shard=0/2", "GET"),
        ("/v1/models/mixed/-/tensors/float32", "HEAD"),
        ("/v1/models/mixed/-/tensors/float32?revision=x&axis=0", "GET"),
        ("/v1/models/mixed/-/stream?name=float32", "GET"),
    ):
        reply, lane = lane_answers(server, path, method)
        assert lane == 0, path
        assert reply.status in (200, 404, 412), (path, reply.status)


def test_lane_requests_are_counted_as_streams(server) -> None:
    metrics = server.state.metrics

    def streams() -> float:
        return metrics.requests.labels("http", "stream", "200")._value.get()

    before = _settled(streams)
    reply, lane = lane_answers(server, "/v1/models/mixed/-/tensors/float32")
    assert (reply.status, lane) == (200, 1)
    assert _settled(streams) == before + 1


def _settled(read: Callable[[], float]) -> float:
    """A counter once it stopped moving: the server counts a request just after its last
    byte went out, so a client that read the answer may look before it is counted."""
    value = read()
    for _ in range(40):
        time.sleep(0.05)
        again = read()
        if again == value:
            break
        value = again
    return value


def test_lane_reads_a_revision_that_needs_decoding_and_keeps_the_body_limit(server) -> None:
    revision = http_request(server.http_port, "/v1/models/mixed").json()["revision"]
    # Percent-encoded: not the lane's plain form, decoded as the route would.
    encoded = "".join(f"%{ord(c):02X}" for c in revision)
    reply, lane = lane_answers(server, f"/v1/models/mixed/-/tensors/float32?revision={encoded}")
    assert (reply.status, lane) == (200, 1)
    reply, lane = lane_answers(server, "/v1/models/mixed/-/tensors/float32?revision=a%2Fb")
    assert (reply.status, lane) == (412, 1)
    assert reply.error()[0] == "RevisionMismatch"
    # A GET announcing a body over the limit is refused before the lane answers it.
    limit = server.state.limits.max_request_bytes
    before = TensorLane.answered
    reply = http_request(
        server.http_port,
        "/v1/models/mixed/-/tensors/float32",
        headers={"content-length": str(limit + 1)},
    )
    assert reply.status == 413 and reply.error()[0] == "ResourceExhausted"
    assert TensorLane.answered - before == 1  # taken by the lane, refused inside it
