"""The stored form of a hidden-state sample (the state store's ``hidden_samples:<layer>``
hash and the health monitor's pinned probes): an ``expertmesh.v1.Tensor`` message
[rows, H], raw little-endian bytes, no pickle. Routers write it, the orchestrator
reads it; both import this module."""

from __future__ import annotations

import torch
from google.protobuf.message import DecodeError

from expertmesh.contracts import wire
from expertmesh.contracts.errors import InvalidRequest
from expertmesh.v1 import experts_pb2 as pb


def encode(sample: torch.Tensor) -> bytes:
    """sample [rows, H] -> bytes."""
    return wire.encode(sample).SerializeToString()


def decode(raw: bytes, what: str = "hidden-state sample") -> torch.Tensor:
    """bytes -> [rows, H] floats; InvalidRequest naming ``what`` for anything else."""
    message = pb.Tensor()
    try:
        message.ParseFromString(raw)
    except DecodeError as err:  # the store is shared: a stray write must not crash a reader
        raise InvalidRequest(f"{what}: not a Tensor message: {err}") from None
    sample = wire.decode(message, what)
    if sample.dim() != 2 or not sample.is_floating_point():
        raise InvalidRequest(f"{what}: expected [rows, H] floats, got {list(sample.shape)} {sample.dtype}")
    return sample
