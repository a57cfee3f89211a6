"""An encoded tensor as it travels, and its exact size; no torch needed here.

The codecs themselves are :mod:`learn.compress`; this module is what a
decoder of peer data needs to check a payload's size before any tensor is
made, so the node's network code does not import torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CODECS = ("none", "fp16", "bf16", "int8", "int4")
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4,
            "int16": 2, "int8": 1, "uint8": 1, "bool": 1}
FLOATING = ("float32", "float16", "bfloat16", "float64")


class CodecError(ValueError):
    """An encoded tensor is malformed (bad codec, dtype, block or payload size)."""


@dataclass(frozen=True)
class Encoded:
    """One tensor as sent: how it was encoded, what it was, and the payload."""

    codec: str
    dtype: str  # the original tensor's dtype
    shape: tuple[int, ...]
    block: int
    payload: bytes | bytearray | memoryview

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def check_block(block: int) -> int:
    """``block`` if it is a power of two from 64 to 1024; CodecError otherwise."""
    if type(block) is not int or not 64 <= block <= 1024 or block & (block - 1):
        raise CodecError(f"block must be a power of two from 64 to 1024, not {block!r}")
    return block


def payload_size(codec: str, dtype: str, numel: int, block: int) -> int:
    """The exact payload length of ``numel`` values of ``dtype`` under ``codec``;
    CodecError for an unknown codec or dtype, a bad block, or a lossy codec of
    a tensor that is not floating."""
    if dtype not in ITEMSIZE:
        raise CodecError(f"unknown dtype {dtype!r}")
    if codec == "none":
        return numel * ITEMSIZE[dtype]
    if codec in CODECS and dtype not in FLOATING:
        raise CodecError(f"{codec} encodes floating tensors, not {dtype}")
    if codec in ("fp16", "bf16"):
        return numel * 2
    if codec in ("int8", "int4"):
        scales = 4 * math.ceil(numel / check_block(block))
        return scales + (numel if codec == "int8" else (numel + 1) // 2)
    raise CodecError(f"unknown codec {codec!r} (known: {', '.join(CODECS)})")
