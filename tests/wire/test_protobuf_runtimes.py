"""The generated gRPC code runs on every protobuf runtime weightserve declares: the oldest
(pyproject's lower bound), the one MAX's serving stack installs (max[serve] pins protobuf
below 6.34; pip settles on 6.33.6) and the newest (this environment's).

- Cheap and always run: the gencode's version is no newer than the oldest runtime declared
  and of the newest runtime's major version or the one before (protobuf's cross-version
  rules), and the gRPC code needs no newer grpcio than declared.
- Slow (it installs protobuf wheels): a client process on the old runtimes, beside a server
  on the newest, lists, describes and fetches a model over grpc://, http:// and Flight.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import __version__ as runtime_version
from safetensors.numpy import save_file

from tests.support.paths import REPO
from weightserve.client.wire.proto.weightserve.v1 import weightserve_pb2_grpc
from weightserve.service.server import ServerConfig, WeightServer

PB2 = REPO / "client" / "wire" / "proto" / "weightserve" / "v1" / "weightserve_pb2.py"
# The runtime `pip install 'weightserve[max]' 'max[serve]'` resolves to.
MAX_SERVE_PROTOBUF = "6.33.6"


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def declared_minimum(package: str) -> str:
    """The lower bound of ``package`` in pyproject's dependencies."""
    found = re.search(rf'"{package}>=([\d.]+)"', (REPO / "pyproject.toml").read_text())
    assert found, f"pyproject declares no lower bound for {package}"
    return found.group(1)


def gencode_version() -> str:
    found = re.search(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*"
        r"(\d+),\s*(\d+),",
        PB2.read_text(),
    )
    assert found, f"no runtime version check in {PB2.name}"
    return ".".join(found.groups())


def test_gencode_runs_on_every_declared_runtime() -> None:
    gencode = version(gencode_version())
    assert gencode <= version(declared_minimum("protobuf"))
    newest = version(runtime_version)
    assert newest[0] - 1 <= gencode[0] <= newest[0]
    assert version(MAX_SERVE_PROTOBUF) >= version(declared_minimum("protobuf"))
    generated_grpc = version(weightserve_pb2_grpc.GRPC_GENERATED_VERSION)
    assert generated_grpc <= version(declared_minimum("grpcio"))


CLIENT = textwrap.dedent(
    """
    import sys
    import numpy as np
    from google.protobuf import __version__ as protobuf_version
    from weightserve.client import Client, load_weights

    want, grpc_url, http_url = sys.argv[1:]
    assert protobuf_version == want, protobuf_version
    want_bytes = np.arange(256, dtype=np.float32).tobytes()
    for url, plane in [(grpc_url, "grpc"), (grpc_url, "flight"), (http_url, "http")]:
        with Client(url, timeout=20, retry_seconds=0, data_plane=plane) as client:
            models, problems = client.list_models()
            assert [m.id for m in models] == ["tiny"] and not problems, models
            assert client.model("tiny").fetch()["w"].tobytes() == want_bytes, plane
        print("ok", plane)
    weights = load_weights([grpc_url + "/tiny"], use_max=False)
    assert weights.w.data().data.tobytes() == want_bytes
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("protobuf", [declared_minimum("protobuf"), MAX_SERVE_PROTOBUF])
def test_a_client_on_an_older_runtime_uses_every_transport(
    protobuf: str, tmp_path: Path, child_env: dict[str, str]
) -> None:
    site = tmp_path / f"protobuf-{protobuf}"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
         f"protobuf=={protobuf}"],
        check=True, timeout=300,
    )  # fmt: skip
    root = tmp_path / "root"
    (root / "tiny").mkdir(parents=True)
    save_file({"w": np.arange(256, dtype=np.float32)}, root / "tiny" / "model.safetensors")
    config = ServerConfig(str(root), http_port=0, grpc_port=0, flight_port=0)
    with WeightServer(config) as srv:
        env = {**child_env, "PYTHONPATH": str(site)}  # ahead of the newest runtime
        proc = subprocess.run(
            [sys.executable, "-c", CLIENT, protobuf, srv.grpc_url, srv.http_url],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["ok", "grpc", "ok", "flight", "ok", "http"]
