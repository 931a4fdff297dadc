"""Delta patches kept beside published revisions on disk: a restarted server serves a pair it
computed before without diffing again, byte for byte; a kept file cut short or changed is
ignored and computed again; retention takes the files from and to a revision it removes; the
files into one revision stay within its size; a hub cache weightserve did not publish keeps
its patches in memory only."""

from __future__ import annotations

import contextlib
import logging
import shutil
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support._util import http_request
from tests.support.commands import ANY_PORTS, clean_env, start_server
from tests.support.publishing import first_weights
from weightserve.client._client import Client
from weightserve.service.server import ServerConfig, WeightServer

MODEL = "team/policy"
REPO = "models--team--policy"


@contextlib.contextmanager
def serving(root: Path, **settings: object) -> Iterator[WeightServer]:
    config = ServerConfig(
        str(root), http_port=0, grpc_port=0, flight_port=None, rescan_seconds=0,
        watch=False, allow_publish=True, grace_seconds=1, **settings,  # type: ignore[arg-type]
    )  # fmt: skip
    with WeightServer(config) as server:
        yield server


def step(weights: dict[str, np.ndarray], density: float, seed: int) -> dict[str, np.ndarray]:
    """``density`` of the bfloat16 elements move; the norm changes (a patch), the head grows
    (whole), the int8 table stays (same)."""
    rng = np.random.default_rng(seed)
    nxt = {name: array.copy() for name, array in weights.items()}
    w = nxt["layers.0.w"].reshape(-1)
    moved = rng.choice(w.size, int(w.size * density), replace=False)
    w[moved] = (w[moved].astype(np.float32) + 0.5).astype(ml_dtypes.bfloat16)
    nxt["norm"] = nxt["norm"] + np.float32(1)
    nxt["head"] = rng.standard_normal(len(nxt["head"]) + 8).astype(np.float32)
    return nxt


def delta_body(server: WeightServer | int, since: str, revision: str = "main") -> bytes:
    port = server if isinstance(server, int) else server.http_port
    reply = http_request(port, f"/v1/models/{MODEL}/-/delta?since={since}&revision={revision}")
    assert reply.status == 200, reply.body[:300]
    return reply.body


def served(server: WeightServer | int) -> Counter[str]:
    """``weightserve_delta_served_total`` by source, with ``computed_total`` as "diffs"."""
    counts: Counter[str] = Counter()
    port = server if isinstance(server, int) else server.http_port
    text = http_request(port, "/metrics").body.decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "weightserve_delta_served_total":
                counts[sample.labels["source"]] += int(sample.value)
            elif sample.name == "weightserve_delta_computed_total":
                counts["diffs"] += int(sample.value)
    return counts


def kept_files(root: Path) -> dict[str, int]:
    deltas = root / REPO / ".revisions" / "deltas"
    return {p.name: p.stat().st_size for p in deltas.iterdir()} if deltas.is_dir() else {}


def publish_two(root: Path) -> tuple[str, str, bytes]:
    """R1 and R2 published, and the delta R1 -> R2 served once (computed, kept on disk)."""
    root.mkdir(exist_ok=True)
    with serving(root) as server, Client(server.http_url) as c:
        r1 = c.publish(MODEL, first_weights())
        r2 = c.publish(MODEL, step(first_weights(), 0.01, 1), base=r1.commit)
        body = delta_body(server, r1.commit)
        assert server.state.deltas.computed == 4
        assert served(server) == Counter(computed=4, diffs=4)
    return r1.commit, r2.commit, body


