"""Dispatch frames: the codec of the fast paths (``DispatchFrame`` in experts.proto).

Unary Dispatch copies every tensor into a protobuf ``bytes`` field and out
again. The fast paths keep protobuf for a small header only:

- on the gRPC stream one message is ``<u32 header length><DispatchFrame><tensor bytes>``
  (``pack`` / ``split`` + ``read``), the tensors back to back;
- over shared memory the frame travels alone and its tensors sit in a buffer both
  processes map, each at a multiple of ``SHARED_ALIGN`` bytes from offset 0
  (``span`` / ``BufferViews``), so they are written once and read in place.

Every reader checks what it is given before it touches a byte: a known dtype,
no negative dimension, a byte count equal to shape x item size, every tensor
inside the payload or the buffer. A frame that fails is ``InvalidRequest``
naming the problem; nothing here trusts the other side.
"""

from __future__ import annotations

import struct
from typing import Sequence

import torch
from google.protobuf.message import DecodeError

from expertmesh.contracts import wire
from expertmesh.contracts.errors import InvalidRequest
from expertmesh.v1 import experts_pb2 as pb

HEADER_LENGTH = struct.Struct("<I")
#: A frame header is a few hundred bytes; anything near this is not one.
MAX_HEADER_BYTES = 1 << 16
#: Tensors in a shared buffer start at multiples of this (any dtype's alignment, a cache line).
SHARED_ALIGN = 64
REQUEST_TENSORS = ("hidden_states", "expert_ids", "routing_weights")
ANSWER_TENSORS = ("partial_sums",)

#: The ExpertGroupStream service (a raw bytes stream: no generated stub) and its one method.
STREAM_SERVICE_NAME = "expertmesh.v1.ExpertGroupStream"
STREAM_METHOD = f"/{STREAM_SERVICE_NAME}/Dispatch"


def meta(tensor: torch.Tensor) -> pb.TensorMeta:
    return pb.TensorMeta(
        dtype=wire.dtype_to_proto(tensor.dtype), shape=list(tensor.shape), nbytes=tensor.numel() * tensor.element_size()
    )


def _checked(metas: Sequence[pb.TensorMeta], names: Sequence[str]) -> list[tuple[torch.dtype, list[int], int]]:
    if len(metas) != len(names):
        raise InvalidRequest(
            f"a dispatch frame must describe {len(names)} tensors ({', '.join(names)}), not {len(metas)}"
        )
    out = []
    for m, name in zip(metas, names):
        dtype, shape, nbytes = wire.layout(m.dtype, m.shape, name)
        if m.nbytes != nbytes:
            raise InvalidRequest(
                f"{name}: {m.nbytes} bytes do not match shape {shape} of {dtype} ({nbytes} bytes expected)"
            )
        out.append((dtype, shape, nbytes))
    return out


def parse_header(data: bytes | memoryview) -> pb.DispatchFrame:
    if len(data) > MAX_HEADER_BYTES:
        raise InvalidRequest(f"a dispatch frame header of {len(data)} bytes is over the {MAX_HEADER_BYTES}-byte limit")
    try:
        return pb.DispatchFrame.FromString(bytes(data))
    except DecodeError as err:
        raise InvalidRequest(f"the dispatch frame header does not parse: {err}") from None


# -- gRPC stream: header and tensors in one message ----------------------------------------


def _as_bytes(tensor: torch.Tensor):
    t = tensor.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""


def pack(frame: pb.DispatchFrame, tensors: Sequence[torch.Tensor] = ()) -> bytes:
    """One stream message: ``frame`` (its ``tensors`` filled in here) followed by the tensors' bytes."""
    del frame.tensors[:]
    frame.tensors.extend(meta(t) for t in tensors)
    header = frame.SerializeToString()
    return b"".join([HEADER_LENGTH.pack(len(header)), header, *map(_as_bytes, tensors)])


