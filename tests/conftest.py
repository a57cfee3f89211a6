"""Shared test set-up: helpers in tests/support/ import by plain name, and markers.

Layers, each runnable alone: ``tests/unit`` (no sockets, under a minute),
``tests/sim`` (sans-IO simulations too big for that minute), ``tests/node``
(in-process nodes on loopback), ``tests/daemon`` (real processes: ``meshd`` daemons, writers killed mid-write),
``tests/lab`` (network namespaces; needs root).
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "support"))

_LAYERS = ("unit", "sim", "node", "daemon", "lab")


def pytest_collection_modifyitems(config, items):
    """Mark each test with its layer (its folder under tests/): ``-m unit`` and so on."""
    root = Path(__file__).parent
    for item in items:
        parts = Path(str(item.fspath)).relative_to(root).parts
        if parts and parts[0] in _LAYERS:
            item.add_marker(getattr(pytest.mark, parts[0]))
