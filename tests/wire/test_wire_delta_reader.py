"""One strict reader of the delta stream (client/wire/delta.py) on every side: each malformed
stream a publisher's patch upload is refused for (a real server on loopback answers 400) is
refused by the reader a worker and a node cache read the server's stream with, with the same
error and message; a patch declaring more than its tensor holds is refused before anything is
decompressed or allocated."""

from __future__ import annotations

import io
import json
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from tests.support.publishing import put_patch
from weightserve.client._client import Client
from weightserve.client.errors import InvalidRequest
from weightserve.client.wire.delta import (
    MAX_HEADER_LINE,
    PATCH,
    DeltaCut,
    DeltaHeader,
    check_header,
    decode_patch,
    read_updates,
)
from weightserve.service.server import ServerConfig, WeightServer

MODEL = "team/reader"
ELEMENTS = 256  # the base's tensor "w": float32[256]


def line(**fields: Any) -> bytes:
    body = {"kind": "patch", "name": "w", "dtype": "float32", "shape": [ELEMENTS],
            "nbytes": ELEMENTS * 4, "digest": "0" * 32, "element_bytes": 4, "gap_bytes": 4}  # fmt: skip
    body.update(fields)
    return json.dumps(body).encode() + b"\n"


def patch(gaps: list[int], values: list[int], **fields: Any) -> bytes:
    """A patch line of ``w`` and its payload: ``gaps`` as uint32, ``values`` raw (their
    count the patch's)."""
    positions = pa.compress(np.array(gaps, np.uint32).tobytes(), codec="zstd", asbytes=True)
    raw = np.array(values, np.uint32).tobytes()
    header = line(count=len(values), positions_bytes=len(positions), values_bytes=len(raw),
                  values_raw_bytes=len(raw), **fields)  # fmt: skip
    return header + positions + raw


# The server's refusals of a patch upload (service/sources/publishing/patched_tensors.py): each a body.
MALFORMED = {
    "not JSON": b"not json\n",
    "not an object": b"[1, 2]\n",
    "no name": json.dumps({"kind": "same", "dtype": "float32"}).encode() + b"\n",
    "an empty name": line(kind="same", name=""),
    "an unknown kind": line(kind="diff"),
    "a negative size": line(kind="same", nbytes=-4),
    "a size that is not a count": line(kind="same", nbytes="1024"),
    "a shape that is not counts": line(kind="same", shape=["256"]),
    "a name twice": line(kind="same") + line(kind="same"),
    "a gap of 3 bytes": line(
        count=1, gap_bytes=3, positions_bytes=0, values_bytes=4, values_raw_bytes=4
    )
    + b"\0" * 4,  # fmt: skip
    "an unknown codec": line(
        count=1, positions_bytes=0, values_bytes=4, values_raw_bytes=4, values_codec="lz4"
    )
    + b"\0" * 4,  # fmt: skip
    "raw values of another count": line(
        count=2, positions_bytes=0, values_bytes=4, values_raw_bytes=4
    )
    + b"\0" * 4,  # fmt: skip
    "more changes than the tensor holds": line(
        count=1 << 40,
        positions_bytes=16,
        values_bytes=16,
        values_raw_bytes=4 << 40,
        values_codec="zstd",
    )
    + b"\0" * 32,  # fmt: skip
    "positions that are not zstd": line(
        count=1, positions_bytes=3, values_bytes=4, values_raw_bytes=4
    )
    + b"\0" * 7,  # fmt: skip
    "positions outside the tensor": patch([ELEMENTS], [7]),
    "fewer positions than declared": patch([1], [7, 8]),
    "a header line too long": b"{" + b" " * MAX_HEADER_LINE + b"}\n",
    "more bytes than its shape holds": line(kind="whole", nbytes=1 << 40) + b"\0" * 16,
    "positions longer than their gaps compress to": line(
        count=1, positions_bytes=1 << 40, values_bytes=4, values_raw_bytes=4
    )
    + b"\0" * 8,  # fmt: skip
    "JSON nested too deeply": b"[" * 100_000 + b"]" * 100_000 + b"\n",
    "an object nested too deeply": b'{"kind": "same", "name": "w", "x": '
    + b"[" * 100_000
    + b"]" * 100_000
    + b"}\n",
    "2^34 changes of the tensor": line(
        count=1 << 34, values_bytes=8, values_raw_bytes=4 << 34, values_codec="zstd"
    )
    + b"\0" * 8,  # fmt: skip
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[WeightServer, str]]:
    root = tmp_path_factory.mktemp("reader")
    sockets = tempfile.mkdtemp(prefix="ws-")
    config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=None, uds=f"{sockets}/ws.sock",
        rescan_seconds=0, watch=False, allow_publish=True,
    )  # fmt: skip
    with WeightServer(config) as srv, Client(srv.http_url) as c:
        base = c.publish(MODEL, {"w": np.arange(ELEMENTS, dtype=np.float32)})
        yield srv, base.commit


