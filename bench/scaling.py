"""``python -m bench.scaling``: how the one-process server's bulk path grows with concurrent
clients and cores, against raw streams, and how much of its CPU holds the GIL
(docs/performance.md, "Scaling with cores").

One server (``bench.ab_server``; ``--tree REF``: REF's) and the raw loopback sender
(``bench.ceilings``) on one checkpoint. Per number of clients N, alternating rounds of N HTTP
drains (``bench.weightserve_loads.drain``) and N raw streams of the file (``raw_drain``, the
same reader; the sender's ``mmap`` and ``sendfile`` modes): GB/s, HTTP over the better raw mode,
each sender's CPU-s/GiB from ``/proc``. Then as many HTTP rounds under ``perf record -g``:
samples inside system calls CPython makes with the GIL released (``RELEASED``) ran without it,
``futex`` ones waited for it, the rest held it; the held share times CPU-s/GiB is GIL-held
s/GiB, whose inverse is one lock's ceiling. ``--chunk-mib`` repeats the largest point with
bigger chunks, ``--server-cpus`` with both senders pinned. Results: ``bench/results/``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import report
from bench.ab import export_tree, resolve
from bench.ceilings import wait_for
from bench.checkpoint import MODEL_ID, REPO, RESULTS_DIR, Checkpoint
from bench.procs import Job, ServerProcess, Workers, cpu_seconds
from bench.procs import write_json_atomically as write_json
from bench.run import warm_page_cache

RESULTS = RESULTS_DIR / "scaling.json"
GiB = 1 << 30
SCRATCH = 16 << 20
RAW_MODES = ("mmap", "sendfile")
# System calls CPython makes with the GIL released, that the bulk path spends its time in.
RELEASED = {
    "writev", "sendfile64", "sendfile", "poll", "ppoll", "epoll_wait", "epoll_pwait",
    "epoll_pwait2", "select", "pselect6", "sendto", "sendmsg", "recvfrom", "recvmsg",
    "read", "write", "pread64", "accept4", "connect", "nanosleep", "clock_nanosleep",
    "fstat", "fstatat64", "newfstatat", "fcntl", "fcntl64",
}  # fmt: skip
# One frame of ``perf script -F ip,sym,dso``: "ffffffff8200ec5b tcp_sendmsg+0x1b ([kernel...])".
_FRAME = re.compile(r"^[0-9a-f]+ (\S+?)(?:\+0x[0-9a-f]+)? \((.*)\)$")


# -- client side (run inside bench.worker) ---------------------------------------------------


def raw_drain(port: int, size: int, mode: str):
    """The whole file from the raw sender on one connection, read into a reused buffer and
    dropped: the raw twin of ``bench.weightserve_loads.drain``, waking as the client's
    large reads do (``SO_RCVLOWAT``, client/transports/http1.py)."""
    scratch = memoryview(bytearray(SCRATCH))

    def run():
        total = 0
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(f"{mode} 0 {size}\n".encode())
            mark = 1
            while True:
                mark = wait_for(s, size - total, mark)
                n = s.recv_into(scratch)
                if not n:
                    break
                total += n
        if total != size:
            raise ConnectionError(f"raw stream ended at {total} of {size}")
        return {"bytes": total}, None

    return run


# -- the driver ------------------------------------------------------------------------------


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` (and so what they start) onto ``cpus``: ``taskset -a -p``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):  # a thread ended
            os.sched_setaffinity(int(tid), cpus)


def run_point(jobs: list[Job], sender: int, clients_on: set[int] | None) -> dict:
    """One group of clients released together, with the sender's CPU meanwhile."""
    workers = Workers(jobs)
    try:
        if clients_on is not None:
            for pid in workers.pids:
                pin(pid, clients_on)
        cpu0 = cpu_seconds(sender)
        workers.release()
        result = workers.collect()
        cpu1 = cpu_seconds(sender)
    finally:
        workers.close()
    result["server_cpu_user_s"] = cpu1[0] - cpu0[0]
    result["server_cpu_sys_s"] = cpu1[1] - cpu0[1]
    result["client_cpu_user_s"] = sum(w["cpu_user_s"] for w in result["results"])
    result["client_cpu_sys_s"] = sum(w["cpu_sys_s"] for w in result["results"])
    return result


