"""``python -m bench.scaling``: perf samples are sorted by whether they held the GIL, and a
tiny run goes end to end (no timing assertions: every point ran and produced numbers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.scaling import classify
from tests.support.paths import REPO

# Samples as ``perf script -F ip,sym,dso`` printed them for the bench server.
WRITEV = """
\tffffffff81b6a534 _copy_from_iter ([kernel.kallsyms])
\tffffffff8200ec5b tcp_sendmsg ([kernel.kallsyms])
\tffffffff816b826c do_writev ([kernel.kallsyms])
\tffffffff821ed511 do_syscall_64 ([kernel.kallsyms])
\tffffffff81000130 entry_SYSCALL_64_after_hwframe ([kernel.kallsyms])
\t           fde9d __GI___writev (/usr/lib/x86_64-linux-gnu/libc.so.6)
\t    7f89e004ca80 [unknown] ([unknown])
"""
SENDFILE_IRQ = """
\tffffffff82034775 tcp_v4_rcv ([kernel.kallsyms])
\tffffffff8136013d handle_softirqs ([kernel.kallsyms])
\tffffffff81000e06 asm_sysvec_apic_timer_interrupt ([kernel.kallsyms])
\tffffffff821ed4e6 do_syscall_64 ([kernel.kallsyms])
\tffffffff81000130 entry_SYSCALL_64_after_hwframe ([kernel.kallsyms])
\t          11a3be sendfile64 (/usr/lib/x86_64-linux-gnu/libc.so.6)
"""
FUTEX = """
\tffffffff8145a0b1 futex_wait ([kernel.kallsyms])
\tffffffff81459a2e __x64_sys_futex ([kernel.kallsyms])
\tffffffff821ed511 do_syscall_64 ([kernel.kallsyms])
\tffffffff81000130 entry_SYSCALL_64_after_hwframe ([kernel.kallsyms])
\t           91f1d __futex_abstimed_wait_common (/usr/lib/x86_64-linux-gnu/libc.so.6)
"""
MMAP = """
\tffffffff8160f2f3 __mmap_region ([kernel.kallsyms])
\tffffffff821ed511 do_syscall_64 ([kernel.kallsyms])
\tffffffff81000130 entry_SYSCALL_64_after_hwframe ([kernel.kallsyms])
\t          1019b3 __mmap (/usr/lib/x86_64-linux-gnu/libc.so.6)
"""
INTERPRETER = """
\t          1c2d0f _PyEval_EvalFrameDefault+0x1f (/usr/lib/libpython3.11.so.1.0)
\t    7f89e004ca80 [unknown] ([unknown])
"""
PAGE_FAULT = """
\tffffffff815ec9d0 handle_mm_fault ([kernel.kallsyms])
\tffffffff81000c82 asm_exc_page_fault ([kernel.kallsyms])
\t          1c2d0f _PyEval_EvalFrameDefault (/usr/lib/libpython3.11.so.1.0)
"""


def test_samples_sorted_by_the_gil() -> None:
    assert classify(WRITEV) == "released:writev"
    assert classify(SENDFILE_IRQ) == "released:sendfile64"  # an interrupt inside the call
    assert classify(FUTEX) == "gil_wait"
    assert classify(MMAP) == "held:sys_mmap"  # mmap.mmap() keeps the GIL
    assert classify(INTERPRETER) == "held:user:libpython3.11.so.1.0"
    assert classify(PAGE_FAULT) == "held:page_fault"


@pytest.mark.slow
def test_scaling_quick(tmp_path: Path) -> None:
    out = tmp_path / "scaling.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    args = ["--size-gib", "0.001", "--clients", "1,2", "--rounds", "1", "--chunk-mib", "1"]
    args += ["--server-cpus", "1", "--pinned-clients", "1", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.scaling", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads(out.read_text())
    assert set(results["points"]) == {"1", "2"}
    for point in [*results["points"].values(), *results["chunks"]["1"]["points"].values()]:
        for side in ("raw_mmap", "raw_sendfile", "http"):
            assert point[side]["gbps"] > 0 and point[side]["server_cpu_s_per_gib"] >= 0, side
        assert point["ratio_to_raw"] > 0
    assert set(results["pinned"]["1"]["points"]) == {"1"}
    # GIL shares where perf could record this machine (root or a permissive paranoid level).
    # (A tiny load may end before perf takes a sample: those points count none.)
    for shares in results.get("gil", {}).values():
        assert shares["samples"] == 0 or 0 <= shares["held_share"] <= 1
