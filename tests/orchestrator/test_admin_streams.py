"""The orchestrator's admin server under open ``WatchMigrations`` streams (real gRPC on loopback, the in-process
store): each stream holds a server thread for its life, so before, four `migrate --wait` clients took all four
threads and `Quarantine` waited for one of them to end. Now the streams served at once are capped below the
threads; one more is refused RESOURCE_EXHAUSTED, and the CLI's ``follow`` polls instead."""

from __future__ import annotations

import grpc
import pytest

from expertmesh.orchestrator import admin
from expertmesh.orchestrator.admin import start_orchestrator
from expertmesh.orchestrator.admin_client import follow
from expertmesh.orchestrator.drift.config import DriftConfig
from expertmesh.orchestrator.migration.state import Migration, MigrationMode, Phase, save
from expertmesh.store import open_store
from expertmesh.v1 import admin_pb2 as pb
from expertmesh.v1 import admin_pb2_grpc as pb_grpc
from helpers import wait_for

DONE = Migration("m-done", 0, 1, MigrationMode.MOVE, "g0", "g1", Phase.SUCCEEDED, 2, ("g0",), ())


@pytest.fixture
def orchestrator():
    store = open_store("memory://")
    save(store, DONE)  # every watch stream without an id sends it first: the stream is open once it arrived
    o = start_orchestrator(store, "127.0.0.1", 0, drift=DriftConfig())
    channel = grpc.insecure_channel(f"127.0.0.1:{o.server.port}")
    yield pb_grpc.AdminStub(channel)
    channel.close()
    o.stop()
    store.close()


def test_open_watch_streams_never_starve_the_unary_calls(orchestrator):
    stub = orchestrator
    streams = []
    try:
        for _ in range(admin.MAX_WATCH_STREAMS):
            streams.append(stub.WatchMigrations(pb.WatchMigrationsRequest()))
            assert next(streams[-1]).id == DONE.id
        # every unary call still answers (a deadline: the liveness bound, generous)
        assert [m.id for m in stub.ListMigrations(pb.ListMigrationsRequest(), timeout=20).migrations] == [DONE.id]
        with pytest.raises(grpc.RpcError) as refused:
            stub.Quarantine(pb.QuarantineRequest(layer=0, expert=1), timeout=20)
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION, "answered, not timed out"

        one_more = stub.WatchMigrations(pb.WatchMigrationsRequest())
        with pytest.raises(grpc.RpcError) as full:
            next(one_more)
        assert full.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "poll GetMigration" in full.value.details()

        # the CLI's follower polls instead, and sees the migration to its end
        assert [m.phase for m in follow(stub, DONE.id, poll_s=0.05)] == [pb.MIGRATION_PHASE_SUCCEEDED]
    finally:
        for s in streams:
            s.cancel()
    # a cancelled stream gives its slot back (once its server loop sees the cancellation)
    assert wait_for(lambda: _watched(stub) == [DONE.id], "a watch slot to be free again", 30)


def _watched(stub) -> list[str] | None:
    try:
        return [m.id for m in stub.WatchMigrations(pb.WatchMigrationsRequest(id=DONE.id))]
    except grpc.RpcError as err:
        if err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
            return None
        raise
