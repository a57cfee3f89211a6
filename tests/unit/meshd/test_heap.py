"""The daemon's heap: frozen once up, and again after large imports (cli/heap.py)."""

import gc
import sys
import types

import trio

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


async def test_the_heap_is_settled_again_once_enough_modules_were_loaded(autojump_clock, monkeypatch):
    settled = []
    monkeypatch.setattr(heap, "settle", lambda: settled.append(len(sys.modules)))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(heap.refreeze_after_imports, 1.0, 3)
        await trio.sleep(5)
        assert settled == []  # no module loaded since it started
        for i in range(3):
            monkeypatch.setitem(sys.modules, f"_heap_test_{i}", types.ModuleType(f"_heap_test_{i}"))
        await trio.sleep(1.5)
        assert len(settled) == 1
        await trio.sleep(5)
        assert len(settled) == 1  # not again until as many more come
        nursery.cancel_scope.cancel()