def test_a_restarted_server_serves_a_kept_delta_without_diffing(tmp_path: Path) -> None:
    r1, r2, body = publish_two(tmp_path)
    assert list(kept_files(tmp_path)) == [f"{r1}..{r2}.delta"]
    # A file a killed process was writing: removed at start, never read.
    leftover = tmp_path / REPO / ".revisions" / "deltas" / f".{r1}..{r2}.delta.dead"
    leftover.write_bytes(b"half")
    with serving(tmp_path) as server:
        assert not leftover.exists()
        workers = [threading.Thread(target=delta_body, args=(server, r1)) for _ in range(3)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert delta_body(server, r1) == body
        assert delta_body(server, r1, revision=r2) == body
        assert server.state.deltas.computed == 0
        assert served(server) == Counter(disk=4 * 5)
        with Client(server.http_url) as c:  # and a worker lands on R2 from it
            state = {name: array.copy() for name, array in first_weights().items()}
            model = c.model(MODEL)
            assert model.update(state, since=r1).commit == r2
            assert model.last_update["patch"] >= 1 and model.last_update["refetched"] == 0
            r2_weights = step(first_weights(), 0.01, 1)
            assert all(state[n].tobytes() == a.tobytes() for n, a in r2_weights.items())


def test_a_killed_server_process_restarted_serves_the_kept_delta(tmp_path: Path) -> None:
    """``weightserve serve`` as a process: SIGKILLed after serving a pair, started again on
    the same root, it serves the same bytes from disk."""
    root = tmp_path / "root"
    root.mkdir()
    args = [str(root), *ANY_PORTS, "--allow-publish", "--no-watch"]
    process = start_server(args, clean_env(), tmp_path)
    try:
        port = int(process.http.rsplit(":", 1)[1])
        with Client(process.http) as c:
            r1 = c.publish(MODEL, first_weights()).commit
            c.publish(MODEL, step(first_weights(), 0.01, 1), base=r1)
        body = delta_body(port, r1)
        assert served(port)["computed"] == 4
    finally:
        process.proc.send_signal(signal.SIGKILL)
        process.proc.wait(timeout=10)
    process = start_server(args, clean_env(), tmp_path)
    try:
        port = int(process.http.rsplit(":", 1)[1])
        assert delta_body(port, r1) == body
        assert served(port) == Counter(disk=4)
    finally:
        process.stop()


@pytest.mark.parametrize("damage", ["cut short", "a byte changed", "empty"])
def test_a_damaged_kept_delta_is_computed_again(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    r1, r2, body = publish_two(tmp_path)
    (path,) = (tmp_path / REPO / ".revisions" / "deltas").iterdir()
    data = bytearray(path.read_bytes())
    if damage == "cut short":
        data = data[: len(data) // 2]
    elif damage == "a byte changed":
        data[len(data) // 2] ^= 0xFF
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING), serving(tmp_path) as server:
        assert delta_body(server, r1) == body
        assert server.state.deltas.computed == 4
        assert any("computed again" in r.getMessage() for r in caplog.records)
        # Written again, whole: the next restart reads it.
        assert path.read_bytes() != bytes(data)
    with serving(tmp_path) as server:
        assert delta_body(server, r1) == body
        assert server.state.deltas.computed == 0


def test_retention_removes_the_deltas_of_a_removed_revision(tmp_path: Path) -> None:
    with serving(tmp_path, keep_revisions=2) as server, Client(server.http_url) as c:
        w1 = first_weights()
        w2 = step(w1, 0.01, 1)
        r1 = c.publish(MODEL, w1).commit
        r2 = c.publish(MODEL, w2, base=r1).commit
        delta_body(server, r1)
        r3 = c.publish(MODEL, step(w2, 0.01, 2), base=r2).commit  # R1 goes
        delta_body(server, r2)
        assert set(kept_files(tmp_path)) == {f"{r2}..{r3}.delta"}
        assert not (tmp_path / REPO / "snapshots" / r1).exists()


def test_the_deltas_into_a_revision_stay_within_its_size(tmp_path: Path) -> None:
    """Three patches into R4, each of 40 % of its float32 elements (new random values: they do
    not compress), together over R4's bytes: the least recently used go, the newest stays."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((256, 512)).astype(np.float32)
    moved = rng.choice(w.size, w.size * 2 // 5, replace=False)

    def revision(seed: int) -> dict[str, np.ndarray]:
        changed = w.copy().reshape(-1)
        changed[moved] = np.random.default_rng(seed).standard_normal(moved.size)
        return {"w": changed.reshape(w.shape), "b": np.arange(64, dtype=np.float32)}

    with serving(tmp_path, keep_revisions=8) as server, Client(server.http_url) as c:
        bases = [c.publish(MODEL, revision(seed)).commit for seed in (1, 2, 3)]
        r4 = c.publish(MODEL, revision(4)).commit
        size = sum(f.stat().st_size for f in (tmp_path / REPO / "snapshots" / r4).iterdir())
        for base in bases:
            delta_body(server, base)
            assert sum(kept_files(tmp_path).values()) <= size
        assert server.state.deltas.computed == 3 * 2
        kept = kept_files(tmp_path)
        assert f"{bases[-1]}..{r4}.delta" in kept and f"{bases[0]}..{r4}.delta" not in kept
        assert all(size / 4 < got < size / 2 for got in kept.values())


def test_a_hub_cache_weightserve_did_not_publish_keeps_its_deltas_in_memory(
    tmp_path: Path,
) -> None:
    r1, _, body = publish_two(tmp_path / "published")
    root = tmp_path / "copied"
    shutil.copytree(
        tmp_path / "published" / REPO, root / REPO, ignore=shutil.ignore_patterns(".revisions")
    )
    with serving(root) as server:
        assert delta_body(server, r1) == body
        assert delta_body(server, r1) == body
        assert served(server) == Counter(computed=4, memory=4, diffs=4)
    assert not (root / REPO / ".revisions").exists()
    with serving(root) as server:  # a restart diffs again
        assert delta_body(server, r1) == body
        assert server.state.deltas.computed == 4
