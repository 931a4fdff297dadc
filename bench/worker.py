"""One measured client: ``python -m bench.worker '{"fn": "module:function", "kwargs": {...}}'``.

``function(**kwargs)`` prepares (imports, connects where the contender would keep a
connection anyway) and returns ``run``; ``run()`` is the timed part and returns
``(info, keep)``: ``info`` a dict of numbers (``bytes`` at least), ``keep`` whatever the load
produced, held until the peak RSS is read so the measurement covers the loaded weights.
"""

from __future__ import annotations

import importlib
import json
import resource
import sys
import time

from bench.procs import READY, RESULT


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    spec = json.loads(sys.argv[1])
    module, _, name = spec["fn"].partition(":")
    prepare = getattr(importlib.import_module(module), name)
    run = prepare(**spec["kwargs"])
    rss_before = _status("VmRSS")
    print(READY, flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.monotonic()
    info, keep = run()
    t1 = time.monotonic()
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    # Peak RSS: VmHWM, the high-water mark of this process's own address space. (ru_maxrss
    # would be wrong here: Linux carries the spawning parent's peak across vfork+exec into
    # it, so every worker would report at least the bench driver's RSS.)
    peak = _status("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {
        "t0": t0,
        "t1": t1,
        "rss_before": rss_before,
        "peak_rss": peak,
        "cpu_user_s": cpu1.ru_utime - cpu0.ru_utime,
        "cpu_sys_s": cpu1.ru_stime - cpu0.ru_stime,
        **info,
    }
    print(RESULT + json.dumps(result), flush=True)
    del keep


if __name__ == "__main__":
    main()
