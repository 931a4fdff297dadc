"""The weightserve server under test, in its own process: ``python -m bench.server ROOT``.

A separate process so that no client shares the server's GIL (an in-process server would
make every client/server pair fight over one interpreter lock and measure that instead).
Prints ``BENCH-READY {"http_url", "grpc_url", "pid"}`` and serves until stdin closes.
"""

from __future__ import annotations

import logging
import os
import sys

from bench.procs import serve_until_stdin_closes


def main(root: str) -> None:
    from weightserve.service.server import ServerConfig, WeightServer

    logging.basicConfig(level=logging.WARNING)
    server = WeightServer(ServerConfig(root, http_port=0, grpc_port=0, flight_port=0)).start()
    try:
        serve_until_stdin_closes(
            {"http_url": server.http_url, "grpc_url": server.grpc_url, "pid": os.getpid()}
        )
    finally:
        server.stop(grace=1.0)


if __name__ == "__main__":
    main(sys.argv[1])
