"""A server killed (SIGKILL) while clients wait and restarted 2 s later on the same ports: loads,
metadata calls and pulls, through the library, ``weightserve pull`` and a Hub client, wait it
out within the retry budget and end with the right bytes. A TLS port spoken to in plain HTTP
still gets the TLS hint, which a dead server no longer does.
"""

from __future__ import annotations

import hashlib
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.support.commands import Served, clean_env, free_port, run_cli, start_server
from tests.support.security import Certs, certs, mtls_server, root, tls_server  # noqa: F401 - fixtures
from weightserve.client._client import Client
from weightserve.client.errors import TransportError
from weightserve.client.transports.base import TLSOptions
from weightserve.service.server import ServerConfig, WeightServer

MODEL = "org/m"
TENSORS = {f"t{i}": np.arange(i, i + (1 << 19), dtype=np.float32) for i in range(6)}  # 12 MiB
DOWN_SECONDS = 2.0


class RestartingServer:
    """``weightserve serve ROOT`` on fixed ports, killed and started again on the same ports."""

    def __init__(self, model_root: Path, log_dir: Path) -> None:
        self.ports = [free_port(), free_port(), free_port()]
        self.args = [
            str(model_root),
            "--http-port", str(self.ports[0]),
            "--grpc-port", str(self.ports[1]),
            "--flight-port", str(self.ports[2]),
            "--no-watch",
        ]  # fmt: skip
        self.log_dir = log_dir
        self.served: Served = start_server(self.args, clean_env(), log_dir)
        self._restarts: list[threading.Thread] = []

    def kill_and_restart(self) -> None:
        """SIGKILL the server now; start it again on the same ports ``DOWN_SECONDS`` later."""
        self.served.proc.send_signal(signal.SIGKILL)
        self.served.proc.wait(timeout=10)

        def again() -> None:
            time.sleep(DOWN_SECONDS)
            self.served = start_server(self.args, clean_env(), self.log_dir)

        thread = threading.Thread(target=again, daemon=True)
        thread.start()
        self._restarts.append(thread)

    def join(self) -> None:
        for thread in self._restarts:
            thread.join(timeout=120)

    def stop(self) -> None:
        self.join()
        self.served.stop()


@pytest.fixture
def model_root(tmp_path: Path) -> Path:
    directory = tmp_path / "models" / MODEL
    directory.mkdir(parents=True)
    save_file(TENSORS, str(directory / "model.safetensors"))
    (directory / "config.json").write_text('{"model_type": "test"}')
    return tmp_path / "models"


@pytest.fixture
def server(model_root: Path, tmp_path: Path) -> Iterator[RestartingServer]:
    srv = RestartingServer(model_root, tmp_path)
    try:
        yield srv
    finally:
        srv.stop()


def digests(directory: Path) -> dict[str, str]:
    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("plane", ["http", "grpc", "flight"])
def test_a_load_metadata_and_pull_wait_out_a_restart(
    server: RestartingServer, model_root: Path, tmp_path: Path, plane: str
) -> None:
    url = server.served.grpc if plane in ("grpc", "flight") else server.served.http
    with Client(url, data_plane=plane, retry_seconds=60) as client:
        model = client.model(MODEL)
        # Killed mid-stream: the stream resumes from its last whole tensor once it is back.
        stream = model.iter_tensors(prefix="", window_bytes=1)
        got = dict([next(stream)])
        server.kill_and_restart()
        got.update(stream)
        assert {k: v.tobytes() for k, v in got.items()} == {
            k: v.tobytes() for k, v in TENSORS.items()
        }
        server.join()
        # Killed before a metadata call: it waits for the server to come back.
        server.kill_and_restart()
        assert client.model_info(MODEL).id == MODEL
        server.join()
        # Killed mid-pull: the file goes on from the bytes already written.
        killed = []

        def kill_once(n: int) -> None:
            if not killed:
                killed.append(n)
                server.kill_and_restart()

        out = client.model(MODEL).download(tmp_path / "pulled", on_bytes=kill_once)
        assert killed
        assert digests(out) == digests(model_root / MODEL)


