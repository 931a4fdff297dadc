"""A bounded soak: one server process under steady mixed load, checked for errors and leaks.

    python bench/soak.py --seconds 60

Starts ``weightserve serve`` in its own process on loopback (ports chosen by the OS) over a
temporary model root with two models:

- ``small``: 256 tensors of 1 KiB to 64 KiB, fetched a few at a time by several threads;
- ``big``: 8 tensors of 8 MiB (64 MiB), fetched whole by several concurrent threads.

Each thread alternates HTTP and gRPC and compares every received tensor with the bytes
written (the client also checks every chunk's digest). The server's anonymous memory
(``RssAnon`` in /proc/PID/status) is read after a warm-up fetch of each model on both
transports (``start``), once the load has run for a quarter of the time, at most 10 s
(``before``: the allocator has reached its working set under this concurrency), sampled
during the run (``peak``) and read at the end (``after``). One JSON object goes to stdout:
requests, bytes, errors, these figures, open streams after the run.

Exit status 1 when any request failed, a stream was left open, the server died, or anonymous
memory grew from ``before`` to ``after`` by more than ``--max-growth-mib`` (64 MiB by
default): growth under a steady load is a leak, while the step from ``start`` to ``before`` is
the allocator keeping freed buffers of concurrent streams (reported, not judged; see
docs/security.md). ``--server-env NAME=VALUE`` sets the server's environment only (e.g.
``MALLOC_MMAP_THRESHOLD_=1048576``). Everything is bounded: ``--seconds`` of load, client
timeouts on every request, a fixed number of threads.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import xxhash
from safetensors.numpy import save_file

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere; the package may be editable
    sys.path.insert(0, str(REPO))

from weightserve.client._client import Client, FetchOptions  # noqa: E402

MIB = 1 << 20
SERVE = "import sys; from weightserve.client._cli import main; sys.exit(main())"


def log(quiet: bool, *parts: object) -> None:
    if not quiet:
        print(*parts, file=sys.stderr, flush=True)


def write_root(root: Path) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    small = {
        f"layer.{i:03d}.w": rng.standard_normal(int(rng.integers(256, 16 << 10))).astype(np.float32)
        for i in range(256)
    }
    big = {f"block.{i}": rng.integers(0, 256, 8 * MIB, dtype=np.uint8) for i in range(8)}
    for name, arrays in (("small", small), ("big", big)):
        (root / name).mkdir(parents=True)
        save_file(arrays, root / name / "model.safetensors")
    return {"small": small, "big": big}


def rss_anon_kib(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^RssAnon:\s+(\d+) kB", text, re.M)
    if match is None:
        raise RuntimeError("no RssAnon in /proc/PID/status (Linux only)")
    return int(match.group(1))


class Server:
    def __init__(self, root: Path, workdir: Path, extra_env: dict[str, str]) -> None:
        self.log_path = workdir / "server.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra_env}
        env.pop("WEIGHTSERVE_TOKEN", None)
        self.log_file = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                SERVE,
                "serve",
                str(root),
                "--host",
                "127.0.0.1",
                "--http-port",
                "0",
                "--grpc-port",
                "0",
                "--flight-port",  # any free port too: a fixed one collides with other servers
                "0",
                "--grace",
                "5",
                "--log-level",
                "warning",
            ],
            stdout=subprocess.PIPE,
            stderr=self.log_file,
            env=env,
            cwd=REPO,
        )
        self.http_url = self.grpc_url = ""
        deadline = time.monotonic() + 60
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:  # the CLI prints its URLs, then "ready"
            line = raw.decode(errors="replace").strip()
            if m := re.match(r"HTTP\s+(\S+)/v1/models", line):
                self.http_url = m.group(1)
            elif m := re.match(r"gRPC\s+(\S+)", line):
                self.grpc_url = m.group(1)
            elif line == "ready":
                break
            if time.monotonic() > deadline:
                break
        if not (self.http_url and self.grpc_url) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"server did not start:\n{self.log_path.read_text()[-3000:]}")
        # Nothing more is printed until shutdown; drain stdout so the pipe never fills.
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def metric(self, name: str) -> float:
        host, port = self.http_url.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")
        )

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log_file.close()
        return self.proc.returncode


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.small_requests = 0
        self.full_model_streams = 0
        self.bytes = 0
        self.errors = 0
        self.samples: list[str] = []

    def ok(self, kind: str, nbytes: int) -> None:
        with self.lock:
            if kind == "small":
                self.small_requests += 1
            else:
                self.full_model_streams += 1
            self.bytes += nbytes

    def error(self, what: str) -> None:
        with self.lock:
            self.errors += 1
            if len(self.samples) < 10:
                self.samples.append(what[:300])


def small_worker(server: Server, expected: dict, deadline: float, tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    names = list(expected)
    clients = [Client(server.http_url, timeout=30), Client(server.grpc_url, timeout=30)]
    try:
        models = [c.model("small") for c in clients]
        i = 0
        while time.monotonic() < deadline:
            model = models[i % 2]
            i += 1
            wanted = rng.sample(names, rng.randint(1, 8))
            try:
                got = model.fetch(wanted)
                nbytes = 0
                for n in wanted:
                    if got[n].tobytes() != expected[n].tobytes():
                        raise AssertionError(f"tensor {n} differs")
                    nbytes += got[n].nbytes
                tally.ok("small", nbytes)
            except Exception as e:  # every failure counts; the soak goes on
                tally.error(f"small via {model.client.address.url}: {type(e).__name__}: {e}")
    finally:
        for c in clients:
            c.close()


def stream_worker(server: Server, digests: dict, deadline: float, tally: Tally, seed: int) -> None:
    clients = [Client(server.http_url, timeout=60), Client(server.grpc_url, timeout=60)]
    try:
        models = [c.model("big", FetchOptions(parallel=2)) for c in clients]
        i = seed
        while time.monotonic() < deadline:
            model = models[i % 2]
            i += 1
            try:
                got = model.fetch(prefix="")
                for n, digest in digests.items():
                    if xxhash.xxh3_64_intdigest(got[n]) != digest:
                        raise AssertionError(f"tensor {n} differs")
                tally.ok("big", sum(a.nbytes for a in got.values()))
                del got
            except Exception as e:
                tally.error(f"stream via {model.client.address.url}: {type(e).__name__}: {e}")
    finally:
        for c in clients:
            c.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="load duration (default 60)")
    parser.add_argument("--small-threads", type=int, default=4, help="small-tensor threads")
    parser.add_argument("--stream-threads", type=int, default=3, help="full-model threads")
    parser.add_argument("--max-growth-mib", type=float, default=64.0)
    parser.add_argument("--json-only", action="store_true", help="no progress on stderr")
    parser.add_argument(
        "--server-env", action="append", default=[], metavar="NAME=VALUE",
        help="environment for the server process only (repeatable)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    quiet = args.json_only
    if not 0 < args.seconds <= 3600:
        parser.error("--seconds must be in (0, 3600]")
    try:
        server_env = dict(item.split("=", 1) for item in args.server_env)
    except ValueError:
        parser.error("--server-env takes NAME=VALUE")

    with tempfile.TemporaryDirectory(prefix="weightserve-soak-") as tmp:
        workdir = Path(tmp)
        expected = write_root(workdir / "root")
        digests = {n: xxhash.xxh3_64_intdigest(a) for n, a in expected["big"].items()}
        server = Server(workdir / "root", workdir, server_env)
        try:
            log(quiet, f"server pid {server.pid}: {server.http_url} {server.grpc_url}")
            for url in (server.http_url, server.grpc_url):  # warm-up: mappings, pools, arenas
                with Client(url, timeout=60) as c:
                    c.model("big").fetch(prefix="")
                    c.model("small").fetch(prefix="")
            time.sleep(0.5)
            start = rss_anon_kib(server.pid)
            before, peak = None, start
            tally = Tally()
            started = time.monotonic()
            deadline = started + args.seconds
            baseline_at = started + min(10.0, args.seconds / 4)
            threads = [
                threading.Thread(
                    target=small_worker,
                    args=(server, expected["small"], deadline, tally, i),
                    daemon=True,
                )
                for i in range(args.small_threads)
            ] + [
                threading.Thread(
                    target=stream_worker, args=(server, digests, deadline, tally, i), daemon=True
                )
                for i in range(args.stream_threads)
            ]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                time.sleep(0.25)
                with contextlib.suppress(OSError, RuntimeError):
                    now = rss_anon_kib(server.pid)
                    peak = max(peak, now)
                    if before is None and time.monotonic() >= baseline_at:
                        before = now
                if time.monotonic() > deadline + 120:
                    tally.error("workers did not finish within 120 s of the deadline")
                    break
                log(
                    quiet,
                    f"{time.monotonic() - started:5.1f} s: {tally.small_requests} small, "
                    f"{tally.full_model_streams} full-model, {tally.errors} errors, "
                    f"RssAnon {peak / 1024:.0f} MiB peak",
                )
            elapsed = time.monotonic() - started
            time.sleep(0.5)  # let the last streams' buffers go
            after = rss_anon_kib(server.pid)
            before = after if before is None else before
            open_streams = server.metric("weightserve_open_streams")
            alive = server.proc.poll() is None
        finally:
            exit_code = server.stop()
        growth_mib = (after - before) / 1024
        figures = {
            "seconds": round(elapsed, 1),
            "requests": tally.small_requests + tally.full_model_streams,
            "small_requests": tally.small_requests,
            "full_model_streams": tally.full_model_streams,
            "bytes": tally.bytes,
            "mib_per_second": round(tally.bytes / MIB / elapsed, 1),
            "errors": tally.errors,
            "error_samples": tally.samples,
            "rss_anon_start_kib": start,
            "rss_anon_before_kib": before,
            "rss_anon_after_kib": after,
            "rss_anon_peak_kib": peak,
            "rss_anon_growth_mib": round(growth_mib, 1),
            "rss_anon_warmup_step_mib": round((before - start) / 1024, 1),
            "server_env": server_env,
            "open_streams_after": int(open_streams),
            "server_alive_at_end": alive,
            "server_exit_code": exit_code,
            "threads": {"small": args.small_threads, "full_model": args.stream_threads},
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        }
        print(json.dumps(figures), flush=True)
        failed = (
            tally.errors > 0 or open_streams != 0 or not alive or growth_mib > args.max_growth_mib
        )
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
