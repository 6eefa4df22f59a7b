"""Unary ``Dispatch`` calls, one per group call, over one channel per group: what any group speaks, and the
last path ``auto`` falls back to."""

from __future__ import annotations

import grpc

from expertmesh.contracts import wire
from expertmesh.contracts.errors import InvalidRequest
from expertmesh.infra.group_channels import GroupClients
from expertmesh.router.transport.base import (
    GroupReply,
    GroupRequest,
    PendingCall,
    TransportError,
    call_failed,
    channel_closed,
)
from expertmesh.v1 import experts_pb2 as pb


def decode_reply(tensor: pb.Tensor, nbytes: int) -> GroupReply:
    try:
        return GroupReply(wire.decode(tensor, "partial sums"), nbytes)
    except InvalidRequest as err:
        return GroupReply(None, nbytes, str(err))


class _UnaryPending:
    transport = "grpc-unary"

    def __init__(self, future: grpc.Future):
        self._future = future

    def result(self) -> GroupReply:
        try:
            response = self._future.result()
        except grpc.RpcError as err:
            raise call_failed(err.code(), err.details() or "") from None
        return decode_reply(response.partial_sums, response.ByteSize())

    def wait(self, timeout_s: float) -> bool:
        try:
            self._future.exception(timeout=max(timeout_s, 0.0))
        except grpc.FutureTimeoutError:
            return False
        except grpc.FutureCancelledError:
            pass
        return True

    def cancel(self) -> None:
        self._future.cancel()


class GrpcTransport:
    """Unary Dispatch calls over one channel per group."""

    name = "grpc-unary"

    def __init__(self, clients: GroupClients | None = None) -> None:
        self._clients = clients or GroupClients()

    def update(self, endpoints: dict[str, str]) -> None:
        self._clients.update(endpoints)

    def address(self, group: str) -> str | None:
        return self._clients.address(group)

    def kind(self, group: str) -> str:
        return self.name

    def prepare(self, group: str, timeout_s: float) -> None:
        """The group's channel connected (a channel dials on its first call otherwise)."""
        channel = self._clients.channel(group)
        if channel is None:
            return
        try:
            grpc.channel_ready_future(channel).result(timeout=max(timeout_s, 0.0))
        except grpc.FutureTimeoutError:
            pass  # the first call waits for it, within its own deadline

    def send(self, group: str, request: GroupRequest, timeout_s: float) -> PendingCall:
        stub = self._clients.stub(group)
        if stub is None:
            raise TransportError(grpc.StatusCode.UNAVAILABLE, f"expert group {group} has no registered endpoint")
        message = pb.DispatchRequest(
            layer=request.layer,
            hidden_states=wire.encode(request.rows()),  # [Tg, H]
            expert_ids=wire.encode(request.expert_ids),  # [Tg, K]
            routing_weights=wire.encode(request.weights),  # [Tg, K]
            routing_table_version=request.table_version,
            model_fingerprint=request.model,
        )
        try:
            return _UnaryPending(stub.Dispatch.future(message, timeout=timeout_s))
        except ValueError as err:
            raise channel_closed(group, err) from None

    def close(self) -> None:
        self._clients.close()
