"""The orchestrator's admin API from a command line: one channel helper and one call helper,
shared by ``migrate``, ``migrations``, ``drift``, ``experts``, ``quarantine`` and ``release``.

Calls carry the admin identity (``security.admin_auth``) and the channel follows the
TLS settings of the environment; an unreachable orchestrator or a refused call becomes a
one-line ExpertMeshError, so the CLI exits 2.
"""

from __future__ import annotations

import os
import queue
import time

import grpc

from expertmesh.contracts.errors import GroupUnavailable, InvalidRequest
from expertmesh.infra.security.admin_auth import admin_metadata
from expertmesh.infra.security.tls import secure_or_insecure_channel
from expertmesh.v1 import admin_pb2_grpc as pb_grpc

DEFAULT_ADMIN = os.environ.get("EXPERTMESH_ADMIN_ADDRESS", "127.0.0.1:50052")


def connect(address: str, timeout: float = 5.0) -> tuple[grpc.Channel, pb_grpc.AdminStub]:
    """A ready channel to the admin API at ``address`` and its stub; the caller closes the channel."""
    channel = secure_or_insecure_channel(address)
    if not _ready(channel, timeout):
        channel.close()
        raise GroupUnavailable(
            f"no orchestrator admin API at {address}; is `expertmesh orchestrator` (or `up --orchestrator`) running?"
        )
    return channel, pb_grpc.AdminStub(channel)


def _ready(channel: grpc.Channel, timeout: float) -> bool:
    """Whether the channel connects within ``timeout``. A first failed attempt (connection refused, a
    failed handshake) answers at once: ``channel_ready_future`` would wait out the whole timeout
    through gRPC's reconnect backoff."""
    states: queue.Queue[grpc.ChannelConnectivity] = queue.Queue()
    channel.subscribe(states.put, try_to_connect=True)
    deadline = time.monotonic() + timeout
    try:
        while True:
            state = states.get(timeout=max(0.0, deadline - time.monotonic()))
            if state is grpc.ChannelConnectivity.READY:
                return True
            if state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN):
                return False
    except queue.Empty:
        return False
    finally:
        channel.unsubscribe(states.put)


def call(method, request, timeout: float = 30):
    """One unary admin RPC; its error as a one-line ExpertMeshError."""
    try:
        return method(request, timeout=timeout, metadata=admin_metadata())
    except grpc.RpcError as err:
        raise InvalidRequest(f"{err.code().name}: {err.details()}") from None


def stream(method, request):
    """A server-streaming admin RPC (the caller handles its RpcError: it may end by cancellation)."""
    return method(request, metadata=admin_metadata())
