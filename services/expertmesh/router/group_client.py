"""gRPC clients of expert groups, one channel per address, reused across calls.

Channels use mutual TLS when ``EXPERTMESH_TLS_*`` configures it (expert groups
require a client certificate); groups are dialled by IP, so the name verified in
their certificate is ``TlsConfig.group_server_name``."""

from __future__ import annotations

import threading

import grpc

from expertmesh.config import TlsConfig
from expertmesh.expert_group.service import group_channel
from expertmesh.security import from_env
from expertmesh.telemetry.setup import intercept_client
from expertmesh.v1 import experts_pb2_grpc as pb_grpc


class GroupClients:
    """group name -> ExpertGroup stub, following the endpoints the state store lists."""

    def __init__(self, tls: TlsConfig | None = None) -> None:
        self._tls = tls if tls is not None else from_env(TlsConfig)
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
                    channel = group_channel(address, self._tls)
                    self._channels[group] = channel
                    self._stubs[group] = pb_grpc.ExpertGroupStub(intercept_client(channel))
                    self._addresses[group] = address

    def stub(self, group: str) -> pb_grpc.ExpertGroupStub | None:
        return self._stubs.get(group)

    def channel(self, group: str) -> grpc.Channel | None:
        """The group's channel without tracing interceptors: a long-lived stream carries trace
        context in each of its frames instead."""
        return self._channels.get(group)

    @property
    def tls(self) -> TlsConfig:
        return self._tls

    def address(self, group: str) -> str | None:
        return self._addresses.get(group)

    def close(self) -> None:
        self.update({})
