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
from .tensors import DTYPES, dtype_name, shape_fits, tensor_bytes, tensor_from_bytes, tensor_view

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
    nblocks = math.ceil(numel / block)
    payload = torch.empty(payload_size(codec, dtype, numel, block), dtype=torch.uint8)
    scales, values = payload[:4 * nblocks].view(torch.float32), payload[4 * nblocks:]
    for start in range(0, numel, _SPAN):  # a span at a time: the passes run in cache, not memory
        part = flat[start:start + _SPAN]
        first = start // block
        scale, q = _quantize(part, block, _LEVELS[codec])
        scales[first:first + scale.numel()] = scale
        if codec == "int8":
            values[start:start + part.numel()] = q.view(torch.uint8)
        else:
            if q.numel() % 2:
                q = torch.cat([q, q.new_zeros(1)])
            pairs = (q.view(-1, 2) & 0x0F).to(torch.uint8)
            values[start // 2:start // 2 + pairs.shape[0]] = pairs[:, 0] | (pairs[:, 1] << 4)
    return Encoded(codec, dtype, shape, block, tensor_view(payload))


_SPAN = 1 << 18  # values quantized or restored per pass (a multiple of every block size, and even)


def _quantize(part: torch.Tensor, block: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax of ``part``: the scales, and each value as a step count (int8)."""
    numel = part.numel()
    pad = (-numel) % block
    blocks = (torch.cat([part, part.new_zeros(pad)]) if pad else part).view(-1, block)
    scales = blocks.abs().amax(dim=1) / levels
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-levels, levels).to(torch.int8).reshape(-1)[:numel]
    return scales, q


def decode(encoded: Encoded, into: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor ``encoded`` holds: the original dtype for ``none`` and the
    casts, float32 for the quantized codecs.  CodecError if it is malformed
    (unknown codec or dtype, bad shape or block, a payload of the wrong size),
    never another exception: this is peer data.

    ``into`` (a lossy codec's only: a contiguous tensor of the decoded dtype
    and as many values) receives the values in place of a new tensor, and is
    returned in the encoded shape; it is untouched when the encoding is
    refused, and ValueError if it does not fit."""
    codec, dtype, shape = encoded.codec, encoded.dtype, encoded.shape
    if not isinstance(shape, tuple) or not all(type(n) is int and n >= 0 for n in shape) \
            or not shape_fits(shape):
        raise CodecError(f"a shape is a tuple of non-negative integers that fits a tensor, not {shape!r:.80}")
    numel = math.prod(shape)
    expected = payload_size(codec, dtype, numel, encoded.block)
    if len(encoded.payload) != expected:
        raise CodecError(f"a {codec} payload of {numel} values is {expected} bytes, not {len(encoded.payload)}")
    if into is not None and (codec == "none" or not into.is_contiguous() or into.numel() != numel
                             or into.dtype != (DTYPES[dtype] if codec in _CAST else torch.float32)):
        raise ValueError(f"cannot decode {codec} {dtype} {shape} into a {into.dtype} tensor of {into.numel()}")
    if codec == "none":
        try:
            return tensor_from_bytes(encoded.payload, dtype, shape)
        except ValueError as exc:
            raise CodecError(str(exc)) from None
    if codec in _CAST:
        half = tensor_from_bytes(encoded.payload, "float16" if codec == "fp16" else "bfloat16", shape)
        return half.to(DTYPES[dtype]) if into is None else into.view(shape).copy_(half)
    block = encoded.block
    nblocks = math.ceil(numel / block)
    payload = tensor_from_bytes(encoded.payload, "uint8", (len(encoded.payload),))
    scales, raw = payload[:4 * nblocks].view(torch.float32), payload[4 * nblocks:].view(torch.int8)
    out = torch.empty(numel) if into is None else into.view(-1)
    for start in range(0, numel, _SPAN):
        n = min(_SPAN, numel - start)
        if codec == "int8":
            steps = raw[start:start + n]
        else:
            packed = raw[start // 2:(start + n + 1) // 2]
            steps = torch.stack([(packed << 4) >> 4, packed >> 4], dim=1).reshape(-1)[:n]  # sign-extend each nibble
        values = steps.float()
        pad = (-n) % block
        if pad:
            values = torch.cat([values, values.new_zeros(pad)])
        first = start // block
        restored = values.view(-1, block) * scales[first:first + (n + pad) // block, None]
        out[start:start + n] = restored.reshape(-1)[:n]
    return out.reshape(shape)


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
