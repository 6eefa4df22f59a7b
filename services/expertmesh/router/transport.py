"""How a DispatchRequest reaches an expert group: the transport interface.

The dispatcher chooses replicas, retries and fails over; a transport only
carries one request to one named group and brings back its response or a
``TransportError`` with a gRPC status code. Implementations: ``GrpcTransport``
(unary calls over one channel per group, the portable path between hosts).
Same-host paths (shared memory, unix sockets, CUDA IPC) plug in behind the same
two calls.
"""

from __future__ import annotations

from typing import Protocol

import grpc

from expertmesh.router.group_client import GroupClients
from expertmesh.v1 import experts_pb2 as pb


class TransportError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class PendingCall(Protocol):
    def result(self) -> pb.DispatchResponse:
        """Block until the group answers; raises TransportError."""
        ...


class Transport(Protocol):
    name: str

    def update(self, endpoints: dict[str, str]) -> None:
        """Follow the groups' current addresses (group name -> address)."""
        ...

    def address(self, group: str) -> str | None: ...

    def send(self, group: str, request: pb.DispatchRequest, timeout_s: float) -> PendingCall:
        """Start one call; raises TransportError(UNAVAILABLE) when the group has no address."""
        ...

    def close(self) -> None: ...


class _GrpcPending:
    def __init__(self, future: grpc.Future):
        self._future = future

    def result(self) -> pb.DispatchResponse:
        try:
            return self._future.result()
        except grpc.RpcError as err:
            raise TransportError(err.code(), err.details() or "") from None


class GrpcTransport:
    name = "grpc"

    def __init__(self) -> None:
        self._clients = GroupClients()

    def update(self, endpoints: dict[str, str]) -> None:
        self._clients.update(endpoints)

    def address(self, group: str) -> str | None:
        return self._clients.address(group)

    def send(self, group: str, request: pb.DispatchRequest, timeout_s: float) -> PendingCall:
        stub = self._clients.stub(group)
        if stub is None:
            raise TransportError(grpc.StatusCode.UNAVAILABLE, f"expert group {group} has no registered endpoint")
        return _GrpcPending(stub.Dispatch.future(request, timeout=timeout_s))

    def close(self) -> None:
        self._clients.close()
