"""A declared set of named tensors, moved whole or in part: a training script and its daemon.

A training script that drives DiLoCo (or gossip) through a running daemon
declares its model's tensors once, as *specs*: name, dtype and shape per
tensor.  Every transfer after that, either way, is the :mod:`learn.wire`
frames of some of those tensors, uncompressed (codec ``none``: raw bytes),
and the receiver takes exactly those: each tensor named in the set, at most
once, with its declared dtype and shape, written straight into the buffer
the receiver keeps for it.  Anything else is a :class:`~learn.wire.WireError`
that names the tensor and what was expected.  Where the two share memory
instead, :func:`shadow_layout` places the declared tensors in the file both
map, from the specs alone.  No torch here.
"""

from __future__ import annotations

import math
from typing import Callable

from .encoded import ITEMSIZE
from .wire import Decoder, Limits, WireError

Specs = dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, shape), in the declared order


def check_specs(specs: object, limits: Limits = Limits(), *, dtypes: tuple[str, ...] = tuple(ITEMSIZE)) -> Specs:
    """``specs``, a list of ``[name, dtype, shape]``, as a :data:`Specs` map; WireError
    unless it is a non-empty list of at most ``limits.max_tensors`` distinct names of
    1 to ``limits.max_name`` characters, each with a dtype of ``dtypes`` and a shape
    of at most ``limits.max_dims`` non-negative integers, ``limits.max_bytes`` in all."""
    if not isinstance(specs, list) or not specs:
        raise WireError("the tensors are a non-empty list of [name, dtype, shape]")
    if len(specs) > limits.max_tensors:
        raise WireError(f"more than {limits.max_tensors} tensors")
    out: Specs = {}
    total = 0
    for spec in specs:
        if not isinstance(spec, (list, tuple)) or len(spec) != 3:
            raise WireError("each tensor is [name, dtype, shape]")
        name, dtype, shape = spec
        if not isinstance(name, str) or not 0 < len(name) <= limits.max_name:
            raise WireError(f"a tensor name is 1-{limits.max_name} characters")
        if name in out:
            raise WireError(f"tensor {name!r} is named twice")
        if dtype not in dtypes:
            raise WireError(f"{name}: dtype {dtype!r:.20} is not one of {', '.join(dtypes)}")
        if (not isinstance(shape, (list, tuple)) or len(shape) > limits.max_dims
                or not all(type(n) is int and n >= 0 for n in shape)):
            raise WireError(f"{name}: a shape is at most {limits.max_dims} non-negative integers")
        total += math.prod(shape) * ITEMSIZE[dtype]
        if total > limits.max_bytes:
            raise WireError(f"the tensors are more than {limits.max_bytes} bytes")
        out[name] = (dtype, tuple(shape))
    return out


def wire_specs(specs: Specs) -> list[list]:
    """``specs`` as :func:`check_specs` reads them."""
    return [[name, dtype, list(shape)] for name, (dtype, shape) in specs.items()]


class SetDecoder:
    """Takes the frames of ``count`` tensors of ``specs``, each into the buffer
    ``into(name)`` gives (writable, exactly the tensor's bytes).

    :meth:`feed` returns the names it completed; :attr:`done` once ``count``
    tensors came.  WireError for a tensor outside the set, sent twice, of
    another dtype or shape, compressed, or for a frame beyond the last tensor."""

    def __init__(self, specs: Specs, count: int, into: Callable[[str], memoryview], limits: Limits = Limits()):
        if type(count) is not int or not 0 <= count <= len(specs):
            raise WireError(f"a transfer holds 0 to {len(specs)} tensors, not {count!r:.20}")
        self.specs = specs
        self.count = count
        self.names: list[str] = []  # completed, in the order they came
        self._into = into
        self._decoder = Decoder(limits, into=self._buffer)

    @property
    def done(self) -> bool:
        return len(self.names) == self.count

    def _check(self, name: object, codec: object, dtype: object, shape: object) -> None:
        spec = self.specs.get(name) if isinstance(name, str) else None
        if spec is None:
            raise WireError(f"tensor {name!r:.80} is not one of the declared tensors")
        if codec != "none":
            raise WireError(f"{name}: tensors come uncompressed (codec none), not {codec!r:.20}")
        if (dtype, tuple(shape) if isinstance(shape, (list, tuple)) else shape) != spec:
            raise WireError(f"{name}: expected {spec[0]} of shape {list(spec[1])}, "
                            f"not {dtype!r:.20} of shape {shape!r:.80}")

    def _buffer(self, name: str, codec: str, nbytes: int) -> memoryview:
        return self._into(name)

    def feed(self, frame: object) -> list[str]:
        """Take one frame; the names of the tensors it completed (none or one).  A tensor's
        header is checked against its declaration before a byte of it is written."""
        if self.done:
            raise WireError(f"more than the {self.count} tensors announced")
        if isinstance(frame, dict) and "t" in frame:
            self._check(frame.get("t"), frame.get("codec"), frame.get("dtype"), frame.get("shape"))
        completed = [name for name, _ in self._decoder.feed(frame)]
        self.names += completed
        return completed


SHADOW_HEADER = 4096  # a shared shadow's first bytes: the daemon's token, then nothing; tensors start after
SHADOW_ALIGN = 64  # each tensor's offset: a cache line, and a multiple of every dtype's size


def shadow_layout(specs: Specs) -> tuple[dict[str, tuple[int, int]], int]:
    """Where each tensor of ``specs`` lies in a shared shadow (a file the script and its
    daemon both map): ``({name: (offset, nbytes)}, file size)``, in declared order, each
    offset a multiple of :data:`SHADOW_ALIGN` after the :data:`SHADOW_HEADER`.  Both
    sides compute it from the specs alone: no offset or size ever crosses the socket."""
    places: dict[str, tuple[int, int]] = {}
    at = SHADOW_HEADER
    for name, (dtype, shape) in specs.items():
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        places[name] = (at, nbytes)
        at += -(-nbytes // SHADOW_ALIGN) * SHADOW_ALIGN
    return places, at
