"""The delta diff's paths (client/wire/delta_plan.py): the native one pass of
client/wire/_diffnative.c as installed (SSE2 compares on x86-64), the same built with its
portable word-at-a-time compare (what other machines run), and NumPy's. Each finds what an independent reference finds (NumPy's
whole-tensor compare) for every element size, on empty tensors, with nothing, some or every
element changed, with the limit passed by one or met exactly, across compare chunks and in
buffers at odd addresses; and both plan every tensor byte for byte alike.

The native path is skipped only where the extension was not built; where a C compiler exists
it must have been (the install builds it), or the first test fails."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sysconfig
from collections.abc import Iterator
from types import ModuleType

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.native import c_compiler, printed_with_native_setting
from tests.support.paths import REPO
from weightserve.client.wire import delta_plan
from weightserve.client.wire.delta_plan import (
    COMPARE_CHUNK,
    CPU_BOUND_BYTES,
    DeltaEntry,
    changed_elements,
    plan_delta,
)

NATIVE_MODULE = "weightserve.client.wire._diffnative"
SOURCE = REPO / "client" / "wire" / "_diffnative.c"
BUILT = importlib.util.find_spec(NATIVE_MODULE) is not None
UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# The ``native`` fixture is set up once per test, not per example: nothing in it changes.
PROPERTY = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="session")
def portable_module(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """The extension built with -DDIFFNATIVE_PORTABLE: the word-at-a-time compare that
    machines without SSE2 run, which the installed (SSE2) build never takes on x86-64."""
    compiler = c_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    out = (
        tmp_path_factory.mktemp("portable") / f"_diffnative{sysconfig.get_config_var('EXT_SUFFIX')}"
    )
    command = [compiler, "-shared", "-fPIC", "-O3", "-Wall", "-DDIFFNATIVE_PORTABLE",
               f"-I{sysconfig.get_paths()['include']}", str(SOURCE), "-o", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    loader = importlib.machinery.ExtensionFileLoader("_diffnative", str(out))
    spec = importlib.util.spec_from_file_location("_diffnative", out, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@pytest.fixture(params=["numpy", "native", "portable"])
def native(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Each path of the diff: NumPy's (False), the installed extension (True), and the
    extension's portable compare (True, with that build in its place)."""
    if request.param == "numpy":
        yield False
        return
    if request.param == "native":
        if not BUILT:
            pytest.skip("extension not built")
        yield True
        return
    module = request.getfixturevalue("portable_module")
    installed = delta_plan._diffnative
    delta_plan._diffnative = module
    try:
        yield True
    finally:
        delta_plan._diffnative = installed


def reference(
    old: np.ndarray, new: np.ndarray, limit: int | None
) -> tuple[np.ndarray, np.ndarray] | None:
    """What ``changed_elements`` answers, the plain way: every index at once."""
    indices = np.flatnonzero(old != new)
    if limit is not None and indices.size > limit:
        return None
    gaps = np.diff(indices, prepend=0)
    widest = int(gaps.max()) if gaps.size else 0
    gap_type = next(t for t in (np.uint8, np.uint16, np.uint32) if widest <= np.iinfo(t).max)
    return gaps.astype(gap_type), new[indices]


def assert_same(
    found: tuple[np.ndarray, np.ndarray] | None, expected: tuple[np.ndarray, np.ndarray] | None
) -> None:
    if expected is None:
        assert found is None
        return
    assert found is not None
    for got, want in zip(found, expected, strict=True):
        assert got.dtype == want.dtype
        assert got.tobytes() == want.tobytes()


def at_offset(array: np.ndarray, offset: int) -> np.ndarray:
    """A copy of ``array`` whose data starts ``offset`` bytes past an aligned address."""
    raw = bytearray(array.nbytes + offset)
    placed = np.frombuffer(raw, dtype=array.dtype, count=array.size, offset=offset)
    placed[...] = array
    return placed


