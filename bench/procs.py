"""Processes: servers in their own process, clients in fresh worker processes.

Every measured load runs in a fresh ``python -m bench.worker`` process, so its peak RSS
(``ru_maxrss``) is that load's alone, its buffers are freshly allocated (page faults
included, as for every contender), and no client shares a GIL with a server or with another
client. A worker imports and prepares, prints ``BENCH-READY``, waits for ``go`` on stdin,
then times only the load. A group of N workers is released together; the group's time is
from the first start to the last end (CLOCK_MONOTONIC is system-wide on Linux).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.checkpoint import REPO

READY = "BENCH-READY"
RESULT = "BENCH-RESULT "
TIMEOUT = 900.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(first: list[str] | None = None) -> dict[str, str]:
    """This environment with the repository (after ``first``) on PYTHONPATH."""
    e = dict(os.environ)
    path = [*(first or []), str(REPO), e.get("PYTHONPATH")]
    e["PYTHONPATH"] = os.pathsep.join(filter(None, path))
    e.setdefault("PYTHONUNBUFFERED", "1")
    return e


class ServerProcess:
    """``python -m MODULE ARGS...`` that prints ``BENCH-READY {json}`` once serving and
    exits when its stdin closes (or on SIGTERM). ``pythonpath`` goes before the repository
    on its PYTHONPATH (an A/B run's other tree)."""

    def __init__(self, module: str, *args: str, pythonpath: list[str] | None = None) -> None:
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=REPO,
            env=env(pythonpath),
        )
        self.info: dict = {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                break
            if line.startswith(READY):
                self.info = json.loads(line[len(READY) :] or "{}")
                return
        self.log.seek(0)
        why = self.log.read()[-4000:]  # before stop() closes the log
        self.stop()
        raise RuntimeError(f"{module} did not start:\n{why}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(timeout=20)
            except (subprocess.TimeoutExpired, OSError):
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
        self.log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_until_stdin_closes(info: dict) -> None:
    """For server modules: announce readiness, then block until the parent lets go."""
    print(READY + json.dumps(info), flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        sys.stdin.read()


def listen_threaded(port: int, handle) -> socket.socket:
    """A loopback listener on ``port`` (0: any) serving each connection on its own thread
    with ``handle(conn)``; the accept loop ends when the listener is closed."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return listener


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds a process has used, all its threads together."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def proc_status(pid: int) -> dict[str, int]:
    """RssAnon / RssFile / VmRSS of a process, in bytes."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


class MemorySampler:
    """Samples a process's RssAnon every ``interval`` seconds while running."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.pid, self.interval = pid, interval
        self.before = proc_status(pid)["RssAnon"]
        self.peak = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, proc_status(self.pid)["RssAnon"])
            except (FileNotFoundError, KeyError):
                return
            self._stop.wait(self.interval)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.after = proc_status(self.pid)["RssAnon"]


@dataclass
class Job:
    """One worker: ``bench.worker`` runs ``fn(**kwargs)`` to prepare, then the returned
    callable when released."""

    fn: str  # "module:function"
    kwargs: dict = field(default_factory=dict)
    pythonpath: list[str] | None = None  # before the repository's (an A/B run's other client)


class Workers:
    """Worker processes, started and prepared; ``release()`` starts the timed loads."""

    def __init__(self, jobs: list[Job]) -> None:
        self.procs: list[subprocess.Popen] = []
        self.logs = []
        try:
            for job in jobs:
                log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in close()
                self.logs.append(log)
                spec = json.dumps({"fn": job.fn, "kwargs": job.kwargs})
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "bench.worker", spec],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=log,
                        text=True,
                        cwd=REPO,
                        env=env(job.pythonpath),
                    )
                )
            for p, log in zip(self.procs, self.logs, strict=True):
                _expect(p, READY, log)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def release(self) -> None:
        for p in self.procs:
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]

    def collect(self, timeout: float = TIMEOUT) -> dict:
        """Each worker's result; ``seconds`` from the first start to the last end."""
        results = []
        for p, log in zip(self.procs, self.logs, strict=True):
            line = _expect(p, RESULT, log)
            results.append(json.loads(line[len(RESULT) :]))
            p.wait(timeout=timeout)
        start = min(r["t0"] for r in results)
        end = max(r["t1"] for r in results)
        return {
            "seconds": end - start,
            "bytes": sum(r.get("bytes", 0) for r in results),
            "results": results,
        }

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in self.logs:
            log.close()


def run_group(jobs: list[Job], timeout: float = TIMEOUT) -> dict:
    """Start the workers, release them together, gather their results.

    Returns ``{"seconds": first start to last end, "bytes": sum, "results": [...]}``.
    """
    workers = Workers(jobs)
    try:
        workers.release()
        return workers.collect(timeout)
    finally:
        workers.close()


def _expect(p: subprocess.Popen, marker: str, log) -> str:
    while True:
        line = p.stdout.readline()  # type: ignore[union-attr]
        if not line:
            p.wait()
            log.seek(0)
            raise RuntimeError(
                f"bench worker exited ({p.returncode}) before {marker.strip()}:\n"
                f"{log.read()[-6000:]}"
            )
        if line.startswith(marker):
            return line.rstrip("\n")


def write_json_atomically(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
