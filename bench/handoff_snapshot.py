"""The same-node handoff's guaranteed paths against the page-cache read:
``python -m bench.handoff_snapshot --size-gib 1 --rounds 5``.

Each round, in this order, every load in a fresh ``bench.worker`` process:

- ``pagecache_read``: the file (in the page cache) read into one fresh buffer;
- ``handoff_first_fetch``: ``fetch(prefix="")`` through the handoff of a server started for
  this round, whose first handoff makes the sealed snapshot (copy and checks included);
- ``handoff_warm_fetch`` and ``handoff_warm_max`` (``RemoteWeights``): the same server
  again, the snapshot made: the path every later load of the node takes;
- ``handoff_copy_fetch``: a server without snapshots (``--handoff-snapshot-bytes 0``), so
  the client copies the ranges out of the file's descriptor and verifies them.

Every handoff checks every chunk digest (``verify="full"``, the default). Results go to
``bench/results/handoff-snapshot.json``; the figures are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import Any

from bench import guest_memory, report
from bench.checkpoint import MODEL_ID, REPO, RESULTS_DIR, Checkpoint, quick
from bench.procs import Job, ServerProcess, run_group
from bench.procs import write_json_atomically as write_json
from bench.run import warm_page_cache

RESULTS = RESULTS_DIR / "handoff-snapshot.json"
KEYS = (
    "pagecache_read",
    "handoff_first_fetch",
    "handoff_warm_fetch",
    "handoff_warm_max",
    "handoff_copy_fetch",
)


def fetch(unix: str) -> Job:
    return Job("bench.weightserve_loads:fetch_load", {"base": unix, "model_id": MODEL_ID})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.handoff_snapshot", description=__doc__)
    p.add_argument("--size-gib", type=float, default=1.0, help="checkpoint size (default 1)")
    p.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    p.add_argument("--quick", action="store_true", help="tiny checkpoint, one round")
    p.add_argument("--hold-freed-memory", action="store_true",
                   help="as python -m bench: stop a VM handing freed memory back (root)")  # fmt: skip
    args = p.parse_args(argv)
    ck = quick() if args.quick else Checkpoint.for_size(args.size_gib)
    rounds = 1 if args.quick else args.rounds

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    ck.ensure(log)
    warm_page_cache(ck.path)
    measured: dict[str, list[dict]] = {key: [] for key in KEYS}
    started = time.time()
    hold = guest_memory.held(log) if args.hold_freed_memory else contextlib.nullcontext("default")
    with hold as page_reporting, ServerProcess("bench.server", str(ck.root), "0") as copying:
        copy_unix = copying.info["unix_url"]
        for r in range(rounds):
            measured["pagecache_read"].append(
                run_group([Job("bench.ceilings:pagecache_read", {"path": str(ck.path)})])
            )
            with ServerProcess("bench.server", str(ck.root)) as fresh:
                unix = fresh.info["unix_url"]
                measured["handoff_first_fetch"].append(run_group([fetch(unix)]))
                measured["handoff_warm_fetch"].append(run_group([fetch(unix)]))
                measured["handoff_warm_max"].append(
                    run_group(
                        [
                            Job(
                                "bench.weightserve_loads:max_load",
                                {"base": unix, "model_id": MODEL_ID},
                            )
                        ]
                    )
                )
            measured["handoff_copy_fetch"].append(run_group([fetch(copy_unix)]))
            log(f"  round {r + 1}/{rounds} done")
    summary: dict[str, Any] = {key: report.summarize(rs) for key, rs in measured.items()}
    page = summary["pagecache_read"]["gbps"]
    for s in summary.values():
        s["ratio_to_pagecache_read"] = s["gbps"] / page if page else float("nan")
    results = {
        "machine": report.machine(),
        "config": {
            "command": report.command("bench.handoff_snapshot", argv),
            "rounds": rounds,
            "wall_seconds": round(time.time() - started, 1),
            "page_reporting": page_reporting,
        },
        "checkpoint": {"file_bytes": ck.path.stat().st_size, "tensors": len(ck.tensors())},
        "contenders": summary,
    }
    write_json(RESULTS, results)
    print(f"{'contender':<22} {'median s':>9} {'min-max s':>15} {'GB/s':>6} {'x page':>7}")
    for key, s in summary.items():
        print(
            f"{key:<22} {s['median_s']:9.3f} {s['min_s']:7.3f}-{s['max_s']:.3f} "
            f"{s['gbps']:6.2f} {s['ratio_to_pagecache_read']:7.2f}"
        )
    report.print_saved(RESULTS, REPO)
    return 0


if __name__ == "__main__":
    sys.exit(main())
