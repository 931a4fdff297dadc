"""The alternative users pick today: the checkpoint file on a plain static web server.

nginx (Debian's package: ``apt-get install -y nginx``) serves the model directory with
``sendfile on``, one worker per core, access log off, run in the foreground from a config
written to a temporary directory. Without nginx on PATH the bench falls back to
``python -m bench.webserver DIR``: a threaded HTTP/1.1 server written here that answers
``GET /FILE`` with ``os.sendfile`` (no user-space copy, so it is as fast as nginx for one big
file; python's ``http.server`` copies through Python and would be an unfair stand-in). The
JSON and the table say which one ran (``BENCH_NO_NGINX=1`` forces the fallback).

The client downloads the file with ``http.client`` (``read()`` of the whole body into one
``bytes``, as ``urllib``/``requests`` users do) and loads it with ``safetensors.torch.load``
(bytes in memory -> tensors, which copies every tensor once more). ``web_download`` times the
download alone into a fresh buffer (``readinto``), to separate the server from the load.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.procs import free_port, listen_threaded, serve_until_stdin_closes

NGINX_CONF = """\
{user}
worker_processes {workers};
daemon off;
master_process on;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_timeout 65;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    default_type application/octet-stream;
    server {{
        listen 127.0.0.1:{port};
        root {root};
    }}
}}
"""


def nginx_binary() -> str | None:
    if os.environ.get("BENCH_NO_NGINX"):  # force the fallback server
        return None
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


class StaticServer:
    """nginx, or the fallback sendfile server, serving ``root`` on a loopback port."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.kind = "nginx"
        self._tmp = tempfile.TemporaryDirectory(prefix="bench-web-")
        self._log = open(os.path.join(self._tmp.name, "stderr.log"), "w+")  # noqa: SIM115
        binary = nginx_binary()
        if binary is not None:
            version = subprocess.run([binary, "-v"], capture_output=True, text=True).stderr
            self.kind = version.strip().split(":")[-1].strip() or "nginx"
            conf = os.path.join(self._tmp.name, "nginx.conf")
            with open(conf, "w") as f:
                f.write(
                    NGINX_CONF.format(
                        user="user root;" if os.geteuid() == 0 else "",
                        workers=os.cpu_count() or 1,
                        prefix=self._tmp.name,
                        port=self.port,
                        root=root,
                    )
                )
            cmd = [binary, "-c", conf, "-p", self._tmp.name]
        else:
            self.kind = "bench.webserver (threaded sendfile; nginx not installed)"
            cmd = [sys.executable, "-m", "bench.webserver", str(root), str(self.port)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=self._log
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"static web server ({self.kind}) did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # nginx: fast shutdown; fallback: exits
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self._tmp.cleanup()

    def __enter__(self) -> StaticServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- the fallback server ---------------------------------------------------------------------


def _handle(conn: socket.socket, root: str) -> None:
    with conn:
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                got = conn.recv(65536)
                if not got:
                    return
                buf += got
            head, _, buf = buf.partition(b"\r\n\r\n")
            method, target, _ = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
            path = os.path.realpath(os.path.join(root, target.lstrip("/")))
            if method != "GET" or not path.startswith(root) or not os.path.isfile(path):
                conn.sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                continue
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
                    b"content-length: %d\r\n\r\n" % size
                )
                at = 0
                while at < size:
                    n = os.sendfile(conn.fileno(), f.fileno(), at, size - at)
                    if not n:
                        return
                    at += n


def serve(root: str, port: int) -> None:
    root = os.path.realpath(root)
    listen_threaded(port, lambda conn: _handle(conn, root))
    serve_until_stdin_closes({"port": port})


# -- client side (run inside bench.worker) ---------------------------------------------------


def web_load(port: int, file: str):
    """Download with http.client and load with ``safetensors.torch.load``."""
    import http.client

    import safetensors.torch

    def run():
        conn = http.client.HTTPConnection("127.0.0.1", port)
        conn.request("GET", "/" + file)
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}")
        data = resp.read()
        conn.close()
        tensors = safetensors.torch.load(data)
        del data
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        return {"bytes": total}, tensors

    return run


def web_download(port: int, file: str):
    """Download only: the body ``readinto`` one fresh buffer (no safetensors parsing)."""
    import http.client

    import numpy as np

    def run():
        conn = http.client.HTTPConnection("127.0.0.1", port)
        conn.request("GET", "/" + file)
        resp = conn.getresponse()
        size = int(resp.getheader("content-length"))
        buf = np.empty(size, dtype=np.uint8)
        view = memoryview(buf)
        at = 0
        while at < size:
            n = resp.readinto(view[at:])
            if not n:
                raise EOFError("short body")
            at += n
        conn.close()
        return {"bytes": size}, buf

    return run


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
