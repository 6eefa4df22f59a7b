"""How one group's share of a MoE layer reaches it: the interface (``base``), unary gRPC (``unary``), one
stream per group (``stream``), shared memory on one host (``local``), a group in this process (``in_process``)
and the default that picks the fastest that works (``auto``); ``build`` makes one by name."""

from __future__ import annotations

from expertmesh.config.settings import TransportName
from expertmesh.router.transport.base import TRANSPORTS, Transport
from expertmesh.router.transport.in_process import Lookup


def build(
    name: TransportName, in_process: Lookup | None = None, side_by_side: int = 1, threads: int | None = None
) -> Transport:
    """The transport called ``name`` (one of TRANSPORTS); ``in_process``: the groups this process runs, which
    ``auto`` calls in place, up to ``side_by_side`` of a layer's calls at once (``infra.compute_lanes``), sharing
    ``threads`` intra-op threads (None: the sending thread's at its first call)."""
    from expertmesh.router.transport.auto import AutoTransport  # imports every path: only when one is built
    from expertmesh.router.transport.unary import GrpcTransport

    if name == "grpc-unary":
        return GrpcTransport()
    if name in ("auto", "grpc"):
        return AutoTransport(
            shared_memory=name == "auto", in_process=in_process, side_by_side=side_by_side, threads=threads
        )
    raise ValueError(f"unknown transport {name!r}; use one of {', '.join(TRANSPORTS)}")
