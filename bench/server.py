"""The weightserve server under test, in its own process: ``python -m bench.server ROOT``.

A separate process so that no client shares the server's GIL (an in-process server would
make every client/server pair fight over one interpreter lock and measure that instead).
Prints ``BENCH-READY {"http_url", "grpc_url", "unix_url", "pid"}`` and serves until stdin
closes. It also listens on a same-node socket in a temporary directory (``unix_url``). An
optional second argument is the handoff's snapshot budget in bytes (0: the client copies);
``--sendfile=on|off|auto`` (or ``--no-sendfile``) anywhere after ROOT serves HTTP as the flag
does.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile

from bench.procs import serve_until_stdin_closes


def main(root: str, snapshot_bytes: int | None = None, sendfile: str = "auto") -> None:
    from weightserve.service import server as server_module
    from weightserve.service.server import ServerConfig, WeightServer

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="ws-bench-") as sockets:
        uds = f"{sockets}/ws.sock"
        config = ServerConfig(
            root,
            http_port=0,
            grpc_port=0,
            flight_port=0,
            uds=uds,
            handoff_snapshot_bytes=snapshot_bytes,
            sendfile=sendfile,
            allow_publish=True,  # bench.publish; a loopback server of the bench's own
        )
        server = WeightServer(config).start()
        # As ``weightserve serve`` does once it is up; an A/B's older tree may not have it.
        freeze = getattr(server_module, "freeze_startup_heap", None)
        if freeze is not None:
            freeze()
        try:
            serve_until_stdin_closes(
                {
                    "http_url": server.http_url,
                    "grpc_url": server.grpc_url,
                    "unix_url": f"unix://{uds}",
                    "pid": os.getpid(),
                }
            )
        finally:
            server.stop(grace=1.0)


if __name__ == "__main__":
    modes = [a.removeprefix("--sendfile=") for a in sys.argv if a.startswith("--sendfile=")]
    mode = "off" if "--no-sendfile" in sys.argv else (modes or ["auto"])[-1]
    args = [a for a in sys.argv[1:] if not a.startswith(("--sendfile=", "--no-sendfile"))]
    main(args[0], int(args[1]) if len(args) > 1 else None, mode)