class Perf:
    """``perf record -g`` of one process while inside, its samples classified on leaving."""

    def __init__(self, pid: int, out: Path, frequency: int) -> None:
        self.pid, self.out, self.frequency = pid, out, frequency
        self.counts: collections.Counter[str] = collections.Counter()
        self.error: str | None = None

    def __enter__(self) -> Perf:
        cmd = ["perf", "record", "-e", "cpu-clock", "-F", str(self.frequency), "-g"]
        cmd += ["-p", str(self.pid), "-o", str(self.out)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.5)  # attached to every thread before the load starts
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=60)
        if not self.out.exists():  # (its exit status after SIGINT varies by version)
            raise RuntimeError(
                f"perf record failed ({self.proc.returncode}): {err.decode()[-2000:]}"
            )
        script = subprocess.run(
            ["perf", "script", "-i", str(self.out), "-F", "ip,sym,dso"],
            capture_output=True,
            text=True,
        )
        if script.returncode != 0:  # e.g. a load too short for any sample: none counted
            self.error = script.stderr.strip()[-500:]
            return
        for sample in script.stdout.split("\n\n"):
            if sample.strip():
                self.counts[classify(sample)] += 1

    def shares(self) -> dict[str, Any]:
        total = sum(self.counts.values())
        held = sum(n for k, n in self.counts.items() if k.startswith("held"))
        waits = self.counts.get("gil_wait", 0)
        return {
            "samples": total,
            "perf_script_error": self.error,
            "held_share": held / total if total else float("nan"),
            "gil_wait_share": waits / total if total else float("nan"),
            "by_kind": {k: round(n / total, 4) for k, n in self.counts.most_common(12)},
        }


def perf_usable() -> bool:
    """Whether ``perf record`` may sample here (installed; root or a permissive
    ``kernel.perf_event_paranoid``)."""
    if shutil.which("perf") is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        probe = ["perf", "record", "-q", "-e", "cpu-clock", "-o", f"{tmp}/probe", "--", "true"]
        return subprocess.run(probe, capture_output=True).returncode == 0


def classify(sample: str) -> str:
    """``released:SYSCALL``, ``gil_wait`` or ``held:WHAT`` for one ``perf script`` sample
    (``-F ip,sym,dso``, innermost frame first)."""
    frames = [_FRAME.match(line.strip()) for line in sample.strip().split("\n")]
    syms = [(f.group(1), f.group(2)) for f in frames if f]
    if not syms:
        return "held:unknown"
    at = next((i for i, (sym, _) in enumerate(syms) if sym == "do_syscall_64"), None)
    if at is not None:
        # The call, as the kernel names it (the frame under the entry: do_writev,
        # __x64_sys_sendfile64) and as libc does (the first user frame: __GI___writev).
        names = [syms[at - 1][0]] if at else []
        names += [sym for sym, dso in syms[at + 1 :] if "kernel" not in dso][:1]
        calls = {_syscall_name(n) for n in names}
        if any("futex" in n or "pthread_cond" in n or "lll_lock" in n for n in calls):
            return "gil_wait"
        released = sorted(calls & RELEASED)
        return f"released:{released[0]}" if released else f"held:sys_{_syscall_name(names[-1])}"
    if any(sym == "asm_exc_page_fault" for sym, _ in syms):
        return "held:page_fault"
    sym, dso = syms[0]
    return "held:kernel" if "kernel" in dso else f"held:user:{os.path.basename(dso)}"


def _syscall_name(sym: str) -> str:
    name = sym.split("@", 1)[0].lstrip("_")  # clock_nanosleep@GLIBC_2.2.5
    for prefix in ("x64_sys_", "ia32_sys_", "do_sys_", "se_sys_", "ksys_", "do_", "GI___",
                   "GI_", "libc_"):  # fmt: skip
        if name.startswith(prefix):
            name = name[len(prefix) :].lstrip("_")
    return name.removesuffix("_adjusted").removesuffix("_nocancel")


def points(
    size: int, raw_port: int, drain: Job, clients: list[int], rounds: int, pids: dict,
    clients_on: set[int] | None, log,
) -> dict[str, Any]:  # fmt: skip
    """Per number of clients, ``rounds`` alternating rounds of the raw modes and HTTP."""
    out: dict[str, Any] = {}
    for n in clients:
        jobs = {f"raw_{m}": [Job("bench.scaling:raw_drain",
                                 {"port": raw_port, "size": size, "mode": m})] * n
                for m in RAW_MODES}  # fmt: skip
        jobs["http"] = [drain] * n
        measured: dict[str, list[dict]] = {k: [] for k in jobs}
        for r in range(rounds):
            for key, group in jobs.items():
                sender = pids["raw"] if key.startswith("raw") else pids["ws"]
                measured[key].append(run_point(group, sender, clients_on))
                s = measured[key][-1]
                log(f"  {n} clients, round {r + 1}/{rounds} {key:<12} "
                    f"{s['bytes'] / s['seconds'] / 1e9:6.2f} GB/s")  # fmt: skip
        point = {key: summary(m) for key, m in measured.items()}
        raw = max(point[f"raw_{m}"]["gbps"] for m in RAW_MODES)
        point["ratio_to_raw"] = point["http"]["gbps"] / raw
        point["ratio_to_raw_mmap"] = point["http"]["gbps"] / point["raw_mmap"]["gbps"]
        out[str(n)] = point
    return out


