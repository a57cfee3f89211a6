"""Tensors in expert calls: ``{"dtype", "shape", "data"}`` maps, raw bytes, never pickles.

Every decoder of a peer's tensors checks the count, the dtype, the shape
(at most 8 non-negative dimensions), that the bytes are exactly what dtype
and shape need, and the total against the caller's limit; anything else is
an InvalidArgument naming what was wrong.  Torch is imported in the functions.
"""

from __future__ import annotations

import math

from learn.encoded import ITEMSIZE

from ...rpc import InvalidArgument

MAX_DIMS = 8


def to_wire(tensors) -> list[dict]:
    """``tensors`` as maps for a call; the data a view of each tensor (no copy when it is
    contiguous: msgpack packs the view as it is), so leave them unchanged until sent."""
    from learn.tensors import dtype_name, tensor_view  # noqa: PLC0415  (torch only here)

    return [{"dtype": dtype_name(t.dtype), "shape": list(t.shape), "data": tensor_view(t)} for t in tensors]


def from_wire(items: object, *, max_tensors: int, max_bytes: int) -> list:
    """The tensors ``items`` carries; InvalidArgument for anything malformed or over the limits."""
    from learn.tensors import tensor_from_bytes  # noqa: PLC0415

    if not isinstance(items, list) or not 0 < len(items) <= max_tensors:
        raise InvalidArgument(f"a call carries a list of 1 to {max_tensors} tensors")
    total, out = 0, []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or item.keys() != {"dtype", "shape", "data"}:
            raise InvalidArgument(f"tensor {i} is a map of dtype, shape and data")
        dtype, shape, data = item["dtype"], item["shape"], item["data"]
        if not isinstance(dtype, str) or dtype not in ITEMSIZE:
            raise InvalidArgument(f"tensor {i}: dtype is one of {', '.join(ITEMSIZE)}")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(type(n) is int and n >= 0 for n in shape):
            raise InvalidArgument(f"tensor {i}: a shape is at most {MAX_DIMS} non-negative integers")
        if not isinstance(data, bytes) or len(data) != math.prod(shape) * ITEMSIZE[dtype]:
            raise InvalidArgument(f"tensor {i}: {dtype} {shape} is {math.prod(shape) * ITEMSIZE[dtype]} bytes")
        total += len(data)
        if total > max_bytes:
            raise InvalidArgument(f"more than {max_bytes} bytes of tensors in one call")
        try:
            out.append(tensor_from_bytes(data, dtype, tuple(shape)))
        except ValueError as exc:
            raise InvalidArgument(f"tensor {i}: {exc}") from None
    return out
