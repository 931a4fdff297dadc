"""The parts of the vLLM plugin that need no vLLM: where an engine's weights come from
(``ServedSource``), a patch's positions mapped into a tensor-parallel rank's slice, and a
slice placed back in a whole tensor. tests/e2e/test_vllm.py runs the whole plugin in vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from weightserve.client.vllm.shards import RankSlice, placed_in_whole, sliced_positions
from weightserve.client.vllm.source import ServedSource, SourceError


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("part", [0, 1, 2])
def test_a_patch_lands_on_the_same_elements_of_a_slice_as_of_the_whole(axis, part) -> None:
    rng = np.random.default_rng(part)
    shape = (6, 9)
    whole = rng.standard_normal(shape).astype(np.float32)
    rank_slice = RankSlice(axis, part, 3)
    start, stop = rank_slice.bounds(shape[axis])
    piece = np.take(whole, np.arange(start, stop), axis=axis).copy()

    positions = np.sort(rng.choice(whole.size, 20, replace=False)).astype(np.int64)
    values = rng.standard_normal(20).astype(np.float32)
    patched_whole = whole.copy()
    patched_whole.reshape(-1)[positions] = values

    which, local = sliced_positions(positions, shape, rank_slice)
    piece.reshape(-1)[local] = values[which]
    assert np.array_equal(piece, np.take(patched_whole, np.arange(start, stop), axis=axis))
    assert 0 < which.sum() < len(positions)  # some fall in this slice, some elsewhere


def test_a_slice_goes_back_where_it_lies_in_the_whole() -> None:
    torch = pytest.importorskip("torch")
    part = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    whole = placed_in_whole(part, (6, 6), RankSlice(0, 1, 3))
    assert torch.equal(whole[2:4], part)
    assert not whole[:2].any() and not whole[4:].any()


def config(model: str = "smollm2", revision: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(model=model, revision=revision)


def test_the_source_comes_from_the_extra_config_first(monkeypatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://hub:1")
    monkeypatch.setenv("WEIGHTSERVE_TOKEN", "from-env")
    extra = {"url": "http://weights:8080", "model": "other", "revision": "abc", "token": "t"}
    assert ServedSource.from_config(extra, config()) == ServedSource(
        "http://weights:8080", "other", "abc", "t"
    )


def test_the_source_falls_back_to_hf_endpoint_and_vllms_model(monkeypatch) -> None:
    monkeypatch.delenv("WEIGHTSERVE_URL", raising=False)
    monkeypatch.delenv("WEIGHTSERVE_TOKEN", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:8080")
    monkeypatch.setenv("HF_TOKEN", "hub-token")
    source = ServedSource.from_config({}, config("org/model", "c0ffee"))
    assert source == ServedSource("http://127.0.0.1:8080", "org/model", "c0ffee", "hub-token")
    # A model URL names the model; ID@REV in it pins the revision.
    monkeypatch.setenv("WEIGHTSERVE_URL", "http://w:1/v1/models/served@main")
    assert ServedSource.from_config({}, config()).model == "served"
    assert ServedSource.from_config({}, config()).revision == "main"


def test_a_source_that_names_no_server_or_model_is_refused(monkeypatch, tmp_path) -> None:
    for name in ("WEIGHTSERVE_URL", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SourceError, match="needs the server"):
        ServedSource.from_config({}, config())
    with pytest.raises(SourceError, match="local directory"):
        ServedSource.from_config({"url": "http://w:1"}, config(str(tmp_path)))
    with pytest.raises(SourceError, match="takes url, model, revision, token"):
        ServedSource.from_config({"url": "http://w:1", "adress": "x"}, config())
