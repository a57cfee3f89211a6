"""Tensors as raw bytes and back (no numpy, no pickle), and sums whose bits
do not depend on how many threads torch runs.

torch's own full reductions (``sum``, ``mean``, ``var``, ``norm``) split the
work by thread count, so two machines adding the same numbers can disagree in
the last bits; :func:`fixed_sum` adds in an order fixed by the length alone.
"""

from __future__ import annotations

import ctypes
import math
import warnings

import blake3
import torch

DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
_CHUNK = 4096
_INT64 = 1 << 63


def hash_threads() -> int:
    """Threads blake3 may use on tensors' bytes: as many as torch uses
    (``torch.get_num_threads``, which ``OMP_NUM_THREADS`` sets).  The digest is
    the same for any count; a model's state hashes several times faster on a
    machine with idle cores (blake3 lets go of the GIL while it works)."""
    return max(1, torch.get_num_threads())


def tensor_hasher() -> blake3.blake3:
    """A blake3 hasher on :func:`hash_threads` threads."""
    return blake3.blake3(max_threads=hash_threads())


def shape_fits(shape: tuple[int, ...]) -> bool:
    """Whether torch can make a tensor of ``shape`` (non-negative ints): its sizes, and the
    strides it computes even for an empty tensor, fit in int64."""
    return math.prod(max(n, 1) for n in shape) < _INT64


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype``; ValueError for one the wire does not carry."""
    try:
        return NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not sent over the wire") from None


def tensor_bytes(tensor: torch.Tensor) -> bytearray:
    """The tensor's elements as little-endian bytes, in row-major order (one copy)."""
    flat = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    out = bytearray(flat.numel())
    if out:
        torch.frombuffer(out, dtype=torch.uint8).copy_(flat)
    return out


def tensor_view(tensor: torch.Tensor, *, writable: bool = False) -> memoryview:
    """The tensor's bytes as :func:`tensor_bytes` gives them, read-only unless
    ``writable``, and for a contiguous CPU tensor without a copy: the view
    shares the tensor's memory (and keeps it alive), so either shows the
    other's changes.  ValueError for a writable view of any other tensor."""
    flat = tensor.detach()
    if not flat.is_contiguous() or flat.device.type != "cpu" or flat.numel() == 0:
        if writable and flat.numel():
            raise ValueError("a writable view needs a contiguous CPU tensor")
        return memoryview(tensor_bytes(flat)).toreadonly()
    nbytes = flat.numel() * flat.element_size()
    window = (ctypes.c_char * nbytes).from_address(flat.data_ptr())
    window.tensor = flat  # the view keeps the window alive, and the window the tensor
    view = memoryview(window).cast("B")
    return view if writable else view.toreadonly()


def tensor_from_bytes(data: bytes | bytearray | memoryview, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``data``: sharing it if it is writable (a bytearray, a writable
    view: the caller hands it over), else holding a copy; ValueError for an
    unknown dtype, a shape torch cannot hold, sizes that disagree, or a bool
    byte other than 0 or 1."""
    torch_dtype = DTYPES.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"unknown dtype {dtype!r}")
    if not shape_fits(shape):
        raise ValueError(f"shape {list(shape)[:8]} is too large for a tensor")
    numel = 1
    for n in shape:
        numel *= n
    itemsize = torch.empty(0, dtype=torch_dtype).element_size()
    if len(data) != numel * itemsize:
        raise ValueError(f"{len(data)} bytes cannot hold {numel} {dtype} values")
    if numel == 0:
        return torch.empty(shape, dtype=torch_dtype)
    shared = isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly)
    raw = torch.frombuffer(data if shared else bytearray(data), dtype=torch.uint8)
    if torch_dtype is torch.bool and bool((raw > 1).any()):
        raise ValueError("a bool is one byte, 0 or 1")
    return raw.view(torch_dtype).reshape(shape)


def float32_values(chunk: memoryview) -> torch.Tensor:
    """The float32 values in ``chunk`` (a whole number of them), sharing its memory,
    read-only buffers too: the tensor is for reading (torch warns at every such view,
    so the warning is silenced here).  ValueError if the bytes are not whole values."""
    if chunk.nbytes % 4:
        raise ValueError(f"{chunk.nbytes} bytes are not whole float32 values")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(chunk, dtype=torch.float32)


def fixed_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum over the last dimension, bit-identical whatever the thread count:
    zero-padded to whole chunks of 4096, each chunk summed, then the chunk sums
    likewise until one chunk is left."""
    x = x.contiguous()
    while x.shape[-1] > _CHUNK:
        pad = -x.shape[-1] % _CHUNK
        if pad:
            x = torch.cat([x, x.new_zeros(*x.shape[:-1], pad)], dim=-1)
        x = x.unflatten(-1, (-1, _CHUNK)).sum(dim=-1)
    return x.sum(dim=-1)
