"""What a process's memory maps, from ``/proc/self/maps``."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def mapping_of(arr: np.ndarray) -> str:
    """What this process's memory at ``arr`` maps (a path, ``/memfd:NAME (deleted)``, or
    empty for anonymous memory)."""
    address = arr.ctypes.data
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(None, 5)
        start, end = (int(x, 16) for x in parts[0].split("-"))
        if start <= address < end:
            return parts[5] if len(parts) == 6 else ""
    raise AssertionError(f"address {address:#x} is not mapped")
