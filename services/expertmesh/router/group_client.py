"""gRPC clients of expert groups, one channel per address, reused across calls."""

from __future__ import annotations

import threading

import grpc

from expertmesh.expert_group.service import CHANNEL_OPTIONS
from expertmesh.telemetry.setup import intercept_client
from expertmesh.v1 import experts_pb2_grpc as pb_grpc


class GroupClients:
    """group name -> ExpertGroup stub, following the endpoints the state store lists."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, pb_grpc.ExpertGroupStub] = {}
        self._addresses: dict[str, str] = {}

    def update(self, endpoints: dict[str, str]) -> None:
        """Open channels to new or moved groups; close those no longer listed."""
        with self._lock:
            for group in list(self._addresses):
                if endpoints.get(group) != self._addresses[group]:
                    self._channels.pop(group).close()
                    del self._stubs[group], self._addresses[group]
            for group, address in endpoints.items():
                if group not in self._addresses:
                    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
                    self._channels[group] = channel
                    self._stubs[group] = pb_grpc.ExpertGroupStub(intercept_client(channel))
                    self._addresses[group] = address

    def stub(self, group: str) -> pb_grpc.ExpertGroupStub | None:
        return self._stubs.get(group)

    def address(self, group: str) -> str | None:
        return self._addresses.get(group)

    def close(self) -> None:
        self.update({})
