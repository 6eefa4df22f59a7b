"""How one group's share of a MoE layer reaches it: the interface (``base``), unary gRPC (``unary``), one
stream per group (``stream``), shared memory on one host (``local``) and the default that picks the fastest
that works (``auto``); ``build`` makes one by name."""

from __future__ import annotations

from expertmesh.config.settings import TransportName
from expertmesh.router.transport.base import TRANSPORTS, Transport


def build(name: TransportName) -> Transport:
    """The transport called ``name`` (one of TRANSPORTS)."""
    from expertmesh.router.transport.auto import AutoTransport  # imports every path: only when one is built
    from expertmesh.router.transport.unary import GrpcTransport

    if name == "grpc-unary":
        return GrpcTransport()
    if name in ("auto", "grpc"):
        return AutoTransport(shared_memory=name == "auto")
    raise ValueError(f"unknown transport {name!r}; use one of {', '.join(TRANSPORTS)}")
