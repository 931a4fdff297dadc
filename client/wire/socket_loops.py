"""The optional native socket loops (client/wire/_socketio.c), built at install where a
C compiler is: a large HTTP body read (client/transports/http1.py) and the HTTP server's
direct write of a chunk (service/transports/http/streaming.py) each run in one call with the
GIL released throughout, instead of giving it up and taking it back at every receive, write
and poll. Both callers run the same loops in Python where the extension was not built, or
where ``WEIGHTSERVE_NATIVE=0`` (read once at import) asks for Python's, as the delta diff does
(client/wire/delta_plan.py).
"""

from __future__ import annotations

import os

try:
    import weightserve.client.wire._socketio as _socketio
except ImportError:  # built only where the install found a C compiler
    _socketio = None

# Whether new connections and writers use the native loops (tests set it to run both).
NATIVE = _socketio is not None and os.environ.get("WEIGHTSERVE_NATIVE", "1") != "0"

# The write loops' outcomes besides 0 (done) and an errno.
WRITE_TIMED_OUT = -1
WRITE_FILE_ENDED = -2

__all__ = ["NATIVE", "WRITE_FILE_ENDED", "WRITE_TIMED_OUT", "_socketio"]
