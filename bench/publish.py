"""Publishing: how fast a revision goes into a server, and how soon its watchers hear of it:
``python -m bench.publish --size-mib 512 --rounds 5 --watchers 32``.

- ``raw_tcp_upload``: the same bytes sent over one loopback TCP connection to a process that
  only receives them (the ceiling, measured in the same run);
- ``ws_publish``: ``Client.publish`` of float32 tensors of that size to a weightserve server
  process, from the first byte to the new revision returned: upload streamed to disk, strict
  readers, content digest, rename and ``refs/main`` included. Each round changes one element,
  so each is a new revision (``--keep-revisions`` removes the old ones);
- ``notify``: from ``publish`` returning to each of ``--watchers`` watchers (threads of one
  other process, ``RemoteModel.watch``) seeing the revision: p50, p99 and the slowest, over
  small publishes. CLOCK_MONOTONIC is one clock for every process of the machine.

Results go to ``bench/results/publish.json``; the figures are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import report
from bench.checkpoint import REPO, RESULTS_DIR
from bench.procs import ServerProcess, env, listen_threaded, serve_until_stdin_closes
from bench.procs import write_json_atomically as write_json

RESULTS = RESULTS_DIR / "publish.json"
MODEL = "bench/published"
BLOCK = 8 << 20


# -- the raw ceiling: a process that receives and discards ------------------------------------


def _sink_one(conn: socket.socket) -> None:
    with conn:
        header = b""
        while not header.endswith(b"\n"):
            header += conn.recv(1)
        left = int(header)
        buffer = bytearray(BLOCK)
        view = memoryview(buffer)
        while left:
            n = conn.recv_into(view[: min(BLOCK, left)])
            if not n:
                return
            left -= n
        conn.sendall(b"ok\n")


def sink() -> None:
    listener = listen_threaded(0, _sink_one)
    serve_until_stdin_closes({"port": listener.getsockname()[1]})


def raw_upload(port: int, payload: memoryview) -> float:
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(f"{payload.nbytes}\n".encode())
        for start in range(0, payload.nbytes, BLOCK):
            conn.sendall(payload[start : start + BLOCK])
        assert conn.recv(3) == b"ok\n"
    return time.perf_counter() - started


# -- watchers: one process, many threads ------------------------------------------------------


def watchers(url: str, count: int) -> None:
    from weightserve.client import Client

    out = threading.Lock()

    def follow(i: int) -> None:
        with Client(url) as c:
            for rev in c.model(MODEL).watch():
                seen = time.monotonic()
                with out:
                    print(json.dumps({"watcher": i, "commit": rev.commit, "at": seen}), flush=True)

    for i in range(count):
        threading.Thread(target=follow, args=(i,), daemon=True).start()
    time.sleep(2.0)  # every watch stream open
    serve_until_stdin_closes({"watchers": count})


# -- the run ---------------------------------------------------------------------------------


def _summary(rounds: list[dict]) -> dict[str, Any]:
    rates = [r["bytes"] / r["seconds"] for r in rounds]
    return {
        "rounds": len(rounds),
        "median_s": statistics.median(r["seconds"] for r in rounds),
        "gbps": statistics.median(rates) / 1e9,
        "gbps_min": min(rates) / 1e9,
        "gbps_max": max(rates) / 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.publish", description=__doc__)
    p.add_argument("--size-mib", type=int, default=512, help="bytes per publish (default 512)")
    p.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    p.add_argument("--watchers", type=int, default=32, help="watchers (default 32)")
    p.add_argument("--notifications", type=int, default=20, help="small publishes (default 20)")
    p.add_argument("--quick", action="store_true", help="16 MiB, 2 rounds, 4 watchers")
    p.add_argument("--sink", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--watch", nargs=2, metavar=("URL", "N"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.sink:
        sink()
        return 0
    if args.watch:
        watchers(args.watch[0], int(args.watch[1]))
        return 0
    if args.quick:
        args.size_mib, args.rounds, args.watchers, args.notifications = 16, 2, 4, 5

    from weightserve.client import Client

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    tensors = {
        f"layers.{i}.weight": np.random.default_rng(i).standard_normal(
            (args.size_mib << 20) // 8 // 4, dtype=np.float32
        )
        for i in range(8)
    }
    payload = memoryview(np.concatenate(list(tensors.values())).view(np.uint8))
    measured: dict[str, list[dict]] = {"raw_tcp_upload": [], "ws_publish": []}
    latencies: list[float] = []
    slowest: list[float] = []
    started = time.time()
    with (
        tempfile.TemporaryDirectory(prefix="ws-publish-") as root,
        ServerProcess("bench.publish", "--sink") as receiver,
        ServerProcess("bench.server", root) as server,
        Client(server.info["http_url"]) as client,
    ):
        client.publish(MODEL, tensors)  # the model exists before the watchers start
        for r in range(args.rounds):
            raw_seconds = raw_upload(receiver.info["port"], payload)
            measured["raw_tcp_upload"].append({"seconds": raw_seconds, "bytes": payload.nbytes})
            tensors["layers.0.weight"][0] = r + 1.0  # a new revision each round
            t0 = time.perf_counter()
            client.publish(MODEL, tensors, message=f"round {r}")
            seconds = time.perf_counter() - t0
            measured["ws_publish"].append({"seconds": seconds, "bytes": payload.nbytes})
            log(f"  round {r + 1}/{args.rounds}: raw {raw_seconds:.3f} s, publish {seconds:.3f} s")
        small = {"w": np.zeros(1024, np.float32)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.publish", "--watch", server.info["http_url"],
             str(args.watchers)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env(),
        )  # fmt: skip
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().startswith("BENCH-READY")
        for n in range(args.notifications):
            small["w"][0] = n
            commit = client.publish(MODEL, small).commit
            returned = time.monotonic()
            times = []
            while len(times) < args.watchers:
                event = json.loads(proc.stdout.readline())
                if event["commit"] == commit:
                    times.append(event["at"] - returned)
            latencies.extend(times)
            slowest.append(max(times))
        proc.stdin.close()
        proc.wait(timeout=20)
    summary: dict[str, Any] = {k: _summary(v) for k, v in measured.items()}
    raw = summary["raw_tcp_upload"]["gbps"]
    summary["ws_publish"]["ratio_to_raw_tcp"] = summary["ws_publish"]["gbps"] / raw
    ordered = sorted(latencies)
    notify = {
        "watchers": args.watchers,
        "publishes": args.notifications,
        "p50_ms": 1000 * ordered[len(ordered) // 2],
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
        "all_watchers_median_ms": 1000 * sorted(slowest)[len(slowest) // 2],
        "all_watchers_max_ms": 1000 * max(slowest),
    }
    results = {
        "machine": report.machine(),
        "config": {
            "command": report.command("bench.publish", argv),
            "rounds": args.rounds,
            "bytes": payload.nbytes,
            "wall_seconds": round(time.time() - started, 1),
        },
        "contenders": summary,
        "notify": notify,
    }
    write_json(RESULTS, results)
    for key, s in summary.items():
        print(f"{key:<16} median {s['median_s']:.3f} s  {s['gbps']:.2f} GB/s")
    print(f"ws_publish / raw_tcp_upload: {summary['ws_publish']['ratio_to_raw_tcp']:.2f}")
    print(
        f"notify ({args.watchers} watchers): p50 {notify['p50_ms']:.1f} ms, p99 "
        f"{notify['p99_ms']:.1f} ms, all watchers told: median "
        f"{notify['all_watchers_median_ms']:.1f} ms, max {notify['all_watchers_max_ms']:.1f} ms"
    )
    report.print_saved(RESULTS, Path(REPO))
    return 0


if __name__ == "__main__":
    sys.exit(main())
