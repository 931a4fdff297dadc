"""``python -m bench --profile [--size-gib N]``: where the whole-model load spends its time.

For each transport (HTTP, gRPC) one MAX-path load (``RemoteWeights(url)``, ``data()`` of
every ``items()`` entry), then 1,000 sequential single-tensor requests, run in a worker
process while ``py-spy record`` samples both the
server process and the client process, without pausing them (``--nonblocking``: Python
frames only). ``BENCH_PROFILE_NATIVE=1`` adds C frames (``--native``), which needs py-spy
to pause the process for every sample and slows the load down 2-3x, so use it for
attribution only, never for timing. py-spy
must be installed (``pip install py-spy``) and allowed to ptrace (root, or
``kernel.yama.ptrace_scope`` 0).

Written: collapsed stacks under ``.bench-cache/profiles/`` (load them in speedscope or
flamegraph.pl) and a text summary, ``bench/results/profile.txt``: per process, the CPU
seconds used (user/system, from /proc), the top functions by self time and by inclusive
time, as fractions of the samples.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.checkpoint import CACHE, MODEL_ID, REPO, RESULTS_DIR, Checkpoint, quick
from bench.procs import Job, ServerProcess, Workers, cpu_seconds

OUT = CACHE / "profiles"
SUMMARY = RESULTS_DIR / "profile.txt"
_LINE = re.compile(r":\d+\)$")


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.access(found, os.X_OK):
        raise SystemExit("py-spy is not installed: pip install py-spy")
    return found


RATE = 200  # samples per second


def record(pid: int, out: Path, native: bool, idle: bool) -> subprocess.Popen:
    cmd = [py_spy(), "record", "--pid", str(pid), "--rate", str(RATE), "--format", "raw"]
    cmd += ["--output", str(out), "--threads"]
    if idle:
        cmd.append("--idle")
    # --native needs the blocking mode (py-spy pauses the process for each sample)
    cmd.append("--native" if native else "--nonblocking")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


_ADDRESS = re.compile(r"^0x[0-9a-f]+ \((.*)\)$")


def _frame(frame: str) -> str:
    """``func (/abs/path/file.py:123)`` -> ``func (file.py)``; unnamed native frames ->
    ``[library]``: aggregate over lines and addresses."""
    frame = _LINE.sub(")", frame.strip())
    frame = re.sub(r"\(/.*?/((site-packages|lib/python3\.\d+)/)?", "(", frame)
    m = _ADDRESS.match(frame)
    return f"[{m.group(1)}]" if m else frame


def load_stacks(path: Path) -> list[tuple[str, list[str], int]]:
    """(thread name, frames root first, samples) per line of py-spy's raw output."""
    out: list[tuple[str, list[str], int]] = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = "?"
        if frames and frames[0].startswith("process "):
            frames = frames[1:]
        if frames and frames[0].startswith("thread "):
            thread = frames[0].split(":", 1)[-1].strip()
            frames = frames[1:]
        out.append((re.sub(r"[_-]?\d+$", "", thread), [_frame(f) for f in frames], int(count)))
    return out


