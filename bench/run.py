"""The benchmark run: checkpoint, servers, contenders in alternating rounds, report.

Every contender runs once per round, in the same order each round (A B C ... A B C ...), so
slow drifts of a noisy machine hit all of them alike; the report gives medians and min-max,
and every ratio compares numbers taken in this one run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import guest_memory, report
from bench.checkpoint import MODEL_ID, REPO, RESULTS_DIR, Checkpoint, quick
from bench.procs import Job, MemorySampler, ServerProcess, cpu_seconds, proc_status, run_group
from bench.procs import write_json_atomically as write_json
from bench.webserver import StaticServer
from bench.weightserve_loads import remote_weights_class

RESULTS = RESULTS_DIR / "latest.json"
MiB = 1 << 20
RSS_GROUPS = ("weightserve", "diagnostic", "partial", "ceiling_flight", "same_node")
# Client memory goal per transport (load only: start-up imports excluded, see rss_over_bytes).
RSS_GOALS = (
    ("ws_http_max", "HTTP, MAX path"),
    ("ws_grpc_max", "gRPC URL, MAX path"),
    ("ws_flight_fetch", "Arrow Flight, fetch"),
    ("ws_grpc_fetch_streamtensors", "gRPC StreamTensors, fetch"),
    ("ws_http_layers", "HTTP, layer by layer"),
    ("ws_grpc_layers", "Arrow Flight, layer by layer"),
)


@dataclass
class Contender:
    key: str
    group: str  # ceiling | alternative | weightserve | diagnostic | partial | concurrent | small
    jobs: list[Job]
    sample_server: bool = False  # record the weightserve server's RssAnon while it runs
    rounds: list[dict] = field(default_factory=list)


def contenders(
    ck: Checkpoint,
    raw_port: int,
    web_port: int,
    http: str,
    grpc: str,
    args: argparse.Namespace,
    flight_port: int = 0,
) -> list[Contender]:
    path = str(ck.path)
    size = ck.path.stat().st_size
    web_file = f"{MODEL_ID}/model.safetensors"
    have_max = remote_weights_class() is not None
    out: list[Contender] = []

    def add(key: str, group: str, fn: str, n: int = 1, sample: bool = False, **kwargs: Any):
        out.append(Contender(key, group, [Job(fn, kwargs) for _ in range(n)], sample))

    for mode in ("sendfile", "mmap"):
        for conns in (1, 2):
            add(f"raw_{mode}_{conns}conn", "ceiling", "bench.ceilings:raw_fetch",
                port=raw_port, size=size, mode=mode, connections=conns)  # fmt: skip
        add(f"raw_{mode}_2conn_lowat", "ceiling", "bench.ceilings:raw_fetch",
            port=raw_port, size=size, mode=mode, connections=2, lowat=True)  # fmt: skip
        # The ceiling for a client that checks every chunk's digest, as ours does.
        add(f"raw_{mode}_2conn_lowat_xxh3", "ceiling_verified", "bench.ceilings:raw_fetch",
            port=raw_port, size=size, mode=mode, connections=2, lowat=True, verify=True)  # fmt: skip
    add("pagecache_read", "ceiling", "bench.ceilings:pagecache_read", path=path)
    add("fresh_memory_touch", "diagnostic", "bench.ceilings:fresh_memory", size=size)
    add("local_safetensors_load_file", "ceiling", "bench.ceilings:local_load_file", path=path)
    add("web_download", "alternative", "bench.webserver:web_download", port=web_port, file=web_file)
    add(
        "web_safetensors_load",
        "alternative",
        "bench.webserver:web_load",
        port=web_port,
        file=web_file,
    )
    for t, base in (("http", http), ("grpc", grpc)):
        add(f"ws_{t}_max", "weightserve", "bench.weightserve_loads:max_load",
            base=base, model_id=MODEL_ID)  # fmt: skip
        if have_max:
            add(f"ws_{t}_state_dict", "weightserve", "bench.weightserve_loads:max_load",
                base=base, model_id=MODEL_ID, how="state_dict")  # fmt: skip
        add(f"ws_{t}_fetch", "weightserve", "bench.weightserve_loads:fetch_load",
            base=base, model_id=MODEL_ID)  # fmt: skip
    for t, base in (("http", http), ("grpc", grpc)):
        add(f"ws_{t}_drain", "diagnostic", "bench.weightserve_loads:drain",
            base=base, model_id=MODEL_ID)  # fmt: skip
        add(f"ws_{t}_fetch_1stream", "diagnostic", "bench.weightserve_loads:fetch_load",
            base=base, model_id=MODEL_ID, parallel=1)  # fmt: skip
        # The chunk size a bulk load asks for, against the server's default (2 MiB).
        for mib in (2, 8, 16):
            add(f"ws_{t}_fetch_chunk{mib}m", "diagnostic", "bench.weightserve_loads:fetch_load",
                base=base, model_id=MODEL_ID, chunk_bytes=mib << 20)  # fmt: skip
    # Layer by layer (iter_tensors, each tensor copied into parameters allocated up front).
    add("ws_http_layers", "weightserve", "bench.weightserve_loads:layers_load",
        base=http, model_id=MODEL_ID)  # fmt: skip
    add("ws_grpc_layers", "weightserve", "bench.weightserve_loads:layers_load",
        base=grpc, model_id=MODEL_ID, flight=True)  # fmt: skip
    # The same gRPC fetch with tensor data on grpcio's StreamTensors, not the Flight endpoint.
    add("ws_grpc_fetch_streamtensors", "diagnostic", "bench.weightserve_loads:fetch_load",
        base=grpc, model_id=MODEL_ID, flight=False)  # fmt: skip
    # The Flight data path against a minimal zero-copy Flight server (bench/flight_minimal.py).
    add("flight_minimal", "ceiling_flight", "bench.flight_minimal:fetch",
        port=flight_port, size=size, connections=2)  # fmt: skip
    add("ws_flight_fetch", "ceiling_flight", "bench.weightserve_loads:fetch_load",
        base=grpc, model_id=MODEL_ID, flight=True)  # fmt: skip
    for t, base in (("http", http), ("grpc", grpc)):
        add(f"ws_{t}_prefix", "partial", "bench.weightserve_loads:fetch_load",
            base=base, model_id=MODEL_ID, prefix=ck.prefix)  # fmt: skip
        add(f"ws_{t}_shard", "partial", "bench.weightserve_loads:fetch_load",
            base=base, model_id=MODEL_ID, shard=[1, 4])  # fmt: skip
    for mode in ("sendfile", "mmap"):
        add(f"raw_{mode}_1conn_conc4", "concurrent", "bench.ceilings:raw_fetch", n=4,
            port=raw_port, size=size, mode=mode, connections=1)  # fmt: skip
        add(f"raw_{mode}_1conn_lowat_conc4", "concurrent", "bench.ceilings:raw_fetch", n=4,
            port=raw_port, size=size, mode=mode, connections=1, lowat=True)  # fmt: skip
        add(f"raw_{mode}_1conn_lowat_conc4_xxh3", "concurrent", "bench.ceilings:raw_fetch", n=4,
            port=raw_port, size=size, mode=mode, connections=1, lowat=True, verify=True)  # fmt: skip
    for t, base in (("http", http), ("grpc", grpc)):
        add(f"ws_{t}_max_conc4", "concurrent", "bench.weightserve_loads:max_load", n=4,
            sample=True, base=base, model_id=MODEL_ID)  # fmt: skip
    add("ws_flight_fetch_conc4", "concurrent", "bench.weightserve_loads:fetch_load", n=4,
        base=grpc, model_id=MODEL_ID, flight=True)  # fmt: skip
    # The same HTTP loads from a server run with --sendfile on: the default (auto) copies
    # the file bytes for a loopback peer; which costs less depends on the host
    # (docs/performance.md, "sendfile or a copy").
    sendfile_url = getattr(args, "sendfile_http_url", None)
    if sendfile_url:
        add("ws_http_max_sendfile", "sendfile", "bench.weightserve_loads:max_load",
            base=sendfile_url, model_id=MODEL_ID)  # fmt: skip
        add("ws_http_fetch_sendfile", "sendfile", "bench.weightserve_loads:fetch_load",
            base=sendfile_url, model_id=MODEL_ID)  # fmt: skip
        add("ws_http_max_sendfile_conc4", "sendfile", "bench.weightserve_loads:max_load",
            n=4, base=sendfile_url, model_id=MODEL_ID)  # fmt: skip
    # The same node: the server's Unix socket, by zero-copy handoff and by an HTTP copy over it.
    unix = getattr(args, "unix_url", None)
    if unix:
        add("ws_node_handoff_max", "same_node", "bench.weightserve_loads:max_load",
            base=unix, model_id=MODEL_ID)  # fmt: skip
        add("ws_node_handoff_fetch", "same_node", "bench.weightserve_loads:fetch_load",
            base=unix, model_id=MODEL_ID)  # fmt: skip
        add("ws_node_uds_http_fetch", "same_node", "bench.weightserve_loads:fetch_load",
            base=unix, model_id=MODEL_ID, data_plane="http")  # fmt: skip
        add("ws_node_handoff_max_conc4", "same_node", "bench.weightserve_loads:max_load", n=4,
            sample=True, base=unix, model_id=MODEL_ID)  # fmt: skip
        add("pagecache_read_conc4", "same_node", "bench.ceilings:pagecache_read", n=4,
            path=path)  # fmt: skip
    names = ck.small_tensors()
    for t, base in (("http", http), ("grpc", grpc)):
        add(f"ws_{t}_small_latency", "small", "bench.weightserve_loads:small_requests",
            base=base, model_id=MODEL_ID, names=names, requests=args.small_requests)  # fmt: skip
        add(f"ws_{t}_small_conc8", "small", "bench.weightserve_loads:small_requests", n=8,
            base=base, model_id=MODEL_ID, names=names, requests=args.small_requests_conc)  # fmt: skip
    add("ws_grpc_small_latency_streamtensors", "small", "bench.weightserve_loads:small_requests",
        base=grpc, model_id=MODEL_ID, names=names, requests=args.small_requests, flight=False)  # fmt: skip
    # The floor: the same GETs from a raw socket, no client library (the server and loopback).
    add("ws_http_small_latency_rawsocket", "small", "bench.weightserve_loads:small_requests_raw_socket",
        base=http, model_id=MODEL_ID, names=names, requests=args.small_requests)  # fmt: skip
    if args.only:
        keep = set(args.only.split(","))
        out = [c for c in out if c.key in keep or c.group in keep]
    return out


def measure(c: Contender, pids: dict[str, int]) -> dict:
    """One round of one contender, with the CPU its server used meanwhile."""
    server = "raw" if c.key.startswith("raw_") else "ws" if c.key.startswith("ws_") else None
    server = "flight" if c.key.startswith("flight_") else server
    server = "ws_sendfile" if c.group == "sendfile" else server
    cpu0 = cpu_seconds(pids[server]) if server else None
    if c.sample_server:
        with MemorySampler(pids["ws"]) as mem:
            result = run_group(c.jobs)
        result["server_anon_before"] = mem.before
        result["server_anon_peak"] = mem.peak
        result["server_anon_growth"] = mem.peak - mem.before
    else:
        result = run_group(c.jobs)
    if server and cpu0:
        cpu1 = cpu_seconds(pids[server])
        result["server_cpu_user_s"] = cpu1[0] - cpu0[0]
        result["server_cpu_sys_s"] = cpu1[1] - cpu0[1]
    result["client_cpu_user_s"] = sum(w["cpu_user_s"] for w in result["results"])
    result["client_cpu_sys_s"] = sum(w["cpu_sys_s"] for w in result["results"])
    return result


def ratios_and_goals(results: dict[str, Any], ck: Checkpoint) -> None:
    c = results["contenders"]

    def best_of(clients: int, verifying: bool) -> tuple[str | None, float | None]:
        """The fastest raw row of ``clients`` processes that does (not) hash its bytes."""
        rows = {
            k: s
            for k, s in c.items()
            if k.startswith("raw_")
            and s["clients"] == clients
            and k.endswith("_xxh3") == verifying
            and ("_conc4" in k) == (clients == 4)
        }
        best = max(rows, key=lambda k: rows[k]["gbps"]) if rows else None
        return best, rows[best]["gbps"] if best else None

    best, ceiling = best_of(1, verifying=False)
    results["ceiling"] = {"key": best, "gbps": ceiling or float("nan")}
    best_v, verified = best_of(1, verifying=True)
    results["ceiling_verified"] = {"key": best_v, "gbps": verified}
    for s in c.values():
        if s["clients"] == 1 and "p50_ms" not in s:
            s["ratio_to_ceiling"] = s["gbps"] / ceiling if ceiling else float("nan")
            if verified:
                s["ratio_to_verified_ceiling"] = s["gbps"] / verified
    best4, conc_raw = best_of(4, verifying=False)
    results["ceiling_conc4"] = {"key": best4, "gbps": conc_raw}
    best4_v, conc_verified = best_of(4, verifying=True)
    results["ceiling_conc4_verified"] = {"key": best4_v, "gbps": conc_verified}
    for key, s in c.items():
        if "_conc4" in key:
            if conc_raw:
                s["ratio_to_raw_conc4"] = s["gbps"] / conc_raw
            if conc_verified:
                s["ratio_to_verified_conc4"] = s["gbps"] / conc_verified

    goals = []
    web = c.get("web_safetensors_load", {}).get("median_s")
    # A grpc:// URL takes bulk bytes over the plane the server advertises (HTTP off-node).
    for t, target in (("http", 0.8), ("grpc", 0.8)):
        # A goal is judged only where its ceiling ran (``--only`` may leave it out).
        s = c.get(f"ws_{t}_max")
        if s:
            if ceiling:
                goals.append(report.goal(f"whole model, MAX path, {t.upper()}: x raw-TCP ceiling",
                                         s["ratio_to_ceiling"], target))  # fmt: skip
            if "ratio_to_verified_ceiling" in s:
                goals.append(report.goal(
                    f"whole model, MAX path, {t.upper()}: x raw TCP + digest check ceiling",
                    s["ratio_to_verified_ceiling"], 0.9))  # fmt: skip
            if web:
                goals.append(report.goal(
                    f"whole model, MAX path, {t.upper()}: time / web-server+safetensors time",
                    s["median_s"] / web, 1.0, at_most=True))  # fmt: skip
        s = c.get(f"ws_{t}_fetch")
        if s and "ratio_to_verified_ceiling" in s:
            goals.append(report.goal(
                f"whole model, fetch, {t.upper()}: x raw TCP + digest check ceiling",
                s["ratio_to_verified_ceiling"], 0.9))  # fmt: skip
        s = c.get(f"ws_{t}_max_conc4")
        if s:
            if conc_raw:
                goals.append(report.goal(f"4 concurrent clients, {t.upper()}: x 4 raw-TCP streams",
                                         s["ratio_to_raw_conc4"], 0.8))  # fmt: skip
            if "ratio_to_verified_conc4" in s:
                goals.append(report.goal(
                    f"4 concurrent clients, {t.upper()}: x 4 raw streams + digest check",
                    s["ratio_to_verified_conc4"], 0.9))  # fmt: skip
    s = c.get("ws_flight_fetch_conc4")
    if s and conc_raw:
        goals.append(report.goal("4 concurrent clients, Arrow Flight: x 4 raw-TCP streams",
                                 s["ratio_to_raw_conc4"], 0.8))  # fmt: skip
    flight_min, flight_ws = c.get("flight_minimal"), c.get("ws_flight_fetch")
    if flight_min and flight_ws:
        flight_ws["ratio_to_flight_minimal"] = flight_ws["gbps"] / flight_min["gbps"]
        goals.append(report.goal("Flight protocol path: x minimal zero-copy Flight setup",
                                 flight_ws["ratio_to_flight_minimal"], 0.9))  # fmt: skip
    page = c.get("pagecache_read")
    for key in ("ws_node_handoff_max", "ws_node_handoff_fetch", "ws_node_uds_http_fetch"):
        s = c.get(key)
        if s and page:
            s["ratio_to_pagecache_read"] = s["gbps"] / page["gbps"]
    s, page4 = c.get("ws_node_handoff_max"), None
    if s and page:
        goals.append(report.goal("same node, zero-copy handoff, MAX path: x page-cache read",
                                 s["ratio_to_pagecache_read"], 0.9))  # fmt: skip
    s, page4 = c.get("ws_node_handoff_max_conc4"), c.get("pagecache_read_conc4")
    if s and page4:
        s["ratio_to_pagecache_read_conc4"] = s["gbps"] / page4["gbps"]
        goals.append(report.goal("4 concurrent clients, same-node handoff: x 4 page-cache reads",
                                 s["ratio_to_pagecache_read_conc4"], 0.8))  # fmt: skip
    whole_frac = ck.nbytes(ck.prefix) / ck.data_bytes
    for t in ("http", "grpc"):
        whole = c.get(f"ws_{t}_fetch")
        if not whole:
            continue
        p, sh = c.get(f"ws_{t}_prefix"), c.get(f"ws_{t}_shard")
        if p:
            p["time_fraction_of_whole"] = p["median_s"] / whole["median_s"]
            p["bytes_fraction_of_whole"] = whole_frac
            goals.append(report.goal(
                f"prefix ({whole_frac:.3f} of bytes), {t.upper()}: time / whole-model time",
                p["time_fraction_of_whole"], 2 * whole_frac, at_most=True))  # fmt: skip
        if sh:
            sh["time_fraction_of_whole"] = sh["median_s"] / whole["median_s"]
            goals.append(report.goal(f"1/4 shard, {t.upper()}: time / whole-model time",
                                     sh["time_fraction_of_whole"], 0.35, at_most=True))  # fmt: skip
    for key, s in c.items():  # every single-client load that keeps what it fetched
        kept = s["group"] in RSS_GROUPS and not key.endswith("_drain")  # drains keep nothing
        if key.startswith("ws_") and s["clients"] == 1 and kept:
            # Whole process: the interpreter and imports (MAX, pyarrow, grpc) count too...
            s["rss_over_bytes"] = s["peak_rss"] - s["bytes"]
            # ...load only: what the load added to the RSS it started from.
            s["load_rss_over_bytes"] = s["peak_rss"] - s["rss_before"] - s["bytes"]
    for key, what in RSS_GOALS:
        s = c.get(key)
        if s and "load_rss_over_bytes" in s:
            goals.append(report.goal(f"client peak RSS - RSS before the load - bytes, {what}",
                                     s["load_rss_over_bytes"] / MiB, 64, at_most=True, unit=" MiB"))  # fmt: skip
    for t in ("http", "grpc"):
        s = c.get(f"ws_{t}_max_conc4")
        if s:
            goals.append(report.goal(
                f"server RssAnon growth, 4 concurrent full loads, {t.upper()}",
                s["server_anon_growth"] / MiB, 64, at_most=True, unit=" MiB"))  # fmt: skip
    for t in ("http", "grpc"):
        s = c.get(f"ws_{t}_small_latency")
        if s:
            goals.append(report.goal(f"small tensor p50, {t.upper()}", s["p50_ms"], 0.4,
                                     at_most=True, unit=" ms"))  # fmt: skip
            goals.append(report.goal(f"small tensor p99, {t.upper()}", s["p99_ms"], 1.0,
                                     at_most=True, unit=" ms"))  # fmt: skip
    results["goals"] = goals


def warm_page_cache(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(16 << 20)
        while f.readinto(buf):
            pass


def _reported_mib(before: int | None) -> float | None:
    after = guest_memory.reported_kib()
    return None if before is None or after is None else round((after - before) / 1024, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--size-gib", type=float, default=2.0, help="checkpoint size (default 2)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 3; --quick: 1)")
    p.add_argument("--quick", action="store_true", help="tiny checkpoint, one round (CI)")
    p.add_argument("--small-requests", type=int, default=None,
                   help="sequential single-tensor requests per transport (default 2000)")  # fmt: skip
    p.add_argument("--small-requests-conc", type=int, default=None,
                   help="requests per client in the 8-client run (default 500)")  # fmt: skip
    p.add_argument("--only", help="comma-separated contender keys or groups to run")
    p.add_argument("--out", type=Path, default=RESULTS, help="JSON output path")
    p.add_argument("--nice", type=int, default=0,
                   help="renice the run (servers and clients inherit it); negative values "
                   "(root only) shield it from other work on a shared machine")  # fmt: skip
    p.add_argument("--hold-freed-memory", action="store_true",
                   help="on a VM with free page reporting, stop handing freed memory back to "
                   "the hypervisor during the run (root; bench/guest_memory.py)")  # fmt: skip
    p.add_argument("--profile", action="store_true",
                   help="instead: py-spy profiles of the whole-model HTTP and gRPC loads")  # fmt: skip
    args = p.parse_args(argv)
    if args.nice:
        os.nice(args.nice)
    if args.profile:
        from bench.profile import main as profile_main

        return profile_main(args)
    ck = quick() if args.quick else Checkpoint.for_size(args.size_gib)
    rounds = args.rounds or (1 if args.quick else 3)
    args.small_requests = args.small_requests or (50 if args.quick else 2000)
    args.small_requests_conc = args.small_requests_conc or (10 if args.quick else 500)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    ck.ensure(log)
    warm_page_cache(ck.path)
    started = time.time()
    load_before, ticks_before = os.getloadavg(), report.cpu_ticks()
    reported_before = guest_memory.reported_kib()
    hold = guest_memory.held(log) if args.hold_freed_memory else contextlib.nullcontext("default")
    with (
        hold as page_reporting,
        ServerProcess("bench.ceilings", str(ck.path)) as raw,
        ServerProcess("bench.flight_minimal", str(ck.path)) as flight_min,
        StaticServer(ck.path.parent.parent) as web,
        ServerProcess("bench.server", str(ck.root)) as ws,
        contextlib.ExitStack() as optional_servers,
    ):
        # The static server's root is .bench-cache/<tag>: the file is /bench-llama/model.safetensors
        http, grpc, ws_pid = ws.info["http_url"], ws.info["grpc_url"], ws.info["pid"]
        idle = proc_status(ws_pid)
        args.unix_url = ws.info.get("unix_url")
        pids = {"ws": ws_pid, "raw": raw.pid, "flight": flight_min.pid}
        asked = args.only.split(",") if args.only else []
        if not asked or any(
            k == "sendfile" or k.endswith(("_sendfile", "_sendfile_conc4")) for k in asked
        ):
            sending = optional_servers.enter_context(
                ServerProcess("bench.server", str(ck.root), "--sendfile=on")
            )
            args.sendfile_http_url = sending.info["http_url"]
            pids["ws_sendfile"] = sending.info["pid"]
        todo = contenders(ck, raw.info["port"], web.port, http, grpc, args, flight_min.info["port"])
        if args.unix_url and any(c.group == "same_node" for c in todo):
            # The handoff makes its sealed snapshot of the file once per file version: make it
            # now, so every round measures what each load after the node's first one costs
            # (the first load's cost: bench/handoff_snapshot.py).
            run_group([Job("bench.weightserve_loads:fetch_load",
                           {"base": args.unix_url, "model_id": MODEL_ID})])  # fmt: skip
        log(f"{len(todo)} contenders x {rounds} rounds; static server: {web.kind}")
        for r in range(rounds):
            for c in todo:
                t = time.monotonic()
                c.rounds.append(measure(c, pids))
                log(f"  round {r + 1}/{rounds} {c.key:<30} {time.monotonic() - t:6.2f} s wall")
        after = proc_status(ws_pid)
        web_kind = web.kind
    have_max = remote_weights_class() is not None
    results: dict[str, Any] = {
        "machine": report.machine(),
        "config": {
            "command": report.command("bench", argv),
            "rounds": rounds,
            "quick": args.quick,
            "small_requests": args.small_requests,
            "small_requests_conc_per_client": args.small_requests_conc,
            "static_server": web_kind,
            "max_path": "RemoteWeights" if have_max else "RemoteModel.fetch (RemoteWeights absent)",
            "http_client_connection": "kept-alive connections, pools of 8 (tensor streams: "
            "Http1Connection; TLS and JSON routes: http.client)",
            "grpc_bulk_data": "Arrow Flight endpoint (GetServerInfo); *_streamtensors: grpcio",
            "server": "separate process (bench.server): no GIL shared with any client",
            "wall_seconds": round(time.time() - started, 1),
            # Other work on the machine during the run (1-minute load average, before/after).
            "loadavg_1min": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
            "steal_fraction": report.steal_fraction(ticks_before),
            "nice": os.nice(0),
            # VM free page reporting: what the run did with it, and how much memory the
            # guest handed back to the hypervisor meanwhile (bench/guest_memory.py).
            "page_reporting": page_reporting,
            "reported_mib": _reported_mib(reported_before),
        },
        "checkpoint": {
            "tag": ck.tag,
            "file_bytes": ck.path.stat().st_size,
            "bytes": ck.data_bytes,
            "tensors": len(ck.tensors()),
            "hidden": ck.hidden,
            "layers": ck.layers,
            "prefix": ck.prefix,
            "prefix_bytes": ck.nbytes(ck.prefix),
            "small_tensor_bytes": 2 * ck.hidden,
        },
        "server_memory": {"idle": idle, "after": after},
        "contenders": {},
    }
    for c in todo:
        s = report.summarize(c.rounds)
        s["group"] = c.group
        s["raw_rounds"] = [
            {k: v for k, v in r.items() if k != "results"}
            | {"per_client_s": [w["t1"] - w["t0"] for w in r["results"]]}
            for r in c.rounds
        ]
        results["contenders"][c.key] = s
    ratios_and_goals(results, ck)
    write_json(args.out, results)
    print(report.table(results))
    report.print_saved(args.out, REPO)
    return 0


if __name__ == "__main__":
    sys.exit(main())
