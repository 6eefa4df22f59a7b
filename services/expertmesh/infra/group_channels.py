"""gRPC channels to expert groups, for the router and the orchestrator alike: ``group_channel`` makes one,
``GroupClients`` keeps one per group, following the endpoints the state store lists.

Channels use mutual TLS when ``EXPERTMESH_TLS_*`` configures it (expert groups
require a client certificate); groups are dialled by IP, so the name verified in
their certificate is ``TlsConfig.group_server_name``."""

from __future__ import annotations

import threading

import grpc

from expertmesh.config.settings import TlsConfig
from expertmesh.infra.security import from_env
from expertmesh.infra.security.tls import secure_or_insecure_channel
from expertmesh.infra.telemetry.setup import intercept_client
from expertmesh.v1 import experts_pb2_grpc as pb_grpc

# Hidden states of a large prefill exceed gRPC's 4 MiB default (4k tokens of a 7168-wide
# model in fp32 are ~117 MB, and the router sends a layer's tokens in one call); more than
# this in one call is refused before it is read. The router's channels use the same options.
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
#: Reconnect attempts of a channel to a group that went away come at most this far apart (gRPC's default grows
#: to 120 s). While a channel waits to reconnect, calls on it fail at once: a group restarted at the same
#: address (a Serve replica on its fixed port) was refused every call for up to the backoff after it served
#: again, 3-4 s in the chaos benchmark's sole-group kill. A dial a second to a dead address costs nothing.
MAX_RECONNECT_BACKOFF_MS = 1000
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
]


def group_channel(address: str, tls: TlsConfig | None = None) -> grpc.Channel:
    """A channel to the group at ``address`` (router and orchestrator alike): these message limits,
    and mutual TLS when configured (``tls``, default the environment's), verifying the name the
    groups' certificate is issued for (``group_server_name``) since groups are dialled by IP."""
    tls = tls if tls is not None else from_env(TlsConfig)
    return secure_or_insecure_channel(address, CHANNEL_OPTIONS, tls=tls, server_name=tls.group_server_name)


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
