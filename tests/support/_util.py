"""Small helpers shared by tests: reading an index entry's bytes straight from its file,
recording the tensor streams a client opens, and plain HTTP requests with their replies."""

from __future__ import annotations

import http.client
import json
from typing import Any

import numpy as np
import pyarrow as pa

from weightserve.client.wire.dtypes import numpy_dtype, wire_dtype
from weightserve.service.readers.base import TensorEntry


def entry_bytes(entry: TensorEntry) -> bytes:
    """The tensor's bytes, C-contiguous, read from the file with plain reads (no mmap)."""
    if entry.strides is None:
        with open(entry.file, "rb") as f:
            f.seek(entry.offset)
            data = f.read(entry.nbytes)
        assert len(data) == entry.nbytes
        return data
    itemsize = wire_dtype(entry.dtype).itemsize
    raw = np.fromfile(entry.file, dtype=np.uint8)
    base = raw[entry.offset :]
    arr = np.lib.stride_tricks.as_strided(
        base.view(np.uint8),
        shape=(*entry.shape, itemsize),
        strides=(*(s * itemsize for s in entry.strides), 1),
    )
    return np.ascontiguousarray(arr).tobytes()


def entry_array(entry: TensorEntry) -> np.ndarray:
    """The tensor as a NumPy array of its served dtype and shape."""
    return np.frombuffer(entry_bytes(entry), dtype=numpy_dtype(entry.dtype)).reshape(entry.shape)


def record_streams(transport: Any) -> list[Any]:
    """Every StreamParams the transport opens a tensor stream with, from now on."""
    opened: list[Any] = []
    original = transport.open_chunks

    def recording(model: str, params: Any) -> Any:
        opened.append(params)
        return original(model, params)

    transport.open_chunks = recording
    return opened


ARROW = "application/vnd.apache.arrow.stream"


class Reply:
    """One HTTP reply, read whole: status, lower-cased headers, body."""

    def __init__(self, resp: http.client.HTTPResponse) -> None:
        self.status = resp.status
        self.headers = {k.lower(): v for k, v in resp.getheaders()}
        self.body = resp.read()

    def json(self) -> Any:
        assert self.headers["content-type"].startswith("application/json"), self.headers
        return json.loads(self.body)

    def error(self) -> tuple[str, str]:
        err = self.json()["error"]
        assert set(err) == {"type", "message"}
        return err["type"], err["message"]

    def table(self) -> pa.Table:
        assert self.headers["content-type"] == ARROW
        return pa.ipc.open_stream(self.body).read_all()

    def rows(self) -> dict[str, bytes]:
        """Tensor name -> its bytes, from an Arrow stream reply."""
        assert self.status == 200, self.body[:300]
        out: dict[str, bytes] = {}
        for row in self.table().to_pylist():
            out[row["name"]] = out.get(row["name"], b"") + row["data"]
        return out


def http_request(
    port: int,
    path: str,
    method: str = "GET",
    body: dict | None = None,
    headers: dict | None = None,
) -> Reply:
    """One request on a new loopback connection (a JSON body when ``body`` is given)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    hdrs = dict(headers or {})
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        hdrs["content-type"] = "application/json"
    try:
        conn.request(method, path, body=data, headers=hdrs)
        return Reply(conn.getresponse())
    finally:
        conn.close()
