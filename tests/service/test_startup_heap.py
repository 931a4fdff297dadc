"""``freeze_startup_heap`` (service/server.py), which ``weightserve serve`` calls once it is up:
what is garbage then is freed, not frozen; what is alive is left out of later collections;
garbage made afterwards is collected as before. In a fresh interpreter, so that this test
process's own heap is not frozen."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import gc, weakref
from weightserve.service.server import freeze_startup_heap

class Node:
    pass

def garbage_cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)

gc.disable()  # only the collections made here
before = garbage_cycle()
alive = Node()
alive.self = alive
freeze_startup_heap()
print(before() is None, gc.get_freeze_count() > 0)
after = garbage_cycle()
gc.collect()
print(after() is None)
"""


def test_the_startup_heap_is_frozen_after_its_garbage_is_freed() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "True"]
