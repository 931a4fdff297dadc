"""The native socket loops against the Python ones, both sides of a load at once:
``python -m bench.native_loops --size-gib 1 --rounds 10``.

Four servers serve one checkpoint: with ``--sendfile=on`` and ``--sendfile=off``, each once
with the native loops (client/wire/socket_loops.py) and once with
``WEIGHTSERVE_NATIVE=0``. One client process fetches the whole model from each in turn, its
own loops switched to match the server's, and then reads it from the verifying raw reader
(``raw_mmap_2conn_lowat_xxh3``, bench/ceilings.py), every round in the same order. One warm
process and alternation take out what a fresh process per load adds (imports, a first
connection), which is what this A/B is about: CPU per load, and wall time on shared cores.

Per contender: the median and min-max wall time, the per-round ratio against the raw reader,
and the medians of the client's and the server's user and system CPU seconds per load.
Results go to ``bench/results/native-loops.json``; the figures are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import guest_memory, report
from bench.ceilings import raw_fetch
from bench.checkpoint import MODEL_ID, RESULTS_DIR, Checkpoint, quick
from bench.procs import ServerProcess, cpu_seconds
from bench.procs import write_json_atomically as write_json
from bench.weightserve_loads import fetch_load
from weightserve.client.wire import socket_loops

RESULTS = RESULTS_DIR / "native-loops.json"
# (row, server's extra arguments, native loops on both sides)
SERVERS = [
    ("sendfile_native", ["--sendfile=on"], True),
    ("sendfile_python", ["--sendfile=on"], False),
    ("copy_native", ["--sendfile=off"], True),
    ("copy_python", ["--sendfile=off"], False),
]
RAW = "raw_mmap_2conn_lowat_xxh3"


def _measure(run, server_pid: int) -> dict[str, float]:
    """One load: wall seconds, and the client's and server's user and system CPU seconds."""
    server_before = cpu_seconds(server_pid)
    client_before = os.times()
    start = time.perf_counter()
    out = run()
    wall = time.perf_counter() - start
    client_after = os.times()
    server_after = cpu_seconds(server_pid)
    del out
    return {
        "wall_s": wall,
        "client_user_s": client_after.user - client_before.user,
        "client_sys_s": client_after.system - client_before.system,
        "server_user_s": server_after[0] - server_before[0],
        "server_sys_s": server_after[1] - server_before[1],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.native_loops", description=__doc__)
    p.add_argument("--size-gib", type=float, default=1.0, help="checkpoint size (default 1)")
    p.add_argument("--rounds", type=int, default=10, help="rounds (default 10)")
    p.add_argument(
        "--parallel", type=int, default=None, help="streams per load (default: the client's)"
    )
    p.add_argument("--quick", action="store_true", help="tiny checkpoint, 2 rounds (CI)")
    p.add_argument("--out", type=Path, default=RESULTS, help="JSON output path")
    p.add_argument("--nice", type=int, default=0, help="renice the run (negative: root only)")
    p.add_argument("--hold-freed-memory", action="store_true",
                   help="stop free page reporting for the run (root; bench/guest_memory.py)")  # fmt: skip
    args = p.parse_args(argv)
    if socket_loops._socketio is None:
        print("the native loops are not built (pip install -e . with a C compiler)")
        return 2
    if args.nice:
        os.nice(args.nice)
    rounds = 2 if args.quick else args.rounds
    ck = quick() if args.quick else Checkpoint.for_size(args.size_gib)
    ck.ensure()
    size = ck.path.stat().st_size

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    hold = guest_memory.held(log) if args.hold_freed_memory else contextlib.nullcontext("default")
    samples: dict[str, list[dict[str, float]]] = {}
    with contextlib.ExitStack() as stack:
        memory = stack.enter_context(hold)
        runs: dict[str, tuple[Any, int, bool]] = {}
        for row, extra, native in SERVERS:
            # The server reads WEIGHTSERVE_NATIVE once, at import.
            os.environ["WEIGHTSERVE_NATIVE"] = "1" if native else "0"
            server = stack.enter_context(ServerProcess("bench.server", str(ck.root), *extra))
            load = fetch_load(server.info["http_url"], MODEL_ID, parallel=args.parallel)
            runs[row] = (load, server.pid, native)
        os.environ.pop("WEIGHTSERVE_NATIVE")
        raw_server = stack.enter_context(ServerProcess("bench.ceilings", str(ck.path)))
        raw = raw_fetch(raw_server.info["port"], size, "mmap", 2, verify=True, lowat=True)
        runs[RAW] = (raw, raw_server.pid, True)
        for load, _, native in runs.values():  # warm: imports, page cache, first connections
            socket_loops.NATIVE = native
            load()
        for i in range(rounds):
            for row, (load, pid, native) in runs.items():
                socket_loops.NATIVE = native
                samples.setdefault(row, []).append(_measure(load, pid))
            log(f"round {i + 1}/{rounds}")
    socket_loops.NATIVE = True

    medians = {
        row: {key: statistics.median(s[key] for s in got) for key in got[0]}
        for row, got in samples.items()
    }
    ratios = {
        row: [r["wall_s"] / s["wall_s"] for r, s in zip(samples[RAW], got, strict=True)]
        for row, got in samples.items()
    }
    gib = size / (1 << 30)
    print(f"machine: {report.machine()['cpu']}; {gib:.2f} GiB, {rounds} rounds, one client "
          "process; median [min-max]; CPU: medians, seconds per load")  # fmt: skip
    print(f"{'row':28s} {'wall s':>22s} {'x raw':>6s} {'cli usr':>8s} {'cli sys':>8s} "
          f"{'srv usr':>8s} {'srv sys':>8s}")  # fmt: skip
    for row, got in samples.items():
        walls = [s["wall_s"] for s in got]
        m = medians[row]
        span = f"{m['wall_s']:.3f} [{min(walls):.3f}-{max(walls):.3f}]"
        print(f"{row:28s} {span:>22s} {statistics.median(ratios[row]):6.2f} "
              f"{m['client_user_s']:8.3f} {m['client_sys_s']:8.3f} "
              f"{m['server_user_s']:8.3f} {m['server_sys_s']:8.3f}")  # fmt: skip
    write_json(
        args.out,
        {
            "machine": report.machine(),
            "config": {
                "size_bytes": size,
                "rounds": rounds,
                "parallel": args.parallel,
                "free_page_reporting": memory,
            },  # fmt: skip
            "samples": samples,
            "medians": medians,
            "x_raw_per_round": ratios,
        },
    )
    print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