def summary(rounds: list[dict]) -> dict[str, Any]:
    s = report.summarize(rounds)
    keep = ("gbps", "gbps_min", "gbps_max", "median_s", "bytes", "clients")
    out = {k: s[k] for k in keep}
    out["server_cpu_user_s_per_gib"] = s["server_cpu_user_s_per_gib"]
    out["server_cpu_sys_s_per_gib"] = s["server_cpu_sys_s_per_gib"]
    out["server_cpu_s_per_gib"] = out["server_cpu_user_s_per_gib"] + s["server_cpu_sys_s_per_gib"]
    out["client_cpu_s_per_gib"] = s["client_cpu_user_s_per_gib"] + s["client_cpu_sys_s_per_gib"]
    # How busy the sender was: its CPU seconds per second of the load (cores in use).
    out["server_cores_busy"] = statistics.median(
        (r["server_cpu_user_s"] + r["server_cpu_sys_s"]) / r["seconds"] for r in rounds
    )
    return out


def gil(
    drain: Job, clients: list[int], rounds: int, ws_pid: int, timed: dict, frequency: int, log
) -> dict[str, Any]:
    """Per point, ``rounds`` more HTTP rounds under perf: the GIL-held share of the server's
    CPU, and with the timed rounds' CPU-s/GiB, GIL-held seconds per GiB and the ceiling they
    set."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ws-perf-") as tmp:
        for n in clients:
            with Perf(ws_pid, Path(tmp) / f"{n}.data", frequency) as perf:
                perf_rounds = [run_point([drain] * n, ws_pid, None) for _ in range(rounds)]
            s = perf.shares()
            cpu_per_gib = timed[str(n)]["http"]["server_cpu_s_per_gib"]
            wall_per_gib = timed[str(n)]["http"]["median_s"] / (
                timed[str(n)]["http"]["bytes"] / GiB
            )
            held = s["held_share"] * cpu_per_gib
            s |= {
                "perf_round_gbps": statistics.median(
                    r["bytes"] / r["seconds"] / 1e9 for r in perf_rounds
                ),
                "held_s_per_gib": held,
                # The share of the load's wall time the GIL was held: 1 is saturation.
                "held_share_of_wall": held / wall_per_gib,
                "ceiling_gib_per_s": 1 / held if held else float("inf"),
            }
            out[str(n)] = s
            log(f"  perf, {n} clients: GIL held in {s['held_share']:.0%} of server samples, "
                f"{held:.3f} s/GiB, ceiling {s['ceiling_gib_per_s']:.1f} GiB/s")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__)
    p.add_argument("--size-gib", type=float, default=0.5, help="checkpoint size (default 0.5)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per point (default 3)")
    p.add_argument("--clients", default="1,2,4,8", help="concurrent clients per point")
    p.add_argument("--server-cpus", default="",
                   help="also pin both senders to the first K CPUs, for each K listed "
                   "(e.g. 1,2), the clients on the other CPUs where any are left")  # fmt: skip
    p.add_argument("--pinned-clients", default="4", help="clients per pinned point")
    p.add_argument("--chunk-mib", default="16",
                   help="also the largest point with the stream in chunks of these MiB")  # fmt: skip
    p.add_argument("--perf-frequency", type=int, default=2999, help="perf samples/s per CPU")
    p.add_argument("--no-perf", action="store_true", help="skip the GIL measurement")
    p.add_argument("--tree", help="measure this commit's server and client, not the working tree")
    p.add_argument("--out", type=Path, default=RESULTS, help="JSON output path")
    args = p.parse_args(argv)
    clients = [int(x) for x in args.clients.split(",")]
    use_perf = not args.no_perf and perf_usable()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    ck = Checkpoint.for_size(args.size_gib)
    ck.ensure(log)
    warm_page_cache(ck.path)
    size = ck.path.stat().st_size
    started, load_before = time.time(), os.getloadavg()
    every_cpu = os.sched_getaffinity(0)
    results: dict[str, Any] = {"machine": report.machine()}
    with contextlib.ExitStack() as stack:
        # --tree REF: REF's server and client (its client/ and service/ exported as bench.ab
        # does), so a measurement can name a commit while the working tree is being edited.
        tree = [str(export_tree(resolve(args.tree), Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="ws-tree-")))))] if args.tree else None  # fmt: skip
        raw = stack.enter_context(ServerProcess("bench.ceilings", str(ck.path)))
        ws = stack.enter_context(ServerProcess("bench.ab_server", str(ck.root), pythonpath=tree))
        pids = {"raw": raw.pid, "ws": ws.info["pid"]}

        def drain(chunk_mib: int | None = None) -> Job:
            chunk = chunk_mib << 20 if chunk_mib else None
            kwargs = {"base": ws.info["http_url"], "model_id": MODEL_ID, "chunk_bytes": chunk}
            return Job("bench.weightserve_loads:drain", kwargs, pythonpath=tree)

        # One load first: the server maps the file and learns its chunks' digests once.
        run_point([drain()], pids["ws"], None)
        log(f"unpinned: {len(every_cpu)} CPUs shared by the senders and the clients")
        port = raw.info["port"]
        results["points"] = points(size, port, drain(), clients, args.rounds, pids, None, log)
        if use_perf:
            results["gil"] = gil(drain(), clients, args.rounds, pids["ws"], results["points"],
                                 args.perf_frequency, log)  # fmt: skip
        # Fewer Python steps per GiB: the same streams in larger chunks (the client's
        # chunk_bytes), at the largest number of clients.
        results["chunks"] = {}
        for mib in [int(x) for x in args.chunk_mib.split(",") if x]:
            log(f"chunks of {mib} MiB")
            n = [clients[-1]]
            timed = points(size, port, drain(mib), n, args.rounds, pids, None, log)
            results["chunks"][str(mib)] = {"points": timed}
            if use_perf:
                results["chunks"][str(mib)]["gil"] = gil(
                    drain(mib), n, args.rounds, pids["ws"], timed, args.perf_frequency, log
                )
        pinned: dict[str, Any] = {}
        cpus = sorted(every_cpu)
        for k in [int(x) for x in args.server_cpus.split(",") if x]:
            mine = set(cpus[:k])
            rest = set(cpus[k:]) or None
            for pid in pids.values():
                pin(pid, mine)
            log(f"senders on {k} CPU(s), clients on {len(rest) if rest else 'all the'} others")
            n = [int(x) for x in args.pinned_clients.split(",")]
            pinned[str(k)] = {
                "server_cpus": sorted(mine),
                "client_cpus": sorted(rest or every_cpu),
                "points": points(size, port, drain(), n, args.rounds, pids, rest, log),
            }
        for pid in pids.values():
            pin(pid, every_cpu)
        results["pinned"] = pinned
        # Which package the server imported: REF's export or this repository's (no paths).
        results["server_imported"] = "REF's export" if tree else "this repository"
        if tree and not ws.info["service_dir"].startswith(tree[0]):
            raise RuntimeError(f"the server imported {ws.info['service_dir']}, not REF's tree")
    results["config"] = {
        "command": report.command("bench.scaling", argv),
        "rounds": args.rounds,
        "tree": resolve(args.tree) if args.tree else "working tree",
        "client": "drain: one stream of the whole model into a reused 16 MiB buffer",
        "raw": "bench.ceilings sender, one connection per client, the same reader",
        "gil": "perf record -g, cpu-clock" if use_perf else "not measured (no usable perf)",
        "wall_seconds": round(time.time() - started, 1),
        "loadavg_1min": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    }
    results["checkpoint"] = {"tag": ck.tag, "file_bytes": ck.path.stat().st_size}
    write_json(args.out, results)
    print(table(results))
    report.print_saved(args.out, REPO)
    return 0


def table(results: dict[str, Any]) -> str:
    lines = [
        f"{'clients':>7} {'HTTP GB/s':>10} {'raw GB/s':>9} {'ratio':>6} "
        f"{'srv u+s s/GiB':>14} {'raw u+s s/GiB':>14} {'GIL held':>9} {'GIL s/GiB':>10}"
    ]

    def rows(pts: dict[str, Any], gil: dict[str, Any], label: str = "") -> None:
        for n, pt in pts.items():
            h = pt["http"]
            best = max((pt[f"raw_{m}"] for m in RAW_MODES), key=lambda s: s["gbps"])
            g = gil.get(n, {})
            lines.append(
                f"{label + n:>7} {h['gbps']:>10.2f} {best['gbps']:>9.2f} {pt['ratio_to_raw']:>6.2f} "
                f"{h['server_cpu_user_s_per_gib']:>6.2f}+{h['server_cpu_sys_s_per_gib']:<7.2f} "
                f"{best['server_cpu_user_s_per_gib']:>6.2f}+{best['server_cpu_sys_s_per_gib']:<7.2f} "
                + (f"{g['held_share']:>9.0%} {g['held_s_per_gib']:>10.3f}" if g else "")
            )

    rows(results["points"], results.get("gil", {}))
    for mib, c in results.get("chunks", {}).items():
        lines.append(f"chunks of {mib} MiB:")
        rows(c["points"], c.get("gil", {}))
    for k, p in results.get("pinned", {}).items():
        lines.append(f"senders on {k} CPU(s):")
        rows(p["points"], {})
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
