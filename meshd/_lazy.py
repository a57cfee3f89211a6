"""Packages whose public names load on first use (PEP 562).

A package ``__init__`` that imports every name it re-exports makes each
import of any of its modules pay for all of them: ``meshctl`` needs a few
modules of :mod:`meshd.client` and the RPC frames, and importing them through
eager ``__init__`` files loaded the daemon, aioquic, every service and trio
(0.7 s before a command did anything).  With :func:`lazy_exports`, a name
is imported from its module the first time it is asked for.
"""

from __future__ import annotations

import importlib
from typing import Callable


def lazy_exports(package: str, sources: dict[str, list[str]]) -> tuple[Callable, Callable, list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package``, whose public names
    live in the modules ``sources`` maps them from (relative names: ``".client"``).

    The package also imports the same names under ``TYPE_CHECKING``, for type
    checkers and import-linter; ``tests/unit/meshd/test_lazy_imports.py``
    checks that both say the same."""
    module_of = {name: module for module, names in sources.items() for name in names}

    def __getattr__(name: str) -> object:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(importlib.import_module(package), name, value)  # later lookups skip this
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(importlib.import_module(package)), *module_of})

    return __getattr__, __dir__, sorted(module_of)