def changed_copy(old: np.ndarray, indices: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``old`` with each element at ``indices`` changed (XOR with a nonzero pattern)."""
    new = old.copy()
    unsigned = new.view(UNSIGNED[new.itemsize])
    top = np.iinfo(unsigned.dtype).max
    unsigned[indices] ^= rng.integers(1, top, indices.size, dtype=unsigned.dtype, endpoint=True)
    return new


def test_the_extension_is_built_where_a_c_compiler_exists() -> None:
    compiler = c_compiler()
    if compiler is None:
        pytest.skip("no C compiler: the install leaves the extension out and NumPy diffs")
    assert BUILT, (
        f"{compiler} exists but {NATIVE_MODULE} is not built: pip install -e . builds it "
        "(its errors show with pip install -v)"
    )
    forced_off = os.environ.get("WEIGHTSERVE_NATIVE") == "0"
    assert delta_plan.NATIVE is not forced_off


@pytest.mark.parametrize("setting", [None, "0", "1"])
def test_weightserve_native_picks_the_path_at_import(setting: str | None) -> None:
    code = "from weightserve.client.wire import delta_plan; print(delta_plan.NATIVE)"
    assert printed_with_native_setting(code, setting) == str(BUILT and setting != "0")


def test_asking_for_the_native_path_without_the_extension_says_so() -> None:
    if BUILT:
        pytest.skip("the extension is built")
    with pytest.raises(RuntimeError, match="not built"):
        changed_elements(np.zeros(4, np.uint8), np.ones(4, np.uint8), native=True)


@st.composite
def diffs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int | None]:
    """Two tensors of one integer dtype (signed too), changed nowhere, everywhere, at drawn
    indices or at a drawn density, at any byte offset, and a limit around the change count."""
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    dtype = np.dtype(draw(st.sampled_from(["u", "i"])) + str(itemsize))
    size = draw(st.integers(0, 700))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    old = rng.integers(0, 256, size * itemsize, dtype=np.uint8).view(dtype)
    how = draw(st.sampled_from(["none", "all", "indices", "density"]))
    if how == "none" or size == 0:
        indices = np.empty(0, dtype=np.intp)
    elif how == "all":
        indices = np.arange(size)
    elif how == "indices":
        chosen = draw(st.sets(st.integers(0, size - 1), max_size=40))
        indices = np.array(sorted(chosen), dtype=np.intp)
    else:
        indices = np.flatnonzero(rng.random(size) < draw(st.sampled_from([0.01, 0.04, 0.3])))
    new = changed_copy(old, indices, rng)
    limit = draw(st.none() | st.integers(max(0, indices.size - 2), indices.size + 2))
    offsets = st.integers(0, 7)
    return at_offset(old, draw(offsets)), at_offset(new, draw(offsets)), limit


@PROPERTY
@given(case=diffs())
def test_both_paths_find_what_the_reference_finds(
    native: bool, case: tuple[np.ndarray, np.ndarray, int | None]
) -> None:
    old, new, limit = case
    hasher = xxhash.xxh3_128()
    found = changed_elements(old, new, limit, hasher, native=native)
    assert_same(found, reference(old, new, limit))
    if found is not None:  # the whole tensor was compared: its digest is whole too
        assert hasher.hexdigest() == xxhash.xxh3_128_hexdigest(new.tobytes())


def large_changes(size: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Indices of changes across compare chunks, each an edge of the chunked compare."""
    chunk = COMPARE_CHUNK
    sparse = chunk + rng.choice(chunk, 300, replace=False)
    return {
        "none": np.empty(0, dtype=np.intp),
        "one whole chunk": np.arange(chunk, 2 * chunk),
        "both sides of a boundary": np.array([chunk - 1, chunk, 2 * chunk - 1, 2 * chunk]),
        "sparse, then the last element": np.concatenate([np.sort(sparse), [size - 1]]),
        "only the last element": np.array([size - 1]),
        "every element": np.arange(size),
        "two percent": np.flatnonzero(rng.random(size) < 0.02),
    }


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_tensors_larger_than_a_compare_chunk(native: bool, itemsize: int) -> None:
    rng = np.random.default_rng(itemsize)
    size = 2 * COMPARE_CHUNK + 77  # a partial last chunk, and a partial last block
    dtype = UNSIGNED[itemsize]
    old = rng.integers(0, np.iinfo(dtype).max, size, dtype=dtype, endpoint=True)
    for name, indices in large_changes(size, rng).items():
        new = changed_copy(old, indices, rng)
        hasher = xxhash.xxh3_128()
        for limit in (None, size // 2):
            found = changed_elements(
                old, new, limit, hasher if limit is None else None, native=native
            )
            assert_same(found, reference(old, new, limit))
        assert hasher.hexdigest() == xxhash.xxh3_128_hexdigest(new.tobytes()), name


@pytest.mark.parametrize(
    "where",
    [
        "first chunk",  # passed in the middle of the first chunk
        "second chunk",  # passed where the first chunk stayed under it
        "last element",  # passed only by the tensor's very last element
    ],
)
def test_the_limit_is_met_exactly_or_passed_by_one(native: bool, where: str) -> None:
    rng = np.random.default_rng(7)
    size = 2 * COMPARE_CHUNK + 5
    old = rng.integers(0, 2**16, size, dtype=np.uint16)
    limit = 1000
    if where == "first chunk":
        indices = np.sort(rng.choice(COMPARE_CHUNK, limit + 1, replace=False))
    elif where == "second chunk":
        indices = np.sort(COMPARE_CHUNK // 2 + rng.choice(COMPARE_CHUNK, limit + 1, replace=False))
    else:
        indices = np.concatenate([np.sort(rng.choice(size - 1, limit, replace=False)), [size - 1]])
    new = changed_copy(old, indices, rng)
    assert changed_elements(old, new, limit, native=native) is None
    found = changed_elements(old, new, limit + 1, native=native)
    assert_same(found, reference(old, new, limit + 1))
    assert found is not None and found[1].size == limit + 1
    # Met exactly: one change fewer is within the limit.
    fewer = new.copy()
    fewer[indices[-1]] = old[indices[-1]]
    assert_same(changed_elements(old, fewer, limit, native=native), reference(old, fewer, limit))


def test_more_changes_than_the_first_buffers_hold(native: bool) -> None:
    """The native path starts with buffers for a sixteenth of the tensor (at least a chunk's
    elements) and grows them: 40 % changed, under a limit of half, outgrows them."""
    rng = np.random.default_rng(8)
    size = 3 * COMPARE_CHUNK
    old = rng.integers(0, 2**32, size, dtype=np.uint32)
    new = changed_copy(old, np.flatnonzero(rng.random(size) < 0.4), rng)
    for limit in (None, size // 2):
        assert_same(changed_elements(old, new, limit, native=native), reference(old, new, limit))


def test_arrays_the_native_pass_does_not_take_are_diffed_alike(native: bool) -> None:
    """Strided views and float arrays (NumPy compares floats by value: -0.0 equals 0.0, NaN
    equals nothing) go NumPy's way whatever was asked."""
    rng = np.random.default_rng(9)
    old = rng.integers(0, 2**16, 2000, dtype=np.uint16)
    new = changed_copy(old, np.arange(0, 2000, 7), rng)
    strided_old, strided_new = old[::3], new[::3]
    assert not strided_new.flags.c_contiguous
    assert_same(
        changed_elements(strided_old, strided_new, native=native),
        reference(strided_old, strided_new, None),
    )
    floats_old = np.array([0.0, 1.0, np.nan, 2.0], dtype=np.float32)
    floats_new = np.array([-0.0, 1.5, np.nan, 2.0], dtype=np.float32)
    assert_same(
        changed_elements(floats_old, floats_new, native=native),
        reference(floats_old, floats_new, None),
    )


def plan(new: bytes | memoryview, old: bytes | memoryview | None, size: int, native: bool):
    """``plan_delta`` of a tensor given as bytes, as (header, payload bytes)."""
    new_view = memoryview(new).cast("B")
    old_view = None if old is None else memoryview(old).cast("B")
    entry: DeltaEntry = plan_delta(
        "t", "uint8", [new_view.nbytes], new_view, old_view, size, native=native
    )
    return entry.header, tuple(bytes(piece) for piece in entry.payload)


def plan_cases() -> dict[str, tuple[bytes, bytes | None, int]]:
    """Tensors as bytes (new, old, element size) covering every branch of ``plan_delta``."""
    rng = np.random.default_rng(10)
    small = rng.integers(0, 2**16, 500, dtype=np.uint16)
    large = rng.integers(0, 2**16, CPU_BOUND_BYTES, dtype=np.uint16)  # 2x CPU_BOUND_BYTES
    odd = rng.integers(0, 256, 4 * 1000 + 3, dtype=np.uint8)  # a 3-byte tail of 4-byte elements
    odd_tail_changed = odd.copy()
    odd_tail_changed[-1] ^= 1
    odd_body_changed = odd.copy()
    odd_body_changed[[5, 400, 3999]] ^= 1
    cases: dict[str, tuple[bytes, bytes | None, int]] = {
        "no old tensor": (small.tobytes(), None, 2),
        "empty": (b"", b"", 2),
        "none changed": (small.tobytes(), small.tobytes(), 2),
        "all changed": (changed_copy(small, np.arange(500), rng).tobytes(), small.tobytes(), 2),
        "a few changed": (
            changed_copy(small, np.arange(0, 500, 37), rng).tobytes(),
            small.tobytes(),
            2,
        ),
        "tail changed": (odd_tail_changed.tobytes(), odd.tobytes(), 4),
        "body changed, tail not": (odd_body_changed.tobytes(), odd.tobytes(), 4),
    }
    for share in (0.01, 0.02, 0.04, 0.3, 0.6):
        changed = np.flatnonzero(rng.random(large.size) < share)
        cases[f"large, {share:.0%} changed"] = (
            changed_copy(large, changed, rng).tobytes(),
            large.tobytes(),
            2,
        )
    for itemsize in (1, 4, 8):
        base = rng.integers(0, 256, 8 * 3000, dtype=np.uint8).view(UNSIGNED[itemsize])
        changed = changed_copy(base, np.flatnonzero(rng.random(base.size) < 0.03), rng)
        cases[f"{itemsize}-byte elements"] = (changed.tobytes(), base.tobytes(), itemsize)
    return cases


@pytest.mark.skipif(not BUILT, reason="extension not built")
@pytest.mark.parametrize("name", list(plan_cases()))
def test_both_paths_plan_a_tensor_byte_for_byte_alike(name: str) -> None:
    new, old, size = plan_cases()[name]
    numpy_plan = plan(new, old, size, native=False)
    assert plan(new, old, size, native=True) == numpy_plan
    # At an odd address (a tensor inside a mapped file need not be aligned): the same plan.
    shifted_new = at_offset(np.frombuffer(new, np.uint8), 3)
    shifted_old = None if old is None else at_offset(np.frombuffer(old, np.uint8), 5)
    assert (
        plan(shifted_new.data, None if shifted_old is None else shifted_old.data, size, True)
        == numpy_plan
    )


@pytest.mark.skipif(not BUILT, reason="extension not built")
def test_the_native_pass_refuses_what_it_cannot_read() -> None:
    from weightserve.client.wire import _diffnative

    old = np.zeros(64, np.uint16)
    new = np.ones(64, np.uint16)
    gaps = np.zeros(64, np.uint32)
    values = np.zeros(64, np.uint16)

    def diff(*changed: tuple[int, object]) -> tuple[int, int, int, int]:
        args: list[object] = [old, new, 2, 0, 64, gaps, 4, values, 0, 0]
        for position, value in changed:
            args[position] = value
        result: tuple[int, int, int, int] = _diffnative.diff(*args)
        return result

    assert diff() == (64, 64, 63, 1)
    assert gaps.tolist() == [0] + [1] * 63 and values.tolist() == [1] * 64
    assert diff((9, 5), (3, 6), (8, 0)) == (58, 64, 63, 1)  # resumed after index 5
    with pytest.raises(ValueError, match="element_size"):
        diff((2, 3))
    with pytest.raises(ValueError, match="gap_size"):
        diff((6, 2))
    with pytest.raises(ValueError, match="one length"):
        diff((1, new[:63]))
    with pytest.raises(ValueError, match="not within"):
        diff((4, 65))
    with pytest.raises(ValueError, match="out of range"):
        diff((9, 1))  # a previous change after the start
    with pytest.raises(ValueError, match="out of range"):
        diff((8, 65))  # more written than the buffers hold
    with pytest.raises((ValueError, BufferError)):
        diff((1, np.ones(128, np.uint16)[::2]))  # not contiguous
    with pytest.raises((ValueError, BufferError, TypeError)):
        diff((5, bytes(256)))  # not writable
    with pytest.raises(TypeError):
        diff((3, "0"))
    # Buffers that fill stop the pass at the element after the last one written.
    assert diff((5, np.zeros(10, np.uint32))) == (10, 10, 9, 1)
