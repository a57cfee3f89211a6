"""The daemon's heap: frozen once up, and again after large imports (cli/heap.py)."""

import gc
import sys
import types

from cli import heap


def test_settle_leaves_what_is_alive_out_of_later_collections():
    kept = [object() for _ in range(10)]
    gc.unfreeze()
    try:
        heap.settle()
        assert gc.get_freeze_count() >= len(kept)
        assert gc.get_count()[0] < 10  # and the young generation was just collected
    finally:
        gc.unfreeze()


def test_the_heap_is_settled_again_once_enough_modules_were_loaded(monkeypatch):
    settled = []
    monkeypatch.setattr(heap, "settle", lambda: settled.append(len(sys.modules)))
    start = len(sys.modules)
    assert heap.settle_if_grown(start, 3) == start and settled == []  # no module loaded since
    for i in range(3):
        monkeypatch.setitem(sys.modules, f"_heap_test_{i}", types.ModuleType(f"_heap_test_{i}"))
    assert heap.settle_if_grown(start, 3) == start + 3 and settled == [start + 3]
    assert heap.settle_if_grown(start + 3, 3) == start + 3 and len(settled) == 1  # not again until more come
