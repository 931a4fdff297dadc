"""A stream's file checks and kept framing (service/serving/streams.py): chunks whose digest
is known are checked once per ``FileChecks.every_bytes`` (a ``sendfile`` writer's batch), not
per chunk, and a chunk sent before is framed from what was kept: the bytes stay those of a
cold stream, and an overwrite in place still cuts the stream at its next check."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from weightserve.client.errors import ModelUnavailable
from weightserve.service.serving.request import TensorRequest
from weightserve.service.serving.state import ServiceState
from weightserve.service.serving.streams import (
    FileMessage,
    MessageStream,
    plan_stream,
    stream_messages,
)
from weightserve.service.sources.local.catalog import Catalog

CHUNK = 1 << 20
NAME = "w"  # 8 MiB: eight chunks


def open_stream(root: Path) -> MessageStream:
    model = ServiceState(Catalog(root)).catalog.get("m")
    request = TensorRequest(names=(NAME,), chunk_bytes=CHUNK)
    return stream_messages(model, plan_stream(model, request), CHUNK)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "m").mkdir()
    weight = np.random.default_rng(5).standard_normal((2048, 1024), dtype=np.float32)
    save_file({NAME: weight}, str(tmp_path / "m" / "model.safetensors"))
    return tmp_path


def body(messages: MessageStream) -> bytes:
    return b"".join(bytes(part) for message in messages for part in message)


def overwritten_in_place(root: Path) -> None:
    path = root / "m" / "model.safetensors"
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_a_warm_stream_is_framed_from_what_was_kept_and_equals_a_cold_one(root: Path) -> None:
    model = ServiceState(Catalog(root)).catalog.get("m")
    request = TensorRequest(names=(NAME,), chunk_bytes=CHUNK)
    cold = stream_messages(model, plan_stream(model, request), CHUNK)
    cold_messages = list(cold)
    warm_messages = list(stream_messages(model, plan_stream(model, request), CHUNK))
    assert [bytes(p) for m in warm_messages for p in m] == [
        bytes(p) for m in cold_messages for p in m
    ]
    chunks = [m for m in warm_messages if isinstance(m, FileMessage)]
    assert len(chunks) == 8
    # The framing itself was reused, not built again.
    assert all(w[0] is c[0] for w, c in zip(chunks, cold_messages[1:-1], strict=True))


@pytest.mark.parametrize(("every_bytes", "taken_before_cut"), [(0, 1), (4 * CHUNK, 4)])
def test_an_overwrite_in_place_cuts_the_stream_at_its_next_check(
    root: Path, every_bytes: int, taken_before_cut: int
) -> None:
    model = ServiceState(Catalog(root)).catalog.get("m")
    request = TensorRequest(names=(NAME,), chunk_bytes=CHUNK)
    body(stream_messages(model, plan_stream(model, request), CHUNK))  # digests known
    messages = stream_messages(model, plan_stream(model, request), CHUNK)
    messages.checks.every_bytes = every_bytes
    next(messages)  # the schema
    next(messages)  # the first chunk: checked
    overwritten_in_place(root)
    taken = 1
    with pytest.raises(ModelUnavailable, match="overwritten in place"):
        while True:
            next(messages)
            taken += 1
    assert taken == taken_before_cut


def test_a_chunk_not_hashed_yet_is_checked_before_it_is_read(root: Path) -> None:
    messages = open_stream(root)
    messages.checks.every_bytes = 1 << 40  # as a sendfile writer sets it
    next(messages)
    next(messages)
    overwritten_in_place(root)
    with pytest.raises(ModelUnavailable, match="overwritten in place"):
        next(messages)  # its digest is not known: the file is checked before hashing


def test_a_link_made_and_removed_meanwhile_does_not_cut_a_held_stream(root: Path) -> None:
    """A revision links the file and retention removes that link: its ctime moved but its link
    count is back where it was. Under the stream's read lease a writer would have broken the
    lease, so that is links alone, not an overwrite."""
    model = ServiceState(Catalog(root)).catalog.get("m")
    request = TensorRequest(names=(NAME,), chunk_bytes=CHUNK)
    plan = plan_stream(model, request)
    path = root / "m" / "model.safetensors"
    with model.holding({p.entry.file for p in plan}):
        messages = stream_messages(model, plan, CHUNK)
        messages.checks.every_bytes = 0  # every chunk checked
        head = [next(messages), next(messages)]
        time.sleep(0.05)  # past the clock's tick: the ctime below differs from the mapped one
        os.link(path, root / "m" / "linked")
        os.unlink(root / "m" / "linked")
        assert path.stat().st_nlink == 1
        whole = b"".join(bytes(part) for message in [*head, *messages] for part in message)
    assert whole == body(open_stream(root))


def test_a_published_files_links_changing_do_not_cut_a_stream_without_a_lease(root: Path) -> None:
    """A hard-linked file (a published revision's, kept by the next) gains and loses links
    with no write: a stream that holds no lease (the handoff's checks) reads on."""
    path = root / "m" / "model.safetensors"
    os.link(path, root / "kept-by-another-revision")
    messages = open_stream(root)
    messages.checks.every_bytes = 0
    head = [next(messages), next(messages)]
    time.sleep(0.05)
    os.link(path, root / "m" / "linked")
    os.unlink(root / "m" / "linked")  # two links again, a new ctime
    whole = b"".join(bytes(part) for message in [*head, *messages] for part in message)
    assert whole == body(open_stream(root))