def split(data: bytes) -> tuple[pb.DispatchFrame, memoryview]:
    """A stream message -> its frame and the payload after it (tensors unread: see ``read``)."""
    if len(data) < HEADER_LENGTH.size:
        raise InvalidRequest(f"a dispatch frame of {len(data)} bytes is shorter than its header length")
    (length,) = HEADER_LENGTH.unpack_from(data)
    if HEADER_LENGTH.size + length > len(data):
        raise InvalidRequest(f"a dispatch frame header of {length} bytes does not fit in the {len(data)}-byte message")
    view = memoryview(data)
    return parse_header(view[HEADER_LENGTH.size : HEADER_LENGTH.size + length]), view[HEADER_LENGTH.size + length :]


def read(frame: pb.DispatchFrame, payload: memoryview, names: Sequence[str]) -> list[torch.Tensor]:
    """The tensors ``names`` of a stream message's payload: CPU copies the caller may write."""
    tensors, offset = [], 0
    for dtype, shape, nbytes in _checked(frame.tensors, names):
        if offset + nbytes > len(payload):
            raise InvalidRequest(f"the dispatch frame's payload is {len(payload)} bytes, shorter than its tensors")
        chunk = bytearray(payload[offset : offset + nbytes])
        tensors.append(
            torch.frombuffer(chunk, dtype=dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)
        )
        offset += nbytes
    if offset != len(payload):
        raise InvalidRequest(f"the dispatch frame carries {len(payload) - offset} bytes beyond its tensors")
    return tensors


# -- shared memory: tensors in a buffer both sides map ---------------------------------------


def aligned(n: int) -> int:
    return -(-n // SHARED_ALIGN) * SHARED_ALIGN


def span(metas: Sequence[pb.TensorMeta], start: int = 0) -> int:
    """Where tensors placed from ``start`` end (aligned): the next free offset."""
    end = start
    for m in metas:
        end = aligned(end + m.nbytes)
    return end


def _strides(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return strides[::-1]


#: Layouts whose views a BufferViews keeps; a decode loop asks for the same few over and over.
MAX_CACHED_LAYOUTS = 64


class BufferViews:
    """Tensors in one shared buffer ([bytes] uint8, CPU or GPU). A typed view of the whole buffer is
    made once per dtype, so a tensor in it is one ``as_strided``; and the views of a layout seen
    before (same tensors at the same offset) are the ones made then, checks and all: the views of a
    layout depend on nothing else, and decode steps repeat a few layouts."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._layouts: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def _as(self, dtype: torch.dtype) -> torch.Tensor:
        typed = self._typed.get(dtype)
        if typed is None:
            size = self.buffer.numel()
            typed = self._typed[dtype] = self.buffer[: size - size % dtype.itemsize].view(dtype)
        return typed

    def views(self, metas: Sequence[pb.TensorMeta], names: Sequence[str], start: int = 0) -> list[torch.Tensor]:
        """The tensors ``metas`` describe, lying from ``start`` (each at a multiple of SHARED_ALIGN), as
        views: no copy, writing one writes the buffer. Raises InvalidRequest when one would leave it."""
        key = (start, tuple(names), tuple((m.dtype, tuple(m.shape), m.nbytes) for m in metas))
        known = self._layouts.get(key)
        if known is not None:
            return list(known)
        if start % SHARED_ALIGN:
            raise InvalidRequest(f"offset {start} in the shared buffer is not a multiple of {SHARED_ALIGN}")
        out, offset, size = [], start, self.buffer.numel()
        for dtype, shape, nbytes in _checked(metas, names):
            if offset + nbytes > size:
                raise InvalidRequest(
                    f"tensors up to byte {offset + nbytes} do not fit in the {size}-byte shared buffer"
                )
            out.append(self._as(dtype).as_strided(shape, _strides(shape), offset // dtype.itemsize))
            offset = aligned(offset + nbytes)
        if len(self._layouts) >= MAX_CACHED_LAYOUTS:
            self._layouts.clear()
        self._layouts[key] = tuple(out)
        return out
