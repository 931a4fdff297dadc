"""``--sendfile auto`` (the default) in a real server: a worker on another host (a network
namespace of its own, bench/netns.py) gets the tensor bytes with ``sendfile``, a client on
the server's own host, reaching the server's own address, gets them copied from the
mapping; both get the checkpoint's bytes. The server's /metrics says which way each went
(``weightserve_http_direct_bytes_total{how}``).

Needs root (namespaces) and iproute2.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from bench.fanout import env
from bench.netns import Hosts, missing

if missing() is not None:
    pytest.skip(f"needs network namespaces: {missing()}", allow_module_level=True)

# Fetches every tensor of model "m" and prints each one's bytes as a digest, then the
# server's direct-write counters once they reach the least given (a stream is counted when
# its handler ends, a moment after the client has the last byte).
_CLIENT = """
import hashlib, json, re, sys, time, urllib.request
from weightserve.client import Client
url, least_sendfile, least_write = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
client = Client(url)
arrays = client.model("m").fetch()
client.close()
digests = {name: hashlib.sha256(a.tobytes()).hexdigest() for name, a in arrays.items()}
deadline = time.monotonic() + 20
while True:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    counts = {how: float(value) for how, value in re.findall(
        r'^weightserve_http_direct_bytes_total[{]how="(\\w+)"[}] (\\S+)$', text, re.M)}
    done = counts.get("sendfile", 0) >= least_sendfile and counts.get("write", 0) >= least_write
    if done or time.monotonic() > deadline:
        break
    time.sleep(0.05)
print(json.dumps({"digests": digests, "written": counts}))
"""


def digests(arrays: dict[str, np.ndarray]) -> dict[str, str]:
    return {name: hashlib.sha256(a.tobytes()).hexdigest() for name, a in arrays.items()}


def load_from(hosts: Hosts, host: str, url: str, least_sendfile: float, least_write: float) -> dict:
    client = hosts.popen(
        host, [sys.executable, "-c", _CLIENT, url, str(least_sendfile), str(least_write)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
    )  # fmt: skip
    out, err = client.communicate(timeout=300)
    assert client.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_auto_sends_with_sendfile_to_other_hosts_and_copies_for_this_one(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "m").mkdir(parents=True)
    rng = np.random.default_rng(11)
    tensors = {
        f"layers.{i}.weight": rng.standard_normal((512, 1024), dtype=np.float32) for i in range(4)
    }  # 2 MiB each: past the size below which a body goes as one ASGI send
    save_file(tensors, str(root / "m" / "model.safetensors"))
    reference = load_file(str(root / "m" / "model.safetensors"))
    tensor_bytes = sum(a.nbytes for a in reference.values())

    with Hosts() as hosts:
        address = hosts.add("srv")
        hosts.add("worker")
        server = hosts.serve(
            "srv",
            [str(root), "--host", address, "--http-port", "8080", "--grpc-port", "0",
             "--flight-port", "-1", "--cache-dir", str(tmp_path / "cache")],
            tmp_path, env(),
        )  # fmt: skip
        try:
            remote = load_from(hosts, "worker", server.http, tensor_bytes, 1)
            framing = remote["written"]["write"]
            local = load_from(hosts, "srv", server.http, 0, framing + tensor_bytes + 1)
        finally:
            server.stop()

    assert remote["digests"] == digests(reference)
    assert local["digests"] == digests(reference)
    # The worker on the other host: every tensor byte by sendfile, only the framing written.
    assert remote["written"]["sendfile"] == tensor_bytes
    assert 0 < framing < tensor_bytes / 100
    # The client on the server's own host (its own address, not loopback): copied, the
    # same framing around the same bytes.
    assert local["written"]["sendfile"] == tensor_bytes
    assert local["written"]["write"] - framing == tensor_bytes + framing
