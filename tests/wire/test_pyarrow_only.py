"""Any Arrow reader can consume the wire: a client written with pyarrow, NumPy, ml_dtypes and
urllib alone (weightserve cannot even be imported in it) rebuilds tensors from a prefix stream,
and what it rebuilds matches the format's reference reader."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

# Runs in a separate interpreter. Everything it knows about the wire is the documented schema:
# one row per chunk (name, dtype, shape, logical_shape, encoding, offset, total_bytes, digest,
# data); chunks of a tensor come in order, and concatenated they are the tensor's bytes.
SCRIPT = r"""
import hashlib
import json
import sys
import urllib.parse
import urllib.request


class NoWeightserve:
    # Refuse the project's own package: this client must stand on the wire format alone.
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "weightserve":
            raise ImportError("this client must not import weightserve")
        return None


sys.meta_path.insert(0, NoWeightserve())

import ml_dtypes
import numpy as np
import pyarrow as pa


def numpy_dtype(name):
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


base, model, prefix = sys.argv[1:4]
query = urllib.parse.urlencode({"prefix": prefix, "chunk_bytes": 1 << 20})
url = f"{base}/v1/models/{urllib.parse.quote(model, safe='/')}/stream?{query}"
chunks, info = {}, {}
with urllib.request.urlopen(url, timeout=60) as resp:
    assert resp.headers["Content-Type"] == "application/vnd.apache.arrow.stream"
    with pa.ipc.open_stream(resp) as reader:
        for batch in reader:
            columns = {name: batch.column(name) for name in batch.schema.names}
            for i in range(batch.num_rows):
                name = columns["name"][i].as_py()
                data = columns["data"][i].as_buffer()
                if name not in info:
                    info[name] = {
                        "dtype": columns["dtype"][i].as_py(),
                        "shape": columns["shape"][i].as_py(),
                        "logical_shape": columns["logical_shape"][i].as_py(),
                        "encoding": columns["encoding"][i].as_py(),
                        "total_bytes": columns["total_bytes"][i].as_py(),
                    }
                    chunks[name] = []
                received = sum(len(c) for c in chunks[name])
                assert columns["offset"][i].as_py() == received, (name, received)
                chunks[name].append(data.to_pybytes() if data is not None else b"")

digest = {}
for name, meta in info.items():
    raw = b"".join(chunks[name])
    assert len(raw) == meta["total_bytes"], name
    array = np.frombuffer(raw, dtype=numpy_dtype(meta["dtype"])).reshape(meta["shape"])
    digest[name] = {
        "dtype": array.dtype.name,
        "shape": list(array.shape),
        "logical_shape": meta["logical_shape"],
        "encoding": meta["encoding"],
        "sha256": hashlib.sha256(array.tobytes()).hexdigest(),
    }
assert not [m for m in sys.modules if m.partition(".")[0] == "weightserve"]
print(json.dumps(digest))
"""


@pytest.mark.parametrize(
    ("model", "prefix"),
    [
        ("mixed", ""),
        ("org/sharded", "model.layers."),
        ("tiny.gguf", "blk.0."),
        ("smollm2.gguf", "blk.2"),  # a raw prefix: blk.2.* and blk.20.* .. blk.29.*
        ("minilm", "encoder.layer.1"),
        ("torch", "view."),
    ],
)
def test_pyarrow_only_client(
    server, model_root, reference, child_env, model: str, prefix: str
) -> None:
    if model in model_root.skipped:
        pytest.skip(f"model {model!r}: {model_root.skipped[model]}")
    proc = subprocess.run(
        [sys.executable, "-I", "-c", SCRIPT, server.http_url, model, prefix],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env,
    )
    assert proc.returncode == 0, proc.stderr
    digest = json.loads(proc.stdout)
    ref = reference(model)
    want = {n: r for n, r in ref.items() if n.startswith(prefix)}
    assert want, "the prefix selects nothing; the test would prove nothing"
    assert list(digest) == list(want)
    for name, r in want.items():
        assert digest[name] == {
            "dtype": r.dtype,
            "shape": list(r.shape),
            "logical_shape": list(r.logical_shape),
            "encoding": r.encoding,
            "sha256": hashlib.sha256(r.array.tobytes()).hexdigest(),
        }, name
