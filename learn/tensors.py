"""Raw bytes of tensors and back, without numpy and without pickle."""

from __future__ import annotations

import torch

DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


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


def tensor_from_bytes(data: bytes | memoryview, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor that owns a copy of ``data``; ValueError if the sizes disagree."""
    torch_dtype = DTYPES[dtype]
    numel = 1
    for n in shape:
        numel *= n
    itemsize = torch.empty(0, dtype=torch_dtype).element_size()
    if len(data) != numel * itemsize:
        raise ValueError(f"{len(data)} bytes cannot hold {numel} {dtype} values")
    if numel == 0:
        return torch.empty(shape, dtype=torch_dtype)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(torch_dtype).reshape(shape)
