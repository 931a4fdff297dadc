"""The ``weightserve`` command in subprocesses, as a user runs it: a clean environment, a
server started on ports 0 and its printed URLs, one-shot commands, a free port."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_SCRIPT = Path(sys.executable).with_name("weightserve")

WEIGHTSERVE = (
    [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "weightserve.client._cli"]
)

START_TIMEOUT = 90.0

# Every listener on a port the OS picks: tests never collide with each other or the defaults.
ANY_PORTS = ["--http-port", "0", "--grpc-port", "0", "--flight-port", "0"]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any WEIGHTSERVE_* setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSERVE_")}
    env["PYTHONUNBUFFERED"] = "1"
    # A node cache's peer port is fixed by default (6881); tests run several nodes at once.
    env["WEIGHTSERVE_PEER_PORT"] = "0"
    env.update(extra)
    return env


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*WEIGHTSERVE, *args],
        capture_output=True,
        text=True,
        env=env if env is not None else clean_env(),
        timeout=timeout,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM, then SIGKILL if it has not ended within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class Served:
    proc: subprocess.Popen
    lines: list[str]  # stdout up to and including "ready"
    http: str  # http://host:port
    grpc: str  # grpc://host:port
    stderr: Path
    _lines: queue.Queue[str | None]

    def more_output(self, timeout: float = 10) -> list[str]:
        """The stdout lines after "ready", up to the end of the output (call after exit)."""
        rest = []
        while (line := self._lines.get(timeout=timeout)) is not None:
            rest.append(line)
        return rest

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)


def start_server(args: list[str], env: dict[str, str], log_dir: Path) -> Served:
    """Start ``weightserve serve ARGS``; wait for "ready"; parse the URLs it printed."""
    stderr = log_dir / f"serve-{time.monotonic_ns()}.log"
    with open(stderr, "wb") as err:
        proc = subprocess.Popen(
            [*WEIGHTSERVE, "serve", *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
    lines_q: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        with proc.stdout:  # closed at the end of the output, which only this thread reads
            for line in proc.stdout:
                lines_q.put(line.rstrip("\n"))
        lines_q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    lines: list[str] = []
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            line = lines_q.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()
            raise AssertionError(f"no 'ready' in {START_TIMEOUT} s; got {lines}") from None
        if line is None:
            proc.wait(timeout=10)
            raise AssertionError(
                f"server exited {proc.returncode} before 'ready': {lines}\n{stderr.read_text()}"
            )
        lines.append(line)
        if line == "ready":
            break
    text = "\n".join(lines)
    http_m = re.search(r"^\s*HTTP\s+(http://\S+?)/v1/models\b", text, re.M)
    grpc_m = re.search(r"^\s*gRPC\s+(grpc://\S+)\s*$", text, re.M)
    assert http_m and grpc_m, text
    return Served(proc, lines, http_m.group(1), grpc_m.group(1), stderr, lines_q)