def upload_refusal(srv: WeightServer, base: str, body: bytes) -> tuple[int, dict[str, Any]]:
    """The server's answer to ``body`` as a patch against ``base``."""
    return put_patch(srv.http_port, MODEL, base, body)


@pytest.mark.parametrize("case", list(MALFORMED))
def test_the_reader_refuses_what_the_server_refuses(server, case: str) -> None:
    srv, base = server
    body = MALFORMED[case]
    status, answer = upload_refusal(srv, base, body)
    assert status == 400, (case, answer)
    with pytest.raises(InvalidRequest) as refused:
        list(read_updates(io.BytesIO(body)))
    assert answer["error"]["type"] == "InvalidRequest"
    assert answer["error"]["message"] == str(refused.value), case


def test_a_stream_cut_inside_a_payload_is_a_cut_not_a_malformed_stream(server) -> None:
    srv, base = server
    body = patch([1], [7])[:-2]
    status, answer = upload_refusal(srv, base, body)
    assert status == 400 and "ends inside tensor 'w'" in answer["error"]["message"]
    with pytest.raises(DeltaCut, match="ends inside tensor 'w'"):
        list(read_updates(io.BytesIO(body)))
    with pytest.raises(DeltaCut, match="inside a header line"):
        list(read_updates(io.BytesIO(line(kind="same")[:-1])))


def test_a_well_formed_stream_is_read_whole() -> None:
    whole = np.arange(4, dtype=np.uint8).tobytes()
    body = (
        line(kind="same")
        + patch([3, 2], [9, 10]).replace(b'"name": "w"', b'"name": "p"', 1)
        + json.dumps(
            {
                "kind": "whole",
                "name": "x",
                "dtype": "uint8",
                "shape": [4],
                "nbytes": 4,
                "digest": "",
            }
        ).encode()
        + b"\n"
        + whole  # fmt: skip
    )
    got = list(read_updates(io.BytesIO(body)))
    assert [(u.name, u.kind) for u in got] == [("w", "same"), ("p", "patch"), ("x", "whole")]
    assert got[1].positions is not None and got[1].positions.tolist() == [3, 5]
    assert got[1].values is not None and got[1].values.tolist() == [9, 10]
    assert got[2].data == whole


def test_declared_sizes_are_bounded_by_the_tensor_before_decoding() -> None:
    """48 KiB of payload declaring a billion changes of a small tensor allocates nothing."""
    before = pa.total_allocated_bytes()
    header = DeltaHeader(kind=PATCH, name="w", dtype="float32", shape=[ELEMENTS],
                         nbytes=ELEMENTS * 4, count=1 << 30, element_bytes=4, gap_bytes=8,
                         positions_bytes=24 << 10, values_bytes=24 << 10,
                         values_raw_bytes=4 << 30, values_codec="zstd")  # fmt: skip
    with pytest.raises(InvalidRequest, match="changes 1073741824 elements of a tensor of 256"):
        check_header(header)
    payload = b"\0" * (24 << 10)
    with pytest.raises(InvalidRequest, match="of a tensor of 256"):
        decode_patch(header, payload, payload)
    assert pa.total_allocated_bytes() - before < 1 << 20
