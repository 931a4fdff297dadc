"""client/transports/malloc.py: when it tunes glibc, with what values, and when it stays out of the way.

The effect (page faults per GiB of a gRPC load) is measured by the benchmark
(docs/performance.md); here the control logic runs against a recording stand-in for libc,
and the values against the real glibc in a child process.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from weightserve.client.transports import malloc as _malloc


class RecordingLibc:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def mallopt(self, option: int, value: int) -> int:
        self.calls.append(("mallopt", option, value))
        return 1

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("malloc_trim", pad))
        return 1


@pytest.fixture
def libc(monkeypatch: pytest.MonkeyPatch) -> Iterator[RecordingLibc]:
    fake = RecordingLibc()
    monkeypatch.setattr(_malloc, "_libc", fake)
    monkeypatch.setattr(_malloc, "_active", 0)
    yield fake


def test_thresholds_raised_once_for_overlapping_loads(libc: RecordingLibc) -> None:
    during = [("mallopt", o, v) for o, v in _malloc._DURING.items()]
    after = [("mallopt", o, v) for o, v in _malloc._AFTER.items()] + [("malloc_trim", 0)]
    entered, release = threading.Event(), threading.Event()

    def second_stream() -> None:
        with _malloc.steady_heap():
            entered.set()
            release.wait(5)

    with _malloc.steady_heap():
        assert libc.calls == during
        worker = threading.Thread(target=second_stream)
        worker.start()
        assert entered.wait(5)
        assert libc.calls == during  # the second stream shares the window
    assert libc.calls == during  # one stream still running: nothing restored yet
    release.set()
    worker.join(5)
    assert libc.calls == during + after
    with _malloc.steady_heap():
        pass
    assert libc.calls == (during + after) * 2


def test_left_alone_when_turned_off_or_already_tuned(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (
        ("WEIGHTSERVE_MALLOC_TUNING", "0"),
        ("MALLOC_ARENA_MAX", "2"),
        ("MALLOC_TRIM_THRESHOLD_", "1048576"),
        ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536"),
    ):
        with monkeypatch.context() as m:
            m.setattr(_malloc, "_libc", False)  # look it up afresh
            m.setenv(name, value)
            if name == "MALLOC_ARENA_MAX":  # not a MALLOC_..._ variable: tuning goes ahead
                assert (_malloc._glibc() is not None) == _malloc._glibc_here()
            else:
                assert _malloc._glibc() is None, name


def test_real_glibc_accepts_the_values() -> None:
    """In a child process (the settings are process-wide): every mallopt call succeeds."""
    code = (
        "import ctypes, ctypes.util, sys\n"
        "from weightserve.client.transports import malloc as _malloc\n"
        "if not _malloc._glibc_here(): sys.exit(0)\n"
        "libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')\n"
        "values = list(_malloc._DURING.items()) + list(_malloc._AFTER.items())\n"
        "assert all(libc.mallopt(o, v) == 1 for o, v in values), values\n"
        "with _malloc.steady_heap():\n"
        "    blocks = [bytearray(2 << 20) for _ in range(8)]\n"
        "    del blocks\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("MALLOC_")}
    env.pop("GLIBC_TUNABLES", None)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() in ("ok", "")
