"""A/B of this tree's server against another git ref's: ``python -m bench --against REF``.

REF's client/ and service/ are exported with ``git archive`` into a temporary directory and
made importable as ``weightserve`` through a directory of symlinks on the PYTHONPATH of REF's
server process only; every client is this tree's (``--client ref``: REF's loads use REF's
client, for a REF whose wire this client no longer speaks), both serve the same checkpoint.
Each round measures the raw-TCP ceiling, then every contender on both servers back to back
(which tree goes first flips each round, so a drift within a pair does not favour one tree).
The table gives each tree's median and min-max, the per-round ratio this/REF and its median
and min-max; the JSON goes to ``bench/results/ab-REF.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import guest_memory, report
from bench.checkpoint import MODEL_ID, REPO, RESULTS_DIR, Checkpoint, quick
from bench.procs import Job, ServerProcess
from bench.procs import write_json_atomically as write_json
from bench.run import Contender, measure, warm_page_cache

RESULTS = RESULTS_DIR
GiB = 1 << 30
RAW = [(mode, conns) for mode in ("sendfile", "mmap") for conns in (1, 2)]
# key -> (bench.weightserve_loads function, the unit of a round's figure); GB/s: higher is
# better, p50 ms: lower is better.
CONTENDERS = {
    "ws_http_max": ("max_load", "GB/s"),
    "ws_http_fetch": ("fetch_load", "GB/s"),
    "ws_grpc_max": ("max_load", "GB/s"),  # a grpc:// URL: metadata over gRPC, data over HTTP
    "ws_http_small_latency": ("small_requests", "p50 ms"),
}
# Run only when ``--only`` names them (a change to the client's gRPC side is the rarer one).
ON_REQUEST = {"ws_grpc_max"}
SIDES = ("this", "ref")


def wanted(argv: list[str]) -> bool:
    """Whether a ``python -m bench`` command line asks for an A/B run."""
    return any(a == "--against" or a.startswith("--against=") for a in argv)


def resolve(ref: str) -> str:
    """The full commit hash ``ref`` names in this repository."""
    out = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"--against {ref}: not a commit of this repository")
    return out.stdout.strip()


def export_tree(commit: str, into: Path) -> Path:
    """``commit``'s client/ and service/ under ``into/tree``, importable as ``weightserve``
    from the returned directory (``weightserve/client`` and ``weightserve/service`` are
    symlinks into the tree, as pyproject.toml's package-dir maps them)."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", commit, "client", "service"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    tree = into / "tree"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    importable = into / "import"
    (importable / "weightserve").mkdir(parents=True)
    for part in ("client", "service"):
        (importable / "weightserve" / part).symlink_to(tree / part, target_is_directory=True)
    return importable


def jobs(
    key: str, base: str, ck: Checkpoint, args: argparse.Namespace, client: list[str] | None
) -> list[Job]:
    """One load of ``key`` against ``base``; ``client``: the PYTHONPATH of another tree's
    client (None: this tree's)."""
    fn = CONTENDERS[key][0]
    kwargs: dict[str, Any] = {"base": base, "model_id": MODEL_ID}
    if fn == "small_requests":
        kwargs |= {"names": ck.small_tensors(), "requests": args.small_requests}
    return [Job(f"bench.weightserve_loads:{fn}", kwargs, client)]


def value(key: str, r: dict) -> float:
    """One round's figure: GB/s, or the p50 latency in ms."""
    if CONTENDERS[key][1] == "p50 ms":
        return float(r["results"][0]["p50_ms"])
    return r["bytes"] / r["seconds"] / 1e9


def spread(xs: list[float]) -> dict[str, Any]:
    return {"values": xs, "median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize(key: str, rounds: dict[str, list[dict]], ceilings: list[float]) -> dict[str, Any]:
    unit = CONTENDERS[key][1]
    out: dict[str, Any] = {"unit": unit}
    for side in SIDES:
        values = [value(key, r) for r in rounds[side]]
        s = spread(values)
        if unit == "GB/s":
            s["ratio_to_ceiling"] = statistics.median(
                v / c for v, c in zip(values, ceilings, strict=True)
            )
        gib = rounds[side][0]["bytes"] / GiB
        cpu = [r.get("server_cpu_user_s", 0) + r.get("server_cpu_sys_s", 0) for r in rounds[side]]
        s["server_cpu_s_per_gib"] = statistics.median(cpu) / gib if gib else None
        s["seconds"] = [r["seconds"] for r in rounds[side]]
        out[side] = s
    out["ratio"] = spread(
        [t / r for t, r in zip(out["this"]["values"], out["ref"]["values"], strict=True)]
    )
    return out


def table(results: dict[str, Any]) -> str:
    cfg, ceiling = results["config"], results["ceiling"]
    ck = results["checkpoint"]

    def span(s: dict) -> str:
        return f"{s['median']:.3g} [{s['min']:.3g}-{s['max']:.3g}]"

    lines = [
        f"A/B: this tree {cfg['this']} vs REF {cfg['ref']} ({cfg['ref_commit'][:12]}); "
        f"{ck['bytes'] / GiB:.2f} GiB checkpoint, {ck['tensors']} tensors; "
        f"{cfg['rounds']} rounds, the two servers back to back, order flipped each round; "
        f"client: {cfg['client'].split(',')[0]}",
        f"raw-TCP ceiling (best of {len(RAW)} raw loopback fetches each round): "
        f"{span(ceiling)} GB/s",
        "median [min-max]; ratio = this/REF of the same round (GB/s: >1 this tree faster; "
        "p50 ms: <1 this tree faster)",
        "",
        f"{'contender':<24} {'unit':<7} {'this':>22} {'REF':>22} "
        f"{'x ceil this/REF':>16} {'this/REF':>20}  per round",
    ]
    for key, c in results["contenders"].items():
        this, ref, ratio = c["this"], c["ref"], c["ratio"]
        ceil = (
            f"{this['ratio_to_ceiling']:.2f}/{ref['ratio_to_ceiling']:.2f}"
            if "ratio_to_ceiling" in this
            else ""
        )
        per_round = " ".join(f"{x:.2f}" for x in ratio["values"])
        lines.append(
            f"{key:<24} {c['unit']:<7} {span(this):>22} {span(ref):>22} {ceil:>16} "
            f"{span(ratio):>20}  {per_round}"
        )
    lines.append("")
    lines.append("server CPU-s/GiB (median), this / REF:")
    for key, c in results["contenders"].items():
        if c["unit"] == "GB/s":
            lines.append(
                f"  {key:<22} {c['this']['server_cpu_s_per_gib']:.3f} / "
                f"{c['ref']['server_cpu_s_per_gib']:.3f}"
            )
    if cfg["quick"]:
        lines.append("(--quick: a tiny checkpoint; these numbers mean nothing)")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench --against REF", description=__doc__)
    p.add_argument("--against", required=True, help="git ref or commit to compare with")
    p.add_argument("--size-gib", type=float, default=2.0, help="checkpoint size (default 2)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 7; --quick: 3)")
    p.add_argument("--quick", action="store_true", help="tiny checkpoint (CI)")
    p.add_argument("--small-requests", type=int, default=None,
                   help="sequential single-tensor requests per round (default 2000)")  # fmt: skip
    p.add_argument("--client", choices=("this", "ref"), default="this",
                   help="whose client loads from REF's server (default: this tree's)")  # fmt: skip
    p.add_argument("--only", help="comma-separated contender keys (" + ",".join(CONTENDERS) + ")")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default results/ab-REF)")
    p.add_argument("--nice", type=int, default=0, help="renice the run (see python -m bench)")
    p.add_argument("--hold-freed-memory", action="store_true",
                   help="hold VM free page reporting for the run (see python -m bench)")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.nice:
        os.nice(args.nice)
    commit = resolve(args.against)
    ck = quick() if args.quick else Checkpoint.for_size(args.size_gib)
    rounds = args.rounds or (3 if args.quick else 7)
    args.small_requests = args.small_requests or (50 if args.quick else 2000)
    keys = [k for k in CONTENDERS if k not in ON_REQUEST]
    if args.only:
        keys = [k for k in CONTENDERS if k in set(args.only.split(","))]
    out = args.out or RESULTS / f"ab-{re.sub(r'[^A-Za-z0-9._-]', '_', args.against)}.json"

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    ck.ensure(log)
    warm_page_cache(ck.path)
    size = ck.path.stat().st_size
    started, load_before, ticks_before = time.time(), os.getloadavg(), report.cpu_ticks()
    hold = guest_memory.held(log) if args.hold_freed_memory else contextlib.nullcontext("default")
    with tempfile.TemporaryDirectory(prefix="ws-ab-") as tmp:
        importable = export_tree(commit, Path(tmp))
        with (
            hold as page_reporting,
            ServerProcess("bench.ceilings", str(ck.path)) as raw,
            ServerProcess("bench.ab_server", str(ck.root)) as this,
            ServerProcess("bench.ab_server", str(ck.root), pythonpath=[str(importable)]) as ref,
        ):
            if not ref.info["service_dir"].startswith(tmp):
                raise RuntimeError(f"REF's server imported {ref.info['service_dir']}")
            servers = {"this": this.info, "ref": ref.info}
            clients = {"this": None, "ref": [str(importable)] if args.client == "ref" else None}
            raw_rounds: dict[str, list[dict]] = {f"raw_{m}_{n}conn": [] for m, n in RAW}
            measured = {k: {s: [] for s in SIDES} for k in keys}
            log(f"A/B against {args.against}: {len(keys)} contenders x 2 trees x {rounds} rounds")
            for r in range(rounds):
                for mode, conns in RAW:
                    c = Contender(f"raw_{mode}_{conns}conn", "ceiling", [Job(
                        "bench.ceilings:raw_fetch",
                        {"port": raw.info["port"], "size": size, "mode": mode,
                         "connections": conns})])  # fmt: skip
                    raw_rounds[c.key].append(measure(c, {"raw": raw.pid}))
                for key in keys:
                    for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                        t = time.monotonic()
                        info = servers[side]
                        url = info["grpc_url"] if key.startswith("ws_grpc") else info["http_url"]
                        todo = jobs(key, url, ck, args, clients[side])
                        c = Contender(key, "ab", todo)
                        measured[key][side].append(measure(c, {"ws": info["pid"]}))
                        log(f"  round {r + 1}/{rounds} {key:<24} {side:<4} "
                            f"{time.monotonic() - t:6.2f} s wall")  # fmt: skip
    raw_gbps = {k: [r["bytes"] / r["seconds"] / 1e9 for r in rs] for k, rs in raw_rounds.items()}
    ceilings = [max(gbps[r] for gbps in raw_gbps.values()) for r in range(rounds)]
    machine = report.machine()
    results: dict[str, Any] = {
        "machine": machine,
        "config": {
            "command": report.command("bench", argv),
            "this": machine["git"],
            "ref": args.against,
            "ref_commit": commit,
            "rounds": rounds,
            "quick": args.quick,
            "small_requests": args.small_requests,
            "order": "raw ceilings, then per contender both servers back to back, "
            "this tree first in odd rounds, REF first in even ones",
            "client": "this tree's for both servers, a fresh process per load (bench.worker)"
            if args.client == "this"
            else "each tree's own, a fresh process per load (bench.worker)",
            "wall_seconds": round(time.time() - started, 1),
            "loadavg_1min": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
            "steal_fraction": report.steal_fraction(ticks_before),
            "nice": os.nice(0),
            "page_reporting": page_reporting,
        },
        "checkpoint": {
            "tag": ck.tag,
            "file_bytes": size,
            "bytes": ck.data_bytes,
            "tensors": len(ck.tensors()),
        },
        "ceiling": spread(ceilings) | {"per_key_gbps": raw_gbps},
        "contenders": {k: summarize(k, measured[k], ceilings) for k in keys},
    }
    write_json(out, results)
    print(table(results))
    report.print_saved(out, REPO)
    return 0
