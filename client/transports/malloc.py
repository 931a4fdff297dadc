"""Keep glibc from returning gRPC receive buffers to the kernel in the middle of a bulk load.

gRPC (grpcio's and Flight's C++ core alike) receives each message into freshly malloc'd
buffers and frees them once the chunk is placed. With glibc's defaults, buffers above the
mmap threshold are mapped and unmapped per message, and the heap top is trimmed back to the
kernel after frees, so every message faults its pages in again: most of the client's system
time (docs/performance.md has the figures).

``steady_heap()`` raises the mmap and trim thresholds while bulk streams run (reference
counted: parallel streams share one window), then trims the heap, so the process keeps no
more memory than before. Setting either threshold turns glibc's dynamic threshold off for
good, so afterwards they stay where the dynamic rule would have taken them in a process
that frees large buffers (mmap threshold at its 32 MiB maximum, trim threshold twice it);
they are not put back at the 128 KiB start values, which would map every allocation above
128 KiB for the rest of the process. It does nothing where the C library is not glibc, where
the process set its own malloc tuning (``MALLOC_*_`` variables or ``GLIBC_TUNABLES``), or
with ``WEIGHTSERVE_MALLOC_TUNING=0``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import platform
import threading
from collections.abc import Iterator

log = logging.getLogger("weightserve.client")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_MAX = 32 << 20  # glibc's largest mmap threshold (64-bit); older glibc refuses more
_DURING = {_M_MMAP_THRESHOLD: _MMAP_MAX, _M_TRIM_THRESHOLD: 1 << 30}
_AFTER = {_M_MMAP_THRESHOLD: _MMAP_MAX, _M_TRIM_THRESHOLD: 2 * _MMAP_MAX}

_lock = threading.Lock()
_active = 0
_libc: ctypes.CDLL | None | bool = False  # False: not looked up yet


def _glibc_here() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _glibc() -> ctypes.CDLL | None:
    global _libc
    if _libc is False:
        _libc = None
        enabled = os.environ.get("WEIGHTSERVE_MALLOC_TUNING", "1").lower() not in ("0", "off")
        tuned_already = "GLIBC_TUNABLES" in os.environ or any(
            k.startswith("MALLOC_") and k.endswith("_") for k in os.environ
        )
        if enabled and _glibc_here() and not tuned_already:
            with contextlib.suppress(OSError, AttributeError):
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
                libc.malloc_trim.argtypes = [ctypes.c_size_t]
                _libc = libc
    return _libc  # type: ignore[return-value]


@contextlib.contextmanager
def steady_heap() -> Iterator[None]:
    """Raise glibc's mmap/trim thresholds for the duration; trim the heap after (see above)."""
    global _active
    libc = _glibc()
    if libc is None:
        yield
        return
    with _lock:
        _active += 1
        if _active == 1:
            _set(libc, _DURING)
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                _set(libc, _AFTER)
                libc.malloc_trim(0)


def _set(libc: ctypes.CDLL, values: dict[int, int]) -> None:
    for option, value in values.items():
        if libc.mallopt(option, value) != 1:  # glibc returns 1 on success
            log.debug("mallopt(%d, %d) refused", option, value)