def test_a_server_closing_before_its_status_line_is_waited_for(model_root: Path) -> None:
    # What a killed server does to a request it had read: closes without a status line.
    port = free_port()
    listener = socket.create_server(("127.0.0.1", port))
    closed = threading.Event()

    def die_after_reading() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.close()
        listener.close()
        closed.set()

    threading.Thread(target=die_after_reading, daemon=True).start()
    answer: dict = {}

    def restart() -> None:
        closed.wait(30)
        time.sleep(DOWN_SECONDS)
        config = ServerConfig(
            str(model_root), http_port=port, grpc_port=0, flight_port=None, watch=False
        )
        srv = WeightServer(config).start()
        answer["server"] = srv

    threading.Thread(target=restart, daemon=True).start()
    try:
        with Client(f"http://127.0.0.1:{port}", retry_seconds=60) as client:
            assert [m.id for m in client.list_models()[0]] == [MODEL]
        assert closed.is_set()
    finally:
        deadline = time.monotonic() + 30
        while "server" not in answer and time.monotonic() < deadline:
            time.sleep(0.1)
        if "server" in answer:
            answer["server"].stop(grace=1.0)


def test_the_command_line_pull_waits_out_a_restart(
    server: RestartingServer, model_root: Path, tmp_path: Path
) -> None:
    server.kill_and_restart()
    done = run_cli(
        "pull",
        f"{server.served.http}/v1/models/{MODEL}",
        "--out",
        str(tmp_path / "cli"),
        # A command fails fast on a refused connection by default; waiting for a server that
        # is coming back is asked for.
        "--retry-seconds",
        "60",
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert digests(tmp_path / "cli") == digests(model_root / MODEL)


HUB_DOWNLOAD = """
import hashlib, sys
from huggingface_hub import hf_hub_download
path = hf_hub_download(sys.argv[1], "model.safetensors")
print(hashlib.sha256(open(path, "rb").read()).hexdigest())
"""


def hub_download(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", HUB_DOWNLOAD, MODEL], capture_output=True, text=True, env=env,
        timeout=120,
    )  # fmt: skip


def test_a_hub_client_and_a_restart(
    server: RestartingServer, model_root: Path, tmp_path: Path
) -> None:
    pytest.importorskip("huggingface_hub")
    env = clean_env(
        HF_ENDPOINT=server.served.http,
        HF_HOME=str(tmp_path / "hf"),
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("HF_TOKEN", None)
    expected = hashlib.sha256((model_root / MODEL / "model.safetensors").read_bytes()).hexdigest()
    # Killed and back before the Hub client asks: the right bytes.
    server.kill_and_restart()
    server.join()
    done = hub_download(env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == expected
    # Asked while it is down: huggingface_hub's own backoff retries a refused connection (five
    # tries over about 30 s), which covers a restart of a few seconds.
    shutil.rmtree(tmp_path / "hf")
    server.kill_and_restart()
    down = hub_download(env)
    server.join()
    assert down.returncode == 0, down.stderr
    assert down.stdout.split()[-1] == expected


def test_a_tls_port_spoken_to_in_plain_http_gets_the_tls_hint(
    tls_server: WeightServer,  # noqa: F811
) -> None:
    plain = f"http://127.0.0.1:{tls_server.http_port}"
    with Client(plain, timeout=10, retry_seconds=60) as client:
        started = time.monotonic()
        with pytest.raises(TransportError, match="speaks TLS: use https://"):
            client.list_models()
        assert time.monotonic() - started < 10  # not waited out as an outage


def test_a_refused_client_certificate_gets_its_hint_at_once(
    mtls_server: WeightServer,  # noqa: F811
    certs: Certs,  # noqa: F811
) -> None:
    address = f"https://127.0.0.1:{mtls_server.http_port}"
    with Client(address, tls=TLSOptions(ca_file=certs.ca), timeout=10, retry_seconds=60) as client:
        started = time.monotonic()
        with pytest.raises(TransportError, match="client certificate"):
            client.list_models()
        assert time.monotonic() - started < 10  # not waited out as an outage


def test_the_hint_is_absent_where_nothing_listens() -> None:
    with (
        Client(f"http://127.0.0.1:{free_port()}", retry_seconds=0) as client,
        pytest.raises(TransportError) as info,
    ):
        client.list_models()
    assert "TLS" not in str(info.value)
