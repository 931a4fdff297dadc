"""Test hosts in network namespaces on this machine (root, iproute2's ``ip`` and ``tc``): a
switch (a bridge in a namespace of its own) and hosts on it, each host's link shaped with a
token bucket both ways, so a cluster's traffic crosses links of a real rate and never leaves
the machine.

    with Hosts(rate_mbit=200) as hosts:
        upstream = hosts.add("up")                     # 10.77.0.2
        server = hosts.serve("up", [ROOT, "--host", upstream])
        hosts.tx_bytes("up")                           # bytes its link sent
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

_SCRIPT = Path(sys.executable).with_name("weightserve")
WEIGHTSERVE = (
    [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "weightserve.client._cli"]
)


def missing() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: iproute2)"
    probe = f"ws-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout


@dataclass
class Server:
    """A ``weightserve serve`` in a namespace, and the URL it printed."""

    proc: subprocess.Popen
    http: str
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Hosts:
    """Hosts ``10.77.N.2`` ... on one switch; ``rate_mbit`` shapes every link (None: not)."""

    rate_mbit: float | None = None
    subnet: str = "10.77.0"
    tag: str = field(default_factory=lambda: f"ws{os.getpid() % 100000}")
    _names: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (namespace, ip)
    _procs: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.switch = f"{self.tag}-sw"
        _run("ip", "netns", "add", self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")

    def add(self, name: str, rate_mbit: float | None = None) -> str:
        """A host on the switch; its address. ``rate_mbit``: its link's rate, else the
        default."""
        index = len(self._names) + 2
        namespace, address = f"{self.tag}-{name}", f"{self.subnet}.{index}"
        host_end, switch_end = f"{self.tag}h{index}", f"{self.tag}s{index}"
        _run("ip", "netns", "add", namespace)
        self._names[name] = (namespace, address)
        _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", switch_end)
        _run("ip", "link", "set", host_end, "netns", namespace)
        _run("ip", "link", "set", switch_end, "netns", self.switch)
        _run("ip", "-n", namespace, "link", "set", host_end, "name", "eth0")
        _run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
        _run("ip", "-n", namespace, "link", "set", "eth0", "up")
        _run("ip", "-n", namespace, "link", "set", "lo", "up")
        _run("ip", "-n", self.switch, "link", "set", switch_end, "master", "br0")
        _run("ip", "-n", self.switch, "link", "set", switch_end, "up")
        rate = rate_mbit if rate_mbit is not None else self.rate_mbit
        if rate:
            # Egress of each end: the host's upload, and (the switch's end) its download.
            for ns, dev in ((namespace, "eth0"), (self.switch, switch_end)):
                _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
                     "rate", f"{rate}mbit", "burst", "256kb", "latency", "100ms")  # fmt: skip
        return address

    def address(self, name: str) -> str:
        return self._names[name][1]

    def popen(self, name: str, argv: list[str], **kwargs: object) -> subprocess.Popen:
        """``argv`` run in the host's namespace."""
        proc = subprocess.Popen(["ip", "netns", "exec", self._names[name][0], *argv], **kwargs)  # type: ignore[call-overload]
        self._procs.append(proc)
        return proc

    def serve(self, name: str, args: list[str], log_dir: Path, env: dict[str, str]) -> Server:
        """``weightserve serve ARGS`` on the host; returns once it printed "ready"."""
        log = log_dir / f"serve-{name}.log"
        with open(log, "wb") as err:
            proc = self.popen(
                name, [*WEIGHTSERVE, "serve", *args],
                stdout=subprocess.PIPE, stderr=err, text=True, env=env,
            )  # fmt: skip
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert proc.stdout is not None
            with proc.stdout:
                for line in proc.stdout:
                    lines.put(line.rstrip("\n"))
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        seen: list[str] = []
        deadline = time.monotonic() + 90
        while (line := lines.get(timeout=max(0.1, deadline - time.monotonic()))) != "ready":
            if line is None:
                raise RuntimeError(f"the server on {name} exited: {log.read_text()[-3000:]}")
            seen.append(line)
        found = re.search(r"^\s*HTTP\s+(http://\S+?)/v1/models\b", "\n".join(seen), re.M)
        if not found:
            raise RuntimeError(f"no HTTP URL in {seen}")
        return Server(proc, found.group(1), log)

    def tx_bytes(self, name: str) -> int:
        """Bytes the host's link has sent so far."""
        out = _run("ip", "-n", self._names[name][0], "-j", "-s", "link", "show", "dev", "eth0")
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for namespace, _ in self._names.values():
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.switch], capture_output=True)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
