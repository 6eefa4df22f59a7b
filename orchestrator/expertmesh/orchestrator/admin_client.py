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
from collections.abc import Iterator

import grpc

from expertmesh.contracts.errors import GroupUnavailable, InvalidRequest
from expertmesh.infra.security.admin_auth import admin_metadata
from expertmesh.infra.security.tls import secure_or_insecure_channel
from expertmesh.v1 import admin_pb2 as pb
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


#: phases after which a migration changes no more
_ENDED = (pb.MIGRATION_PHASE_SUCCEEDED, pb.MIGRATION_PHASE_FAILED, pb.MIGRATION_PHASE_ROLLED_BACK)


def follow(stub: pb_grpc.AdminStub, migration_id: str = "", poll_s: float = 0.5) -> Iterator[pb.Migration]:
    """What ``WatchMigrations`` streams (every record, then each change; with an id, until it ends), from the
    stream, or, when the orchestrator serves as many watch streams as it will (RESOURCE_EXHAUSTED), by polling
    GetMigration / ListMigrations every ``poll_s``. Other errors: the caller's, as with ``stream``."""
    seen: dict[str, pb.Migration] = {}
    try:
        for update in stream(stub.WatchMigrations, pb.WatchMigrationsRequest(id=migration_id)):
            seen[update.id] = update
            yield update
        return
    except grpc.RpcError as err:
        if err.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
    while True:
        if migration_id:
            current = [stub.GetMigration(pb.GetMigrationRequest(id=migration_id), metadata=admin_metadata())]
        else:
            current = stub.ListMigrations(pb.ListMigrationsRequest(), metadata=admin_metadata()).migrations
        for migration in current:
            if seen.get(migration.id) != migration:
                seen[migration.id] = migration
                yield migration
        if migration_id and current[0].phase in _ENDED:
            return
        time.sleep(poll_s)
