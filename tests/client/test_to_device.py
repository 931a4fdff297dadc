"""``RemoteModel.to_device``: tensors into device memory through one staging ring, here with
the CPU as the device (tests/e2e/test_gpu.py runs the same on a GPU): every served dtype
byte-identical to the reference readers, the ring reused and never overwritten before its
copy, tensors larger than it given memory of their own, ``into`` written in place."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.support.publishing import serve
from weightserve.client._client import Client

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch


def raw(t) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("model_id", ["mixed", "tiny.gguf", "torch", "packed"])
def test_every_dtype_lands_byte_identical(server, model_root, reference, model_id) -> None:
    if model_id in model_root.skipped:
        pytest.skip(model_root.skipped[model_id])
    want = reference(model_id)
    with Client(server.http_url) as c:
        model = c.model(model_id)
        got = model.to_device("cpu")
    assert list(got) == list(model.names(""))
    for name, ref in want.items():
        t = got[name]
        assert raw(t) == np.ascontiguousarray(ref.array).tobytes(), name
        if ref.encoding is None and ref.dtype in ("bfloat16", "float8_e4m3fn", "float32"):
            assert str(t.dtype) == f"torch.{ref.dtype}" and tuple(t.shape) == ref.shape, name
        elif ref.encoding is not None:  # GGML blocks: their raw bytes, in their byte shape
            assert t.dtype == torch.uint8 and tuple(t.shape) == ref.shape, name
        if model_id == "packed":  # sub-byte types torch lacks: raw bytes, as fetch gives them
            assert t.dtype == torch.uint8 and t.dim() == 1, name


def test_a_small_ring_is_reused_and_large_tensors_get_their_own(server, reference) -> None:
    want = reference("mixed")
    sizes = sorted(r.array.nbytes for r in want.values())
    ring = sizes[-1] - 1  # the largest tensor does not fit; the others cycle through it
    with Client(server.http_url) as c:
        model = c.model("mixed")
        got = model.to_device("cpu", staging_bytes=ring)
    assert all(raw(got[n]) == np.ascontiguousarray(r.array).tobytes() for n, r in want.items())
    done = model.last_device_load
    copied = sum(1 for s in sizes if s)  # an empty tensor has nothing to copy
    # Regions start 64-byte aligned: the ring holds at most 3 at once, so it was reused.
    assert done["staged"] > ring // 64 + 1 and done["staged"] >= copied // 2
    assert done["unstaged"] >= 1
    assert done["staged"] + done["unstaged"] == copied


def test_a_same_node_handoff_is_copied_from_where_it_lies(model_root, reference) -> None:
    # The handoff gives views of the page cache: the device copy reads them there, never
    # first into buffers of their own or the ring.
    want = reference("mixed")
    with serve(model_root.path) as srv, Client(srv.http_url) as c:
        assert c.planes().handoff is not None
        model = c.model("mixed")
        got = model.to_device("cpu")
    assert all(raw(got[n]) == np.ascontiguousarray(r.array).tobytes() for n, r in want.items())
    assert model.last_device_load == {"staged": 0, "unstaged": sum(1 for r in want.values()
                                                                   if r.array.nbytes)}  # fmt: skip


def test_into_is_written_in_place_and_checked(server, reference) -> None:
    want = reference("org/sharded")
    with Client(server.http_url) as c:
        model = c.model("org/sharded")
        names = list(want)[:3]
        targets = {
            n: torch.zeros(want[n].shape, dtype=getattr(torch, want[n].dtype)) for n in names
        }
        # An engine's parameters: they require grad, and one is laid out column by column.
        targets[names[0]] = torch.nn.Parameter(targets[names[0]])
        if targets[names[1]].dim() == 2:
            targets[names[1]] = targets[names[1]].T.contiguous().T
        pointers = {n: t.data_ptr() for n, t in targets.items()}
        got = model.to_device("cpu", names, into=targets)
        for n in names:
            assert got[n] is targets[n] and targets[n].data_ptr() == pointers[n]
            assert raw(targets[n]) == np.ascontiguousarray(want[n].array).tobytes(), n
        # A wrong target is refused before any byte moves: the others stay as they were.
        fresh = {n: torch.zeros_like(targets[n]) for n in names[:1]}
        wrong = {**fresh, names[1]: torch.zeros(3, dtype=torch.float64)}
        with pytest.raises(ValueError, match=names[1]):
            model.to_device("cpu", names, into=wrong)
        assert not fresh[names[0]].any()
        # An error mid-load (a bad tensor on the consumer's side) closes the stream at once:
        # nothing is left receiving in the background.
        row = torch.zeros(want[names[1]].shape[-1], dtype=targets[names[1]].dtype)
        broken = {names[1]: row.expand(want[names[1]].shape)}  # one element, many places
        with pytest.raises(RuntimeError):
            model.to_device("cpu", names, into=broken, staging_bytes=64)  # receiver waits
        assert not [t for t in threading.enumerate() if t.name == "weightserve-iter"]


def test_a_prefix_and_names_choose_the_tensors(server, reference) -> None:
    want = reference("mixed")
    first = next(iter(want))
    with Client(server.http_url) as c:
        model = c.model("mixed")
        assert list(model.to_device("cpu", [first])) == [first]
        prefix = first[:1]
        assert set(model.to_device("cpu", prefix=prefix)) == {
            n for n in want if n.startswith(prefix)
        }
