"""An expert from files, for ``meshctl experts serve``: a factory's module, its weights loaded safely.

A factory is named ``MODULE:NAME``: ``MODULE`` a dotted module name
(``pkg.models``, imported with ``search`` dirs, meshctl's working directory,
ahead of the daemon's path while it is imported) or a ``.py`` file (an
absolute path; loaded afresh each time), ``NAME`` a callable in it (dotted
for an attribute of an attribute).  It is called with ``kwargs`` and returns
the module to serve.  Weights come from a ``.safetensors`` file (the
``safetensors`` package) or from a ``torch.save`` file read with
``torch.load(weights_only=True)``: never unpickled, so a weights file cannot
run code.  The factory's code does run, in this process: naming it is the
same as running it, which only the daemon's own user may ask (the control
socket is theirs alone).  Torch is imported by these functions, so a daemon
that never serves from files never loads it.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import os
import re
import sys
import threading

_IMPORT_LOCK = threading.Lock()  # sys.path is changed while a dotted factory module is imported
_FILE_MODULES = itertools.count()
_SPEC = re.compile(r"^(?P<module>.+?):(?P<name>[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*)$")


class LoadError(ValueError):
    """The factory or the weights could not give a module (the message says which, and why, on one line)."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split())[:500])


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def parse_factory(spec: str) -> tuple[str, str]:
    """``(module, name)`` from ``MODULE:NAME``; LoadError if it is not one."""
    match = _SPEC.match(spec) if isinstance(spec, str) else None
    if match is None:
        raise LoadError(f"a factory is MODULE:NAME (pkg.models:make or /path/to/models.py:make), not {spec!r:.200}")
    return match["module"], match["name"]


def is_file_module(module: str) -> bool:
    """Whether a factory's MODULE names a ``.py`` file rather than a dotted module."""
    return module.endswith(".py") or os.sep in module


def find_factory(spec: str, search: list[str] = ()):
    """The callable ``spec`` (``MODULE:NAME``) names; LoadError naming what went wrong."""
    module_name, name = parse_factory(spec)
    try:
        if is_file_module(module_name):
            if not os.path.isabs(module_name):
                raise LoadError(f"a factory's file is an absolute path, not {module_name!r:.200}")
            if not os.path.isfile(module_name):
                raise LoadError(f"no factory file {module_name!r:.200}")
            unique = f"_meshd_expert_factory_{next(_FILE_MODULES)}"
            loader_spec = importlib.util.spec_from_file_location(unique, module_name)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[unique] = module  # dataclasses and the like look their module up
            try:
                loader_spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[unique]
                raise
        else:
            with _IMPORT_LOCK:
                added = [d for d in search if isinstance(d, str) and os.path.isabs(d) and d not in sys.path]
                sys.path[:0] = added
                try:
                    module = importlib.import_module(module_name)
                finally:
                    for d in added:
                        sys.path.remove(d)
    except LoadError:
        raise
    except Exception as exc:  # the module's own code failed, or it is not there
        raise LoadError(f"importing {module_name!r:.200} failed: {_why(exc)}") from None
    target = module
    for part in name.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise LoadError(f"{module_name!r:.200} has no {name!r}")
    if not callable(target):
        raise LoadError(f"{spec!r:.200} is not callable")
    return target


def load_weights(path: str) -> dict:
    """The tensors of a weights file, by name, on the CPU: ``.safetensors``, or a
    ``torch.save`` file of a state_dict (or of ``{"state_dict": ...}``) read with
    ``weights_only=True``.  LoadError for anything else, or anything that would
    need unpickling."""
    import torch  # noqa: PLC0415  (only when serving from files)

    if not os.path.isfile(path):
        raise LoadError(f"no weights file {path!r:.200}")
    if path.endswith(".safetensors"):
        try:
            from safetensors.torch import load_file  # noqa: PLC0415
        except ImportError:
            raise LoadError("reading .safetensors needs the safetensors package where meshd runs "
                            "(pip install safetensors), or a torch.save file of the state_dict") from None
        try:
            state = load_file(path, device="cpu")
        except Exception as exc:
            raise LoadError(f"{os.path.basename(path)} is not a readable .safetensors file: {_why(exc)}") from None
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # the weights-only unpickler refused it, or it is not a torch file
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise LoadError(f"{os.path.basename(path)} is not a weights-only torch file "
                            f"(tensors in plain containers; nothing is unpickled): {first}") from None
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]
    if not isinstance(state, dict) or not state or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise LoadError(f"{os.path.basename(path)} holds no state_dict (a map of names to tensors)")
    return state


def load_module(factory: str, weights: str | None = None, *, kwargs: dict | None = None,
                search: list[str] = ()):
    """The module ``factory(**kwargs)`` returns, with the state_dict in ``weights``
    loaded into it (strictly: every name, every shape) if given, in eval mode.
    LoadError saying what went wrong.  Blocking: run it in a worker thread."""
    make = find_factory(factory, search)
    state = load_weights(weights) if weights is not None else None
    try:
        module = make(**(kwargs or {}))
    except Exception as exc:
        raise LoadError(f"the factory {factory!r:.200} failed: {_why(exc)}") from None
    if not callable(module):
        raise LoadError(f"the factory {factory!r:.200} gave {type(module).__name__}, not a module")
    if state is not None:
        if not hasattr(module, "load_state_dict"):
            raise LoadError(f"the factory gave {type(module).__name__}, which takes no weights")
        try:
            module.load_state_dict(state)
        except Exception as exc:  # names or shapes that do not match
            raise LoadError(f"the weights do not fit the factory's module: {exc}") from None
    if hasattr(module, "eval"):
        module.eval()
    return module
