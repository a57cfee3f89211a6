"""The daemon's heap, kept out of the garbage collector's full passes.

A full collection walks every object the process holds.  What a daemon
makes at start (modules, classes, its config) lives as long as it does, yet
was walked every time: 33-40 ms in one go under the abuse test.  So once
the node is up, :func:`settle` collects and freezes what is left
(``gc.freeze``: later collections skip it).  A service that imports a large
library later (a learning session or a served expert imports torch: 190,000
objects, a 100 ms full collection) brings many new long-lived objects:
:func:`refreeze_after_imports` settles the heap again once the modules
loaded have grown by ``growth``.  Only ``meshd start`` does this; a node
opened inside a script leaves the script's heap alone (docs/performance.md).
"""

from __future__ import annotations

import gc
import sys

import trio

GROWTH = 50  # modules imported since the last freeze that make it worth another
EVERY = 10.0  # seconds between looks


def settle() -> None:
    """Collect what is garbage now, then leave everything alive out of later collections."""
    gc.collect()
    gc.freeze()


def settle_if_grown(settled_at: int, growth: int = GROWTH) -> int:
    """:func:`settle` if ``growth`` or more modules were loaded since there were
    ``settled_at``; the module count the next look compares with."""
    if len(sys.modules) - settled_at < growth:
        return settled_at
    settle()
    return len(sys.modules)


async def refreeze_after_imports(every: float = EVERY, growth: int = GROWTH) -> None:
    """Every ``every`` seconds, :func:`settle_if_grown` (runs until cancelled)."""
    settled_at = len(sys.modules)
    while True:
        await trio.sleep(every)
        settled_at = settle_if_grown(settled_at, growth)
