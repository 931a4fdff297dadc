"""``python -m bench --quick`` runs end to end and writes the JSON the docs are built from.

No timing assertions: only that every contender ran and produced positive numbers.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO

CONTENDERS = {
    "raw_sendfile_1conn",
    "raw_sendfile_2conn",
    "raw_mmap_1conn",
    "raw_mmap_2conn",
    "pagecache_read",
    "fresh_memory_touch",
    "local_safetensors_load_file",
    "web_download",
    "web_safetensors_load",
    "ws_http_max",
    "ws_grpc_max",
    "ws_http_fetch",
    "ws_grpc_fetch",
    "ws_http_drain",
    "ws_grpc_drain",
    "ws_http_fetch_1stream",
    "ws_grpc_fetch_1stream",
    "ws_http_prefix",
    "ws_grpc_prefix",
    "ws_http_shard",
    "ws_grpc_shard",
    "raw_sendfile_1conn_conc4",
    "raw_mmap_1conn_conc4",
    "ws_http_max_conc4",
    "ws_grpc_max_conc4",
    "ws_http_small_latency",
    "ws_grpc_small_latency",
    "ws_http_small_conc8",
    "ws_grpc_small_conc8",
}


@pytest.mark.slow
def test_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "latest.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "goals:" in proc.stdout

    results = json.loads(out.read_text())
    assert {"machine", "config", "checkpoint", "contenders", "ceiling", "goals"} <= set(results)
    assert results["machine"]["nproc"] > 0
    assert results["checkpoint"]["tensors"] > 100
    assert results["ceiling"]["gbps"] > 0
    assert results["ceiling_conc4"]["gbps"] > 0

    contenders = results["contenders"]
    assert set(contenders) >= CONTENDERS, CONTENDERS - set(contenders)
    for key, c in contenders.items():
        assert c["median_s"] > 0 and c["min_s"] > 0, key
        assert c["bytes"] > 0 and c["gbps"] > 0, key
        assert c["peak_rss"] > 0, key
    for key in ("ws_http_max", "ws_grpc_max", "ws_http_fetch", "ws_grpc_fetch"):
        assert contenders[key]["ratio_to_ceiling"] > 0
        assert contenders[key]["bytes"] == results["checkpoint"]["bytes"]
    for key in ("ws_http_prefix", "ws_grpc_prefix"):
        assert contenders[key]["bytes"] == results["checkpoint"]["prefix_bytes"]
    for key in ("ws_http_max_conc4", "ws_grpc_max_conc4"):
        assert contenders[key]["clients"] == 4
        assert contenders[key]["server_anon_before"] > 0
        assert contenders[key]["server_anon_peak"] > 0
    for t in ("http", "grpc"):
        lat = contenders[f"ws_{t}_small_latency"]
        assert lat["p50_ms"] > 0 and lat["p99_ms"] >= lat["p50_ms"]
        assert contenders[f"ws_{t}_small_conc8"]["requests_per_s"] > 0
        assert contenders[f"ws_{t}_small_conc8"]["clients"] == 8

    goals = results["goals"]
    assert len(goals) >= 12
    for g in goals:
        assert {"goal", "target", "measured", "met"} <= set(g)
        if "RSS before the load" in g["goal"]:
            # What a load added beyond its bytes: below 0 where its arrays landed in heap
            # pages the process already held (the quick checkpoint is a few MiB).
            assert math.isfinite(g["measured"]), g
        else:
            assert g["measured"] >= 0, g


@pytest.mark.slow
def test_bench_ab_quick(tmp_path: Path) -> None:
    """``python -m bench --against HEAD --quick``: HEAD's tree exported and served beside this
    one, every contender measured on both, ratios per round (no timing is asserted)."""
    out = tmp_path / "ab.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--against", "HEAD", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "this/REF" in proc.stdout

    results = json.loads(out.read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    assert results["config"]["ref_commit"] == head.stdout.strip()
    rounds = results["config"]["rounds"]
    assert rounds >= 3 and len(results["ceiling"]["values"]) == rounds
    assert results["ceiling"]["median"] > 0
    contenders = results["contenders"]
    assert set(contenders) == {"ws_http_max", "ws_http_fetch", "ws_http_small_latency"}
    for key, c in contenders.items():
        for side in ("this", "ref"):
            assert len(c[side]["values"]) == rounds, key
            assert all(v > 0 for v in c[side]["values"]), key
        assert c["ratio"]["min"] > 0 and c["ratio"]["median"] > 0, key
    assert contenders["ws_http_max"]["this"]["ratio_to_ceiling"] > 0


FILL_CONTENDERS = {
    "copy_files",
    "copy_files_chunk16MiB",
    "fill_c8_p16MiB",
    "fill_c4_p32MiB",
    "fill_c16_p8MiB",
}


@pytest.mark.slow
def test_bench_fill_quick(tmp_path: Path) -> None:
    """``python -m bench.fill --quick``: SeaweedFS on loopback, the ceiling and every fill
    setting run, bytes checked, JSON written."""
    out = tmp_path / "fill.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["AWS_EC2_METADATA_DISABLED"] = "true"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.fill", "--quick", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "ratio" in proc.stdout

    results = json.loads(out.read_text())
    assert {"machine", "config", "checkpoint", "contenders"} <= set(results)
    contenders = results["contenders"]
    assert set(contenders) == FILL_CONTENDERS
    assert contenders["copy_files"]["ratio_to_ceiling"] == 1.0
    for key, c in contenders.items():
        assert c["bytes"] == results["checkpoint"]["file_bytes"] > 0, key
        assert c["median_s"] > 0 and c["gbps"] > 0 and c["ratio_to_ceiling"] > 0, key


def test_bench_framing_quick(tmp_path: Path) -> None:
    """``python -m bench.framing --quick``: every measurement and ratio is positive, JSON
    written (no timing is asserted)."""
    out = tmp_path / "framing.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.framing", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "of the ceiling" in proc.stdout
    results = json.loads(out.read_text())
    assert {"machine", "config", "medians", "ratios"} <= set(results)
    assert len(results["ratios"]) == 3
    assert all(v > 0 for v in [*results["medians"].values(), *results["ratios"].values()])


@pytest.mark.torch
def test_bench_gpu_harness_on_the_cpu(tmp_path: Path) -> None:
    """``python -m bench.gpu --device cpu``: the GPU bench's every row runs without a GPU
    (no page-locked memory), JSON written with positive rates and ratios (none asserted)."""
    pytest.importorskip("torch")
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--device", "cpu", "--size-gib", "0.02",
         "--rounds", "1", "--concurrent", "2", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = json.loads(out.read_text())["rows"]
    assert {"raw_tcp", "ws_http_to_device", "ws_handoff_to_device", "ws_http_to_device_x2"} <= set(
        rows
    )
    assert all(row["gbps"] > 0 for row in rows.values())
    assert all(row["of_raw_tcp"] > 0 for key, row in rows.items() if key.startswith("ws_"))


def test_bench_native_loops_quick(tmp_path: Path) -> None:
    """``python -m bench.native_loops --quick``: every row loaded in every round, with CPU
    figures and a ratio against the raw reader, JSON written (no timing is asserted)."""
    out = tmp_path / "native-loops.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.native_loops", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode == 2 and "not built" in proc.stdout:
        pytest.skip("the native loops are not built")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads(out.read_text())
    rows = {"sendfile_native", "sendfile_python", "copy_native", "copy_python"}
    assert set(results["samples"]) == rows | {"raw_mmap_2conn_lowat_xxh3"}
    assert all(len(got) == 2 for got in results["samples"].values())
    assert all(s["wall_s"] > 0 for got in results["samples"].values() for s in got)
    assert all(r > 0 for got in results["x_raw_per_round"].values() for r in got)
