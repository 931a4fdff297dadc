"""A patch bomb against a server process: a patch line declaring 2^27 changes of a 1,024-element
tensor, its positions and values zstd-compressed zeros (a few dozen KiB on the wire), is
refused with 400 before anything is decompressed or allocated: the process's peak resident
memory (``VmHWM``) grows by less than 64 MiB."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from tests.support.commands import ANY_PORTS, clean_env, start_server
from tests.support.publishing import put_patch
from weightserve.client._client import Client

MODEL = "team/bombed"
ELEMENTS = 1024
COUNT = 1 << 27  # changes declared: 131,072 times the tensor's elements
PEAK_GROWTH_LIMIT = 64 << 20


def peak_rss(pid: int) -> int:
    """The process's peak resident memory in bytes (``VmHWM``, from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM in /proc status")


def bomb() -> bytes:
    """One patch line of ``w`` declaring COUNT one-byte changes, and its payload: 2^27 zero
    gaps and 2^27 zero values, each zstd-compressed."""
    zeros = pa.compress(np.zeros(COUNT, np.uint8).tobytes(), codec="zstd", asbytes=True)
    header = {"kind": "patch", "name": "w", "dtype": "float32", "shape": [ELEMENTS],
              "nbytes": ELEMENTS * 4, "digest": "0" * 32, "count": COUNT, "element_bytes": 1,
              "gap_bytes": 1, "positions_bytes": len(zeros), "values_bytes": len(zeros),
              "values_raw_bytes": COUNT, "values_codec": "zstd"}  # fmt: skip
    return json.dumps(header).encode() + b"\n" + zeros + zeros


def test_a_patch_bomb_is_refused_without_allocating(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    served = start_server([str(root), *ANY_PORTS, "--allow-publish", "--no-watch"], clean_env(),
                          tmp_path)  # fmt: skip
    try:
        port = int(served.http.rsplit(":", 1)[1])
        with Client(served.http) as c:
            base = c.publish(MODEL, {"w": np.arange(ELEMENTS, dtype=np.float32)}).commit
        body = bomb()
        assert len(body) < 64 << 10  # the bomb is small on the wire
        warm = put_patch(
            port, MODEL, base, b"not json\n"
        )  # the refusal path loaded before measuring
        assert warm[0] == 400, warm
        before = peak_rss(served.proc.pid)
        status, answer = put_patch(port, MODEL, base, body)
        after = peak_rss(served.proc.pid)
        assert status == 400, answer
        assert answer["error"]["type"] == "InvalidRequest"
        assert (
            f"changes {COUNT} elements of a tensor of {ELEMENTS * 4}"
            in (answer["error"]["message"])
        )
        assert after - before < PEAK_GROWTH_LIMIT, (before, after)
        with Client(served.http) as c:  # nothing changed: main is the base, whole
            assert c.model(MODEL).commit == base
            got = c.model(MODEL).fetch()["w"]
            assert np.asarray(got).tobytes() == np.arange(ELEMENTS, dtype=np.float32).tobytes()
    finally:
        served.stop()
