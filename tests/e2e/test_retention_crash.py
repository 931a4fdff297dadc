"""Retention killed mid-way, and pulls of a revision that loses files on the server.

- A server killed (SIGKILL) while retention deletes a revision's files: after a restart the
  revision is neither listed nor served, and nothing of it is left on disk. The deletion is
  made slow by ``WEIGHTSERVE_TEST_REMOVAL_PAUSE`` (set only by tests), so the kill lands in
  the middle of it.
- A snapshot that an older version left partly removed (fewer bytes than its record counts)
  is removed at startup instead of being served under its commit.
- A pull of ``ID@R`` during which R's files go from the server fails naming them, instead of
  ending with part of R; a pull checks that every listed file is in place.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.support.commands import ANY_PORTS, clean_env, start_server
from tests.support.publishing import serve
from weightserve.client._client import Client
from weightserve.client.errors import RevisionNotFound, WeightserveError

MODEL = "team/policy"
SIDE_FILES = 60


def weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((64, 32)).astype(np.float32)}


def side_files(seed: int) -> dict[str, bytes]:
    return {
        f"extra/{i:03d}.json": json.dumps({"seed": seed, "i": i}).encode()
        for i in range(SIDE_FILES)
    }


def files_of(root: Path, commit: str) -> int:
    """Files of ``commit``'s snapshot wherever it lies under the root (its own name, or a
    name it was renamed to for removal)."""
    return sum(
        len(names)
        for dirpath, _, names in os.walk(root)
        if any(commit in part for part in Path(dirpath).parts)
    )


def assert_served_whole(c: Client, root: Path, removed: str) -> None:
    """Every listed revision loads whole; ``removed`` is neither listed nor served nor left."""
    listed = [r.commit for r in c.revisions(MODEL)]
    assert removed not in listed
    with pytest.raises(RevisionNotFound):
        c.model(MODEL, revision=removed)
    for commit in listed:
        model = c.model(MODEL, revision=commit)
        assert len(model.files()) == SIDE_FILES + 1
        assert model.fetch()["w"].shape == (64, 32)
    assert files_of(root, removed) == 0


def test_a_server_killed_mid_retention_serves_no_part_of_the_revision(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    args = [str(root), *ANY_PORTS, "--allow-publish", "--keep-revisions", "1"]
    served = start_server(args, clean_env(WEIGHTSERVE_TEST_REMOVAL_PAUSE="0.05"), tmp_path)
    try:
        with Client(served.http, retry_seconds=0) as c:
            first = c.publish(MODEL, weights(1), files=side_files(1)).commit
            ended: list[BaseException | None] = []

            def publish_second() -> None:  # its retention removes the first: 60 files, slowly
                try:
                    c.publish(MODEL, weights(2), files=side_files(2))
                    ended.append(None)
                except WeightserveError as e:  # the server is killed under it
                    ended.append(e)

            publishing = threading.Thread(target=publish_second)
            publishing.start()
            deadline = time.monotonic() + 60
            while not 0 < files_of(root, first) < SIDE_FILES - 5:
                assert time.monotonic() < deadline, "retention never started removing"
                time.sleep(0.01)
            served.stop(signal.SIGKILL)
            publishing.join(timeout=60)
            assert ended and ended[0] is not None  # killed before the removal ended
        assert files_of(root, first) > 0  # the kill left part of it on disk
    finally:
        served.stop(signal.SIGKILL)
    again = start_server(args, clean_env(), tmp_path)
    try:
        with Client(again.http) as c:
            assert_served_whole(c, root, first)
    finally:
        again.stop()


def test_a_partly_removed_snapshot_is_removed_at_startup(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with serve(root, allow_publish=True) as srv, Client(srv.http_url) as c:
        first = c.publish(MODEL, weights(1), files=side_files(1)).commit
        c.publish(MODEL, weights(2), files=side_files(2))
    # What an older version's in-place removal left when killed: some files gone.
    snapshot = next(root.glob(f"models--*/snapshots/{first}"))
    for path in sorted(snapshot.rglob("*.json"))[: SIDE_FILES // 2]:
        path.unlink()
    with serve(root, allow_publish=True) as srv, Client(srv.http_url) as c:
        assert_served_whole(c, root, first)


def test_a_pull_of_a_revision_that_loses_files_fails_naming_them(tmp_path: Path) -> None:
    commit = "a" * 40
    root = tmp_path / "root"
    snapshot = root / "models--org--m" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "models--org--m" / "refs").mkdir()
    (root / "models--org--m" / "refs" / "main").write_text(commit)
    save_file({"w": np.ones(1 << 20, np.float32)}, str(snapshot / "model.safetensors"))
    for i in range(20):
        (snapshot / f"side{i:02d}.json").write_text(json.dumps({"i": i}))
    with serve(root) as srv, Client(srv.http_url) as c:
        model = c.model(f"org/m@{commit}")
        assert len(model.files()) == 21
        cut: list[int] = []

        def remove_files(n: int) -> None:  # after the first bytes: 12 files go on the server
            if not cut:
                cut.append(n)
                for i in range(8, 20):
                    (snapshot / f"side{i:02d}.json").unlink()
                srv.rescan()

        with pytest.raises(RevisionNotFound, match="listed 21") as raised:
            model.download(tmp_path / "out", on_bytes=remove_files)
        assert cut and "side08.json" in str(raised.value)
