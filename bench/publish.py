"""Publishing: how fast a revision goes into a server, and how soon its watchers hear of it:
``python -m bench.publish --size-mib 512 --rounds 5 --watchers 32``.

- ``raw_tcp_upload``: the same bytes sent over one loopback TCP connection to a process that
  only receives them (what the network alone allows, measured in the same run);
- ``raw_tcp_upload_durable``: the same, the receiver writing them to a file in the server's
  file system in blocks of 8 MiB and syncing it before it answers: what any publisher that
  keeps the bytes it acknowledges must do at least, so the ceiling ``ws_publish`` is held
  against (the disk, not the network, sets it on most machines);
- ``ws_publish``: ``Client.publish`` of float32 tensors of that size to a weightserve server
  process, from the first byte to the new revision returned: upload streamed to disk, strict
  readers, content digest, rename and ``refs/main`` included. Each round changes one element,
  so each is a new revision (``--keep-revisions`` removes the old ones);
- ``notify``: from ``publish`` returning to each of ``--watchers`` watchers (threads of one
  other process, ``RemoteModel.watch``) seeing the revision: p50, p99 and the slowest, over
  small publishes. CLOCK_MONOTONIC is one clock for every process of the machine.

``--against REF`` also runs REF's server (its client/ and service/ exported as ``python -m
bench --against`` does; this tree's client) and publishes to both in every round, in an order
that flips each round: ``ws_publish_ref`` and the per-round ratio this/REF.

Results go to ``bench/results/publish.json``; the figures are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
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

from bench import ab, report
from bench.checkpoint import REPO, RESULTS_DIR
from bench.procs import ServerProcess, env, listen_threaded, serve_until_stdin_closes
from bench.procs import write_json_atomically as write_json

RESULTS = RESULTS_DIR / "publish.json"
MODEL = "bench/published"
BLOCK = 8 << 20


# -- the raw ceiling: a process that receives and discards ------------------------------------


def _sink_one(conn: socket.socket) -> None:
    """One upload: a header line ``BYTES [DIRECTORY]``, then the bytes; with a directory
    they are written to a new file there (``os.write`` of each 8 MiB block as it fills) and
    synced before the answer; the file is removed after it."""
    with conn:
        header = b""
        while not header.endswith(b"\n"):
            header += conn.recv(1)
        size, _, directory = header.decode().strip().partition(" ")
        left = int(size)
        buffer = bytearray(BLOCK)
        view = memoryview(buffer)
        fd, path = tempfile.mkstemp(dir=directory, prefix="raw-upload-") if directory else (-1, "")
        try:
            while left:
                filled = 0
                while filled < BLOCK and left:
                    n = conn.recv_into(view[filled : filled + min(BLOCK - filled, left)])
                    if not n:
                        return
                    filled += n
                    left -= n
                block = view[:filled]
                while fd >= 0 and block:
                    block = block[os.write(fd, block) :]
            if fd >= 0:
                os.fsync(fd)
            conn.sendall(b"ok\n")
        finally:
            if fd >= 0:
                os.close(fd)
                os.unlink(path)


def sink() -> None:
    listener = listen_threaded(0, _sink_one)
    serve_until_stdin_closes({"port": listener.getsockname()[1]})


def raw_upload(port: int, payload: memoryview, durable_in: str | None = None) -> float:
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(f"{payload.nbytes} {durable_in or ''}\n".encode())
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
    p.add_argument("--against", metavar="REF", help="also publish to REF's server each round")
    p.add_argument(
        "--root",
        metavar="DIR",
        help="where the servers keep revisions and the durable ceiling writes (default: the "
        "temporary directory; a tmpfs such as /dev/shm takes the disk out of every row)",
    )
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
    measured: dict[str, list[dict]] = {
        "raw_tcp_upload": [],
        "raw_tcp_upload_durable": [],
        "ws_publish": [],
    }
    ratios: list[float] = []  # per round, this / REF
    latencies: list[float] = []
    slowest: list[float] = []
    started = time.time()
    with contextlib.ExitStack() as stack:
        root = stack.enter_context(tempfile.TemporaryDirectory(prefix="ws-publish-", dir=args.root))
        receiver = stack.enter_context(ServerProcess("bench.publish", "--sink"))
        server = stack.enter_context(ServerProcess("bench.server", root))
        client = stack.enter_context(Client(server.info["http_url"]))
        ref_client = None
        if args.against:
            commit = ab.resolve(args.against)
            exported = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ws-ref-")))
            ref_root = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="ws-publish-ref-", dir=args.root)
            )
            ref_server = stack.enter_context(
                ServerProcess(
                    "bench.server", ref_root,
                    pythonpath=[str(ab.export_tree(commit, exported))],
                )
            )  # fmt: skip
            ref_client = stack.enter_context(Client(ref_server.info["http_url"]))
            measured["ws_publish_ref"] = []
        publishers = [("ws_publish", client)]
        if ref_client is not None:
            publishers.append(("ws_publish_ref", ref_client))
        for _, c in publishers:
            c.publish(MODEL, tensors)  # the model exists before the watchers start
        for r in range(args.rounds):
            raw_seconds = raw_upload(receiver.info["port"], payload)
            measured["raw_tcp_upload"].append({"seconds": raw_seconds, "bytes": payload.nbytes})
            durable_seconds = raw_upload(receiver.info["port"], payload, durable_in=root)
            measured["raw_tcp_upload_durable"].append(
                {"seconds": durable_seconds, "bytes": payload.nbytes}
            )
            tensors["layers.0.weight"][0] = r + 1.0  # a new revision each round
            this_round: dict[str, float] = {}
            for key, c in publishers if r % 2 == 0 else publishers[::-1]:
                t0 = time.perf_counter()
                c.publish(MODEL, tensors, message=f"round {r}")
                this_round[key] = time.perf_counter() - t0
                measured[key].append({"seconds": this_round[key], "bytes": payload.nbytes})
            if "ws_publish_ref" in this_round:
                ratios.append(this_round["ws_publish_ref"] / this_round["ws_publish"])
            log(
                f"  round {r + 1}/{args.rounds}: raw {raw_seconds:.3f} s, raw to disk "
                f"{durable_seconds:.3f} s, "
                + ", ".join(f"{k} {v:.3f} s" for k, v in this_round.items())
            )
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
    for key in ("ws_publish", "ws_publish_ref"):
        if key in summary:
            for ceiling, name in (
                ("raw_tcp_upload", "raw_tcp"),
                ("raw_tcp_upload_durable", "raw_tcp_durable"),
            ):
                per_round = [
                    c["seconds"] / w["seconds"]
                    for c, w in zip(measured[ceiling], measured[key], strict=True)
                ]
                summary[key][f"ratio_to_{name}"] = statistics.median(per_round)
    if ratios:
        summary["ws_publish"]["ratio_to_ref"] = statistics.median(ratios)
        summary["ws_publish"]["ratio_to_ref_range"] = [min(ratios), max(ratios)]
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
            "against": args.against,
            "root": args.root,
            "wall_seconds": round(time.time() - started, 1),
        },
        "contenders": summary,
        "notify": notify,
    }
    write_json(RESULTS, results)
    for key, s in summary.items():
        print(f"{key:<16} median {s['median_s']:.3f} s  {s['gbps']:.2f} GB/s")
    for key in ("ws_publish", "ws_publish_ref"):
        if key in summary:
            print(
                f"{key} x raw_tcp_upload: {summary[key]['ratio_to_raw_tcp']:.2f}, x "
                f"raw_tcp_upload_durable: {summary[key]['ratio_to_raw_tcp_durable']:.2f} "
                "(per-round medians)"
            )
    if ratios:
        low, high = summary["ws_publish"]["ratio_to_ref_range"]
        print(
            f"ws_publish / ws_publish_ref (GB/s, per round): median "
            f"{summary['ws_publish']['ratio_to_ref']:.2f} [{low:.2f}-{high:.2f}]"
        )
    print(
        f"notify ({args.watchers} watchers): p50 {notify['p50_ms']:.1f} ms, p99 "
        f"{notify['p99_ms']:.1f} ms, all watchers told: median "
        f"{notify['all_watchers_median_ms']:.1f} ms, max {notify['all_watchers_max_ms']:.1f} ms"
    )
    report.print_saved(RESULTS, Path(REPO))
    return 0


if __name__ == "__main__":
    sys.exit(main())
