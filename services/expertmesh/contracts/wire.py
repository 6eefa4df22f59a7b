"""Tensor codec for the data path: torch tensors <-> ``expertmesh.v1.Tensor``.

A ``Tensor`` message carries dtype, shape and the raw little-endian bytes in
row-major order; decoding checks that the byte count matches the shape, so a
corrupt or truncated payload is refused with a message instead of misread.
"""

from __future__ import annotations

import math
import sys

import torch

from expertmesh.contracts.errors import InvalidRequest
from expertmesh.v1 import experts_pb2 as pb

if sys.byteorder != "little":  # the wire is little-endian and we send native bytes
    raise ImportError("expertmesh's tensor codec supports little-endian hosts only")

_TO_PROTO = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.float16: pb.DTYPE_FLOAT16,
    torch.int32: pb.DTYPE_INT32,
    torch.int64: pb.DTYPE_INT64,
}
_FROM_PROTO = {v: k for k, v in _TO_PROTO.items()}
#: Largest tensor a shape may describe, in bytes: what torch can size (int64, with room to spare).
_MAX_BYTES = 1 << 62


def dtype_to_proto(dtype: torch.dtype) -> int:
    try:
        return _TO_PROTO[dtype]
    except KeyError:
        raise InvalidRequest(f"dtype {dtype} cannot travel on the wire; use one of {list(_TO_PROTO)}") from None


def dtype_from_proto(code: int, what: str = "tensor") -> torch.dtype:
    try:
        return _FROM_PROTO[code]
    except KeyError:
        raise InvalidRequest(f"{what}: unsupported or unset dtype code {code}") from None


def encode(tensor: torch.Tensor) -> pb.Tensor:
    """[any shape] tensor -> Tensor message (copies to CPU if needed)."""
    t = tensor.detach().to("cpu").contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""  # reshape: 0-d tensors too
    return pb.Tensor(dtype=dtype_to_proto(t.dtype), shape=list(t.shape), data=data)


def layout(dtype_code: int, shape, what: str = "tensor") -> tuple[torch.dtype, list[int], int]:
    """The dtype, shape and byte count a tensor's description (dtype code, shape) stands for; raises
    InvalidRequest naming ``what`` for an unknown dtype, a negative dimension or an impossible size.
    Shared by ``decode`` and the fast paths' frames (``wire_frames``)."""
    dtype = dtype_from_proto(dtype_code, what)
    shape = list(shape)
    if any(d < 0 for d in shape):
        raise InvalidRequest(f"{what}: negative dimension in shape {shape}")
    itemsize = dtype.itemsize
    # Checked before the byte count: a zero dimension makes any other dimension "match" no bytes,
    # and torch refuses to size storage past int64 even for an empty tensor.
    if math.prod(d for d in shape if d) * itemsize > _MAX_BYTES:
        raise InvalidRequest(f"{what}: shape {shape} describes more than {_MAX_BYTES} bytes of {dtype}")
    return dtype, shape, math.prod(shape) * itemsize


def decode(msg: pb.Tensor, what: str = "tensor") -> torch.Tensor:
    """Tensor message -> CPU tensor. Raises InvalidRequest naming ``what`` on bad input."""
    dtype, shape, expected = layout(msg.dtype, msg.shape, what)
    if len(msg.data) != expected:
        raise InvalidRequest(
            f"{what}: {len(msg.data)} bytes do not match shape {shape} of {dtype} ({expected} bytes expected)"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    # frombuffer shares memory with the immutable protobuf bytes; clone so callers may write.
    return torch.frombuffer(bytearray(msg.data), dtype=dtype).reshape(shape)
