"""Codecs for tensors on the wire: ``none``, ``fp16``, ``bf16``, ``int8``, ``int4``.

``int8`` and ``int4`` are blockwise absmax quantization: the flattened tensor
is cut into blocks of ``block`` values (a power of two, 64 to 1024; the last
block may be shorter), each block keeps one float32 scale (its largest
magnitude / 127, or / 7 for int4) and its values rounded to the nearest step.
Payload layout, little-endian: the float32 scales of every block, then the
values, one signed byte each (int8) or two signed nibbles per byte, low
nibble first (int4).  ``none`` is the raw bytes of the tensor; ``fp16`` and
``bf16`` the raw bytes of its cast.  :class:`ErrorFeedback` keeps what a
lossy codec dropped and adds it to the next tensor of the same name, so the
error is delayed, not lost.
"""

from __future__ import annotations

import math

import torch

from .encoded import CODECS, CodecError, Encoded, check_block, payload_size
from .tensors import DTYPES, dtype_name, tensor_bytes, tensor_from_bytes, tensor_view

__all__ = ["CODECS", "CodecError", "Encoded", "ErrorFeedback", "decode", "encode", "payload_size"]

_LEVELS = {"int8": 127, "int4": 7}
_CAST = {"fp16": torch.float16, "bf16": torch.bfloat16}


def encode(tensor: torch.Tensor, codec: str = "none", block: int = 64) -> Encoded:
    """``tensor`` under ``codec`` (for ``none`` the payload shares the tensor's
    memory: leave the tensor unchanged while the result is in use, or pass a
    copy); CodecError for an unknown codec, a bad
    ``block`` (int8, int4) or a lossy codec of a tensor that is not floating."""
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r} (known: {', '.join(CODECS)})")
    dtype = dtype_name(tensor.dtype)
    shape = tuple(tensor.shape)
    if codec == "none":  # no copy: the payload is a view of the tensor
        return Encoded(codec, dtype, shape, block, tensor_view(tensor))
    if not tensor.is_floating_point():
        raise CodecError(f"{codec} encodes floating tensors, not {dtype}")
    if codec in _CAST:
        return Encoded(codec, dtype, shape, block, tensor_bytes(tensor.to(_CAST[codec])))
    check_block(block)
    flat = tensor.detach().float().reshape(-1)
    numel = flat.numel()
    pad = (-numel) % block
    blocks = torch.cat([flat, flat.new_zeros(pad)]).view(-1, block)
    levels = _LEVELS[codec]
    scales = blocks.abs().amax(dim=1) / levels
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-levels, levels).to(torch.int8).reshape(-1)[:numel]
    if codec == "int4":
        if numel % 2:
            q = torch.cat([q, q.new_zeros(1)])
        pairs = (q.view(-1, 2) & 0x0F).to(torch.uint8)
        q = pairs[:, 0] | (pairs[:, 1] << 4)
    return Encoded(codec, dtype, shape, block, tensor_bytes(scales) + tensor_bytes(q))


def decode(encoded: Encoded) -> torch.Tensor:
    """The tensor ``encoded`` holds: the original dtype for ``none`` and the
    casts, float32 for the quantized codecs.  CodecError if it is malformed
    (unknown codec or dtype, bad shape or block, a payload of the wrong size),
    never another exception: this is peer data."""
    codec, dtype, shape = encoded.codec, encoded.dtype, encoded.shape
    if not isinstance(shape, tuple) or not all(type(n) is int and n >= 0 for n in shape):
        raise CodecError(f"a shape is a tuple of non-negative integers, not {shape!r}")
    numel = math.prod(shape)
    expected = payload_size(codec, dtype, numel, encoded.block)
    if len(encoded.payload) != expected:
        raise CodecError(f"a {codec} payload of {numel} values is {expected} bytes, not {len(encoded.payload)}")
    if codec == "none":
        try:
            return tensor_from_bytes(encoded.payload, dtype, shape)
        except ValueError as exc:
            raise CodecError(str(exc)) from None
    if codec in _CAST:
        return tensor_from_bytes(encoded.payload, "float16" if codec == "fp16" else "bfloat16",
                                 shape).to(DTYPES[dtype])
    nblocks = math.ceil(numel / encoded.block)
    scales = tensor_from_bytes(encoded.payload[:4 * nblocks], "float32", (nblocks,))
    raw = tensor_from_bytes(encoded.payload[4 * nblocks:], "int8", (len(encoded.payload) - 4 * nblocks,))
    if codec == "int4":
        low = (raw << 4) >> 4  # sign-extend each nibble
        high = raw >> 4
        raw = torch.stack([low, high], dim=1).reshape(-1)[:numel]
    values = raw.float()
    values = torch.cat([values, values.new_zeros(nblocks * encoded.block - numel)]).view(nblocks, encoded.block)
    return (values * scales[:, None]).reshape(-1)[:numel].reshape(shape)


class ErrorFeedback:
    """Lossy encoding that carries each tensor's quantization error into its next send."""

    def __init__(self) -> None:
        self._residual: dict[str, torch.Tensor] = {}

    def compress(self, name: str, tensor: torch.Tensor, codec: str, block: int = 64) -> Encoded:
        """``tensor`` plus what was dropped from ``name`` last time (unless the
        shape changed), encoded as ``tensor``'s dtype; what this encoding drops,
        in float32, is kept for next time."""
        value = tensor.detach().float()
        residual = self._residual.get(name)
        if residual is not None and residual.shape == value.shape:
            value = value + residual
        encoded = encode(value.to(tensor.dtype), codec, block)
        self._residual[name] = value - decode(encoded).float()
        return encoded

    def reset(self) -> None:
        """Forget every residual."""
        self._residual.clear()
