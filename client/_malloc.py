"""Keep glibc from returning gRPC receive buffers to the kernel in the middle of a bulk load.

gRPC (grpcio's and Flight's C++ core alike) receives each message into freshly malloc'd
buffers and frees them once the chunk is placed. With glibc's defaults, buffers above the
mmap threshold are mapped and unmapped per message, and the heap top is trimmed back to the
kernel after frees, so every message faults its pages in again: ~170,000 minor faults per
GiB received, most of the client's system time (docs/performance.md).

``steady_heap()`` raises the mmap and trim thresholds while bulk streams run (reference
counted: parallel streams share one window) and afterwards trims the heap and puts glibc's
initial thresholds back, so the process keeps no more memory than before. It does nothing
where the C library is not glibc, and ``WEIGHTSERVE_MALLOC_TUNING=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import platform
import threading
from collections.abc import Iterator

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_DURING = {_M_TRIM_THRESHOLD: 1 << 30, _M_MMAP_THRESHOLD: 64 << 20}
_AFTER = {_M_TRIM_THRESHOLD: 128 << 10, _M_MMAP_THRESHOLD: 128 << 10}  # glibc's initial values

_lock = threading.Lock()
_active = 0
_libc: ctypes.CDLL | None | bool = False  # False: not looked up yet


def _glibc() -> ctypes.CDLL | None:
    global _libc
    if _libc is False:
        _libc = None
        enabled = os.environ.get("WEIGHTSERVE_MALLOC_TUNING", "1").lower() not in ("0", "off")
        if enabled and platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            with contextlib.suppress(OSError, AttributeError):
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
                libc.malloc_trim.argtypes = [ctypes.c_size_t]
                _libc = libc
    return _libc  # type: ignore[return-value]


@contextlib.contextmanager
def steady_heap() -> Iterator[None]:
    """Raise glibc's mmap/trim thresholds for the duration; restore and trim after."""
    global _active
    libc = _glibc()
    if libc is None:
        yield
        return
    with _lock:
        _active += 1
        if _active == 1:
            for option, value in _DURING.items():
                libc.mallopt(option, value)
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                for option, value in _AFTER.items():
                    libc.mallopt(option, value)
                libc.malloc_trim(0)
