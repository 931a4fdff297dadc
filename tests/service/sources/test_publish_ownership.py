"""Publish owns only what it wrote: a Hugging Face cache repository under the root (refs,
snapshots linking into blobs, no ``.revisions/`` record) is refused as a publish target, and
its snapshot and blobs stay where they were."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.support.publishing import serve
from weightserve.client._client import Client
from weightserve.client.errors import InvalidRequest

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache_repository(root: Path) -> Path:
    """``models--acme--tiny`` as huggingface_hub writes it: a blob, a snapshot linking it."""
    repo = root / "models--acme--tiny"
    (repo / "blobs").mkdir(parents=True)
    blob = repo / "blobs" / ("a" * 64)
    save_file({"w": np.arange(16, dtype=np.float32)}, str(blob))
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    os.symlink(os.path.relpath(blob, snapshot), snapshot / "model.safetensors")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return repo


def test_a_hub_cache_repository_is_not_taken_over_by_a_publish(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    repo = hub_cache_repository(root)
    before = sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*"))
    with serve(root, allow_publish=True, keep_revisions=1) as srv, Client(srv.http_url) as c:
        served = c.model("acme/tiny").commit
        for _ in range(2):  # a second publish would have made retention remove the snapshot
            with pytest.raises(InvalidRequest, match="did not write"):
                c.publish("acme/tiny", {"w": np.zeros(16, dtype=np.float32)})
        assert c.model("acme/tiny").commit == served
        assert np.array_equal(c.model("acme/tiny").fetch()["w"], np.arange(16.0))
    assert sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*")) == before
    assert (repo / "refs" / "main").read_text() == COMMIT
