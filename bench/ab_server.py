"""The server of an A/B run, for either tree: ``python -m bench.ab_server ROOT``.

The same launcher and the same configuration for both trees; which ``weightserve`` it
serves is decided by its PYTHONPATH alone. ServerConfig options an older tree lacks are left
out, and the ready line names the directory the server's package was imported from.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

from bench.procs import serve_until_stdin_closes


def main(root: str) -> None:
    import weightserve.service
    from weightserve.service.server import ServerConfig, WeightServer

    logging.basicConfig(level=logging.WARNING)
    wanted = {"http_port": 0, "grpc_port": 0, "flight_port": 0}
    known = {f.name for f in dataclasses.fields(ServerConfig)}
    config = ServerConfig(root, **{k: v for k, v in wanted.items() if k in known})
    server = WeightServer(config).start()
    try:
        serve_until_stdin_closes(
            {
                "http_url": server.http_url,
                "grpc_url": getattr(server, "grpc_url", None),
                "pid": os.getpid(),
                "service_dir": os.path.dirname(weightserve.service.__file__),
            }
        )
    finally:
        server.stop(grace=1.0)


if __name__ == "__main__":
    main(sys.argv[1])