def summarize(stacks, title: str, cpu: tuple[float, float], seconds: float) -> str:
    self_time: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    total = 0
    for thread, frames, n in stacks:
        total += n
        threads[thread] += n
        if frames:
            self_time[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    lines = [
        f"== {title}: {seconds:.2f} s wall; CPU {cpu[0]:.2f} s user + {cpu[1]:.2f} s system",
        f"   {total} samples at {RATE}/s = {total / RATE:.2f} thread-seconds: "
        + ", ".join(f"{t} {n / RATE:.2f} s" for t, n in threads.most_common(6)),
        "   top self time (% of samples):",
    ]
    for f, n in self_time.most_common(16):
        lines.append(f"   {100 * n / max(total, 1):5.1f}%  {f}")
    lines.append("   top inclusive time:")
    for f, n in inclusive.most_common(30):
        lines.append(f"   {100 * n / max(total, 1):5.1f}%  {f}")
    return "\n".join(lines)


def _client_load(thread: str, frames: list[str]) -> bool:
    """Samples of the load: every thread but the main thread outside the timed ``run``
    (waiting for "go", or exiting). Other threads (gRPC's channel thread, the fetch
    threads) exist only around the load."""
    return thread != "MainThread" or any(".<locals>.run" in f for f in frames)


def profile_one(
    transport: str, base: str, server_pid: int, native: bool, small: list[str] | None = None
) -> str:
    """One profiled load: the whole model (MAX path), or with ``small`` 1,000 sequential
    single-tensor requests for those names."""
    OUT.mkdir(parents=True, exist_ok=True)
    if small:
        kwargs = {"base": base, "model_id": MODEL_ID, "names": small, "requests": 1000}
        job = Job("bench.weightserve_loads:small_requests", kwargs)
        what = "small"
    else:
        job = Job("bench.weightserve_loads:max_load", {"base": base, "model_id": MODEL_ID})
        what = "whole"
    workers = Workers([job])
    server_out = OUT / f"{transport}-{what}-server.txt"
    client_out = OUT / f"{transport}-{what}-client.txt"
    try:
        client_pid = workers.pids[0]
        # server: active samples only (its idle threads would drown the rest); client: idle
        # samples too, limited to the load's threads, so waiting on the socket shows
        spies = [
            record(server_pid, server_out, native, idle=False),
            record(client_pid, client_out, native, idle=True),
        ]
        time.sleep(1.0)  # let py-spy attach
        s0 = cpu_seconds(server_pid)
        workers.release()
        result = workers.collect()
        s1 = cpu_seconds(server_pid)
        c_user = sum(r["cpu_user_s"] for r in result["results"])
        c_sys = sum(r["cpu_sys_s"] for r in result["results"])
        spies[0].send_signal(signal.SIGINT)
        for spy in spies:
            try:
                _, err = spy.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                spy.kill()
                err = "timed out"
            if spy.returncode not in (0, None) or "Error" in err:
                print(f"py-spy: {err.strip()[-2000:]}", file=sys.stderr)
    finally:
        workers.close()
    seconds = result["seconds"]
    gib = result["bytes"] / (1 << 30)
    if small:
        r = result["results"][0]
        head = (
            f"### {transport.upper()}: {r['requests']} sequential single-tensor requests "
            f"in {seconds:.2f} s (p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms)"
        )
    else:
        head = (
            f"### {transport.upper()}: MAX-path whole-model load, {gib:.2f} GiB in "
            f"{seconds:.2f} s ({result['bytes'] / seconds / 1e9:.2f} GB/s)"
        )
    return "\n".join(
        [
            head,
            summarize(
                load_stacks(server_out),
                "server (active samples)",
                (s1[0] - s0[0], s1[1] - s0[1]),
                seconds,
            ),
            summarize(
                [s for s in load_stacks(client_out) if _client_load(s[0], s[1])],
                "client (idle samples included)",
                (c_user, c_sys),
                seconds,
            ),
        ]
    )


def main(args: argparse.Namespace) -> int:
    ck = quick() if args.quick else Checkpoint.for_size(args.size_gib)
    ck.ensure(lambda m: print(m, file=sys.stderr))
    with open(ck.path, "rb", buffering=0) as f:  # page cache warm, as in the benchmark
        buf = bytearray(16 << 20)
        while f.readinto(buf):
            pass
    native = bool(os.environ.get("BENCH_PROFILE_NATIVE"))
    parts = []
    with ServerProcess("bench.server", str(ck.root)) as ws:
        for small in (None, ck.small_tensors()):
            for transport in ("http", "grpc"):
                base = ws.info["http_url" if transport == "http" else "grpc_url"]
                parts.append(profile_one(transport, base, ws.info["pid"], native, small))
    text = "\n\n".join(parts) + "\n"
    SUMMARY.parent.mkdir(parents=True, exist_ok=True)
    SUMMARY.write_text(text)
    print(text)
    print(f"collapsed stacks: {OUT.relative_to(REPO)}/; summary: {SUMMARY.relative_to(REPO)}")
    return 0
