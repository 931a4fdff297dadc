"""Tokens and grants, a model root with a secret outside it, and a test CA with server and
client certificates made with ``openssl`` at test time."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from weightserve.service.server import ServerConfig, WeightServer

FULL_TOKEN = "full-access-token-0123456789abcdef"

TEAM_A_TOKEN = "team-a-token-fedcba9876543210"

SECRET = b"TOP-SECRET-OUTSIDE-THE-ROOT!"  # bytes of a checkpoint outside the model root

BIG_TENSOR_BYTES = 8 << 20

BIG_TENSORS = 4  # 32 MiB: far more than loopback socket buffers hold for a stalled reader


@dataclass
class Root:
    path: Path
    outside: Path
    arrays: dict[str, dict[str, np.ndarray]]  # model id -> tensors


def _small(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((4, 8)).astype(np.float32),
        "b": rng.integers(-100, 100, 8, dtype=np.int16),
    }


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Root:
    base = tmp_path_factory.mktemp("security")
    path, outside = base / "root", base / "outside"
    arrays: dict[str, dict[str, np.ndarray]] = {}
    for seed, model_id in enumerate(("team-a/x", "team-a/y", "team-b/z", "shared/base")):
        (path / model_id).mkdir(parents=True)
        arrays[model_id] = _small(seed)
        save_file(arrays[model_id], path / model_id / "model.safetensors")
    rng = np.random.default_rng(7)
    arrays["big"] = {
        f"t{i}": rng.integers(0, 256, BIG_TENSOR_BYTES, dtype=np.uint8) for i in range(BIG_TENSORS)
    }
    (path / "big").mkdir()
    save_file(arrays["big"], path / "big" / "model.safetensors")

    # A valid model outside the root, and symlinks inside the root that lead to it.
    (outside / "secret").mkdir(parents=True)
    secret_file = outside / "secret" / "model.safetensors"
    save_file({"secret": np.frombuffer(SECRET * 64, dtype=np.uint8)}, secret_file)
    (outside / "passwd").write_bytes(SECRET)
    (path / "escape-dir").symlink_to(outside / "secret", target_is_directory=True)
    (path / "escape-file.safetensors").symlink_to(secret_file)
    (path / "team-c").mkdir()
    (path / "team-c" / "model.safetensors").symlink_to(secret_file)
    return Root(path, outside, arrays)


@contextlib.contextmanager
def serving(root: Root, **config) -> Iterator[WeightServer]:
    srv = WeightServer(
        ServerConfig(
            str(root.path), http_port=0, grpc_port=0, flight_port=0, rescan_seconds=0, **config
        )
    ).start()
    try:
        yield srv
    finally:
        srv.stop(grace=1.0)


def write_tokens(path: Path, text: str) -> None:
    """Replace the token file atomically, as a secret-mount rotation does."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass(frozen=True)
class Certs:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    rogue_cert: str  # a client certificate issued by another CA
    rogue_key: str


def _openssl(directory: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command line tool is not installed")
    d = tmp_path_factory.mktemp("certs")
    new_key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")

    def make_ca(name: str) -> None:
        _openssl(
            d, "req", "-x509", *new_key, "-keyout", f"{name}.key", "-out", f"{name}.pem",
            "-days", "2", "-subj", f"/CN=weightserve test {name}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        )  # fmt: skip

    def make_leaf(name: str, ca: str, serial: int, extensions: str) -> None:
        _openssl(d, "req", "-new", *new_key, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}")  # fmt: skip
        (d / f"{name}.ext").write_text(
            "basicConstraints=critical,CA:FALSE\nsubjectKeyIdentifier=hash\n"
            "authorityKeyIdentifier=keyid\n" + extensions
        )
        _openssl(
            d, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-set_serial", str(serial), "-days", "2", "-out", f"{name}.pem",
            "-extfile", f"{name}.ext",
        )  # fmt: skip

    make_ca("ca")
    make_ca("rogue-ca")
    make_leaf(
        "server", "ca", 1,
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nkeyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\n",
    )  # fmt: skip
    client_ext = "keyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n"
    make_leaf("client", "ca", 2, client_ext)
    make_leaf("rogue", "rogue-ca", 3, client_ext)
    return Certs(*(str(d / n) for n in (
        "ca.pem", "server.pem", "server.key", "client.pem", "client.key", "rogue.pem", "rogue.key",
    )))  # fmt: skip


@pytest.fixture(scope="module")
def tls_server(root: Root, certs: Certs) -> Iterator[WeightServer]:
    with serving(root, tls_cert=certs.server_cert, tls_key=certs.server_key) as srv:
        yield srv


@pytest.fixture(scope="module")
def mtls_server(root: Root, certs: Certs) -> Iterator[WeightServer]:
    with serving(
        root, tls_cert=certs.server_cert, tls_key=certs.server_key, tls_client_ca=certs.ca
    ) as srv:
        yield srv
