"""A minimal zero-copy Arrow Flight setup: what Flight itself costs, with no weightserve code.

Server (``python -m bench.flight_minimal FILE``, its own process like the raw server): a
``pyarrow.flight`` server whose ``DoGet`` sends a byte range of the checkpoint file as record
batches of one ``uint8`` column, each a view of an mmap of the file (no copy), in 8 MiB
batches with a 16-byte ``app_metadata`` (offset, length). The ticket is ``b"OFFSET LENGTH"``.

Client (``fetch``, inside ``bench.worker``): connects, reads each stream with
``read_chunk()`` and copies every batch's data buffer once into one fresh preallocated
buffer (``np.copyto``, GIL released), as the weightserve client copies into its arena, with
glibc's heap held steady as the weightserve client holds it during gRPC loads. Client
creation, allocation and page faults are inside the timing, as for every contender.

The weightserve Flight path does the same plus what a protocol needs (request parsing, auth,
limits, per-chunk digests, metrics, resume); ``ws_flight_fetch`` against this contender is
what that costs.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys

import numpy as np

from bench.procs import serve_until_stdin_closes

BATCH_BYTES = 8 << 20  # below glibc's 32 MiB mmap threshold, as the weightserve server's
_META = struct.Struct("<qq")


def serve(path: str) -> None:
    import pyarrow as pa
    import pyarrow.flight as flight

    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    view = memoryview(mmap.mmap(fd, 0, access=mmap.ACCESS_READ))
    schema = pa.schema([pa.field("data", pa.uint8(), nullable=False)])

    def batches(at: int, end: int):
        while at < end:
            n = min(BATCH_BYTES, end - at)
            column = pa.Array.from_buffers(pa.uint8(), n, [None, pa.py_buffer(view[at : at + n])])
            yield pa.RecordBatch.from_arrays([column], schema=schema), _META.pack(at, n)
            at += n

    class Server(flight.FlightServerBase):
        def do_get(self, context, ticket):
            offset, length = map(int, ticket.ticket.split())
            return flight.GeneratorStream(schema, batches(offset, offset + length))

    server = Server("grpc://127.0.0.1:0")
    serve_until_stdin_closes({"port": server.port, "size": size})
    server.shutdown()


# -- client side (run inside bench.worker) ---------------------------------------------------


def fetch(port: int, size: int, connections: int = 1):
    """The whole file over ``connections`` Flight streams into one fresh buffer, with the
    weightserve client's channel options and glibc heap settings during the load
    (client/transports/flight.py, client/transports/malloc.py): without the latter every received message is
    mapped, faulted in and unmapped again, and the floor would carry ~100,000 page faults
    per GiB of malloc churn that has nothing to do with Flight."""
    import pyarrow.flight as flight

    from bench.ceilings import split_fetch
    from weightserve.client.transports.flight import CHANNEL_OPTIONS
    from weightserve.client.transports.malloc import steady_heap

    def run():
        buf = np.empty(size, dtype=np.uint8)

        def one(lo: int, hi: int) -> None:
            client = flight.FlightClient(
                f"grpc://127.0.0.1:{port}", generic_options=CHANNEL_OPTIONS
            )
            reader = client.do_get(flight.Ticket(f"{lo} {hi - lo}".encode()))
            while True:
                try:
                    chunk = reader.read_chunk()
                except StopIteration:
                    break
                at, n = _META.unpack(chunk.app_metadata)
                column = chunk.data.column(0)
                values = column.buffers()[1]
                np.copyto(buf[at : at + n], np.frombuffer(values, np.uint8, n, column.offset))
            client.close()

        with steady_heap():
            split_fetch(size, connections, one)
        return {"bytes": size}, buf

    return run


if __name__ == "__main__":
    serve(sys.argv[1])
