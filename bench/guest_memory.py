"""Free page reporting: a VM's freed memory going back to the hypervisor, and holding it.

On a VM with virtio-balloon free page reporting, memory a process frees is handed back to
the host a moment later, and the next allocation that lands on it faults through the
hypervisor. Fresh memory then costs 0.1 s per GiB or 0.8 s per GiB depending on whether the
pages were reported in between, and every contender here lands its load in fresh memory.
On the development VM this was the largest source of noise (docs/performance.md, "Noise").

``held()`` raises the kernel's reporting order above the largest buddy order for the run,
so nothing is reported, and restores the old order afterwards. It needs root and a kernel
with page reporting; elsewhere it changes nothing and says why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

PARAMS = Path("/sys/module/page_reporting/parameters")
NEVER = "11"  # above MAX_PAGE_ORDER (10 on x86-64): no free block is large enough to report


def reported_kib() -> int | None:
    """Memory reported to the host since boot, KiB (None without page reporting)."""
    try:
        return int((PARAMS / "reported_kib").read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def held(log) -> Iterator[str]:
    """Stop free page reporting for the duration; yields what was done, for the JSON."""
    order = PARAMS / "page_reporting_order"
    try:
        before = order.read_text().strip()
        order.write_text(NEVER)
    except OSError as e:
        log(f"free page reporting left as it is: {e}")
        yield f"unchanged ({e.strerror or e})"
        return
    log(f"free page reporting held for the run (page_reporting_order {before} -> {NEVER})")
    try:
        yield f"held (page_reporting_order {before} -> {NEVER} during the run)"
    finally:
        order.write_text(before)
