"""The migration executor against real expert-group gRPC servers on loopback
(``HostedExperts`` + ``start_server``, no Ray) and a state store: in-process for
most cases, the loopback redis-server for one.

Routers are stood in for by their heartbeats, published straight through the
store API (``StateStore.publish_router_heartbeat``), the same store protocol a
router's ``router.heartbeat.Heartbeat`` speaks: ``FollowingRouter`` reports the
store's current table version every few milliseconds, as a router that switches
at every step boundary would; a stuck router is one heartbeat that never moves on.

The groups, placement and pair are ``migration_mesh``'s (shared with the
Kubernetes controller's tests).
"""

from __future__ import annotations

import shutil
import threading
import time
import uuid

import grpc
import pytest
import torch
from migration_mesh import EXPERT, FAST, LAYER, PAIR, PLACEMENT, FollowingRouter, Mesh, start_mesh
from safetensors.torch import load_file, save_file

from expertmesh.contracts.errors import InvalidRequest, MigrationRefused
from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.models.checkpoint import Checkpoint
from expertmesh.models.hosted_experts import HostedExperts
from expertmesh.orchestrator.migration.executor import MigrationExecutor
from expertmesh.orchestrator.migration.plan import PHASES
from expertmesh.orchestrator.migration.state import Failure, MigrationMode, Phase, load
from expertmesh.store import QuarantinedReplica, RouterHeartbeat, open_store
from expertmesh.v1 import experts_pb2 as pb
from expertmesh.v1 import experts_pb2_grpc as pb_grpc


@pytest.fixture
def path(tiny_checkpoints):
    return tiny_checkpoints("mixtral")


@pytest.fixture
def mesh(path):
    m = start_mesh(open_store("memory://"), path)
    yield m
    for group in m.groups.values():
        group.server.stop(0)


def phases(migration) -> list[Phase]:
    return [h.phase for h in migration.history]


def assert_move_done(mesh: Mesh, migration) -> None:
    assert migration.phase is Phase.SUCCEEDED, migration.reason
    assert phases(migration) == list(PHASES[MigrationMode.MOVE])
    versions = [h.table_version for h in migration.history]
    assert versions == sorted(versions)
    version_at = {h.phase: h.table_version for h in migration.history}
    assert (version_at[Phase.CONFIRMING], version_at[Phase.DRAINING]) == (2, 3), "make as v2, break as v3"
    table = mesh.store.routing_table()
    assert table.version == 3 and table.replicas[PAIR] == ("g2",)
    assert {p: g for p, g in table.replicas.items() if p != PAIR} == {
        p: g for p, g in PLACEMENT.hosts().items() if p != PAIR
    }
    assert PAIR in mesh.held("g2") and PAIR not in mesh.held("g0")
    assert migration.bytes_loaded > 0 and migration.completed_at >= migration.started_at


# -- success -------------------------------------------------------------------------------


def test_move_succeeds(mesh):
    # a router that died long ago: its stale heartbeat at version 0 must not hold the drain up
    mesh.store.publish_router_heartbeat(RouterHeartbeat("gone", 0, time.time() - 1000))
    executor = MigrationExecutor(mesh.store, **FAST)
    with FollowingRouter(mesh.store, "r1"), FollowingRouter(mesh.store, "r2"):
        migration = executor.run(executor.submit(LAYER, EXPERT, target="g2").id)
    assert_move_done(mesh, migration)
    assert load(mesh.store, migration.id) == migration, "the stored record is the final one"
    executor.close()


def test_replicate_keeps_both(mesh):
    executor = MigrationExecutor(mesh.store, **FAST)
    migration = executor.run(executor.submit(LAYER, EXPERT, target="g2", mode="replicate").id)
    assert migration.phase is Phase.SUCCEEDED, migration.reason
    assert phases(migration) == list(PHASES[MigrationMode.REPLICATE])
    assert mesh.store.routing_table().version == 2 and mesh.replicas() == ("g0", "g2")
    assert PAIR in mesh.held("g0") and PAIR in mesh.held("g2")
    executor.close()


def test_evict_removes_a_replica_but_never_the_last(mesh):
    executor = MigrationExecutor(mesh.store, **FAST)
    executor.run(executor.submit(LAYER, EXPERT, target="g2", mode="replicate").id)
    with FollowingRouter(mesh.store, "r1"):
        migration = executor.run(executor.submit(LAYER, EXPERT, source="g0", mode="evict").id)
    assert migration.phase is Phase.SUCCEEDED, migration.reason
    assert phases(migration) == list(PHASES[MigrationMode.EVICT])
    assert mesh.replicas() == ("g2",) and PAIR not in mesh.held("g0") and PAIR in mesh.held("g2")
    with pytest.raises(MigrationRefused, match="only replica"):
        executor.submit(LAYER, EXPERT, mode="evict")
    assert mesh.replicas() == ("g2",)
    executor.close()


def test_submit_refuses_what_cannot_be_done(mesh):
    executor = MigrationExecutor(mesh.store, **FAST)
    with pytest.raises(InvalidRequest, match="unknown group 'g9'"):
        executor.submit(LAYER, EXPERT, target="g9")
    with pytest.raises(MigrationRefused, match="'g1' does not serve layer 1 expert 1"):
        executor.submit(LAYER, EXPERT, target="g2", source="g1")
    with pytest.raises(MigrationRefused, match="'g0' already serves"):
        executor.submit(LAYER, 0, target="g0")
    with pytest.raises(InvalidRequest, match="unknown migration mode 'swap'; use move, replicate, evict"):
        executor.submit(LAYER, EXPERT, target="g2", mode="swap")
    with pytest.raises(InvalidRequest, match="needs a target"):
        executor.submit(LAYER, EXPERT)
    with pytest.raises(MigrationRefused, match="layer 5 expert 1 is not in routing table v1"):
        executor.submit(5, EXPERT, target="g2")
    mesh.store.set_quarantined(QuarantinedReplica(LAYER, EXPERT, "g2", "quarantined", "corrupt", 0.0, True))
    with pytest.raises(MigrationRefused, match="'g2' holds a quarantined copy of layer 1 expert 1"):
        executor.submit(LAYER, EXPERT, target="g2")
    mesh.store.clear_quarantined(LAYER, EXPERT, "g2")
    pending = executor.submit(LAYER, EXPERT, target="g2")
    with pytest.raises(MigrationRefused, match=f"{pending.id}.* is still pending"):
        executor.submit(LAYER, EXPERT, target="g1")
    executor.run(executor.submit(0, 0, target="g2", mode="replicate").id)
    with pytest.raises(InvalidRequest, match=r"2 replicas \['g0', 'g2'\]; name the source"):
        executor.submit(0, 0, target="g1")
    assert mesh.store.routing_table().version == 2, "refusals change nothing"
    executor.close()


# -- failures before the switch ---------------------------------------------------------------


def perturbed_copy(path, tmp_path):
    """The checkpoint with one weight of layer 1, expert 1 changed (w2[0, 0] += 0.5)."""
    copy = tmp_path / "perturbed"
    shutil.copytree(path, copy)
    tensors = load_file(copy / "model.safetensors")
    key = f"model.layers.{LAYER}.block_sparse_moe.experts.{EXPERT}.w2.weight"
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] += 0.5
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def test_canary_mismatch_fails_and_cleans_the_target(path, tmp_path):
    """The target group is started from a checkpoint copy whose tensor for the moved expert is
    perturbed on disk, so it loads wrong weights through the ordinary LoadExperts path."""
    mesh = start_mesh(open_store("memory://"), path, target_path=perturbed_copy(path, tmp_path))
    try:
        before = mesh.store.routing_table()
        executor = MigrationExecutor(mesh.store, **FAST)
        migration = executor.run(executor.submit(LAYER, EXPERT, target="g2").id)
        assert migration.phase is Phase.FAILED and migration.failure is Failure.CANARY_MISMATCH
        assert "canary mismatch" in migration.reason and "max |Δ|" in migration.reason
        assert phases(migration) == [Phase.PENDING, Phase.LOADING, Phase.CHECKING, Phase.FAILED]
        assert mesh.store.routing_table() == before, "table unchanged"
        assert mesh.held("g2") == set(), "target clean"
        assert PAIR in mesh.held("g0")
        executor.close()
    finally:
        for group in mesh.groups.values():
            group.server.stop(0)


def test_a_target_of_another_checkpoint_is_refused_before_anything_loads(path, tiny_checkpoints):
    """g2 started from another checkpoint of the same shapes (a wrong volume): the executor, which knows the
    deployment's checkpoint, fails the move at once naming both, before g2 loads anything; a table rebuilt
    from what runs never lists g2. (Before, the move loaded the expert onto g2, and only the canary told
    the two apart.)"""
    from expertmesh.orchestrator.reconcile import what_runs

    foreign = tiny_checkpoints("mixtral", seed=1)
    ours, theirs = Checkpoint(path).spec.fingerprint, Checkpoint(foreign).spec.fingerprint
    mesh = start_mesh(open_store("memory://"), path, target_path=foreign)
    try:
        before = mesh.store.routing_table()
        executor = MigrationExecutor(mesh.store, model_fingerprint=ours, **FAST)
        migration = executor.run(executor.submit(LAYER, EXPERT, target="g2").id)
        assert migration.phase is Phase.FAILED and migration.failure is Failure.GROUP_FAILED
        assert f"FAILED_PRECONDITION: it holds checkpoint {theirs}, not this deployment's {ours}" in migration.reason
        assert phases(migration) == [Phase.PENDING, Phase.FAILED]
        assert mesh.store.routing_table() == before and mesh.held("g2") == set()
        executor.close()
        observe, close = what_runs(mesh.store, ours)
        assert set(observe(["g0", "g1", "g2"])) == {"g0", "g1"}
        close()
    finally:
        for group in mesh.groups.values():
            group.server.stop(0)


def test_over_budget_target_fails_before_anything_changes(path):
    one_expert = HostedExperts(Checkpoint(path)).expert_bytes([PAIR])
    mesh = start_mesh(open_store("memory://"), path, target_budget=one_expert - 1)
    try:
        executor = MigrationExecutor(mesh.store, **FAST)
        migration = executor.run(executor.submit(LAYER, EXPERT, target="g2").id)
        assert migration.phase is Phase.FAILED and migration.failure is Failure.OVER_BUDGET
        assert "over its memory budget" in migration.reason and f"of {one_expert - 1} bytes" in migration.reason
        assert mesh.store.routing_table().version == 1 and mesh.replicas() == ("g0",)
        assert mesh.held("g2") == set() and PAIR in mesh.held("g0")
        executor.close()
    finally:
        for group in mesh.groups.values():
            group.server.stop(0)


# -- failures after the switch ------------------------------------------------------------------


def test_router_stuck_before_the_make_leaves_both_replicas_serving(mesh):
    """A live router stays on v1 ({g0}): v2 ({g0, g2}) is never acknowledged, so the break is never
    published. The move fails naming the router; nothing is unloaded and the table stays at v2,
    which lists exactly the two groups that hold the expert (left serving, not rolled back)."""
    mesh.store.publish_router_heartbeat(RouterHeartbeat("r-stuck", 1, time.time()))
    executor = MigrationExecutor(mesh.store, poll_s=0.01, drain_timeout_s=0.3)
    with FollowingRouter(mesh.store, "r-ok"):
        migration = executor.run(executor.submit(LAYER, EXPERT, target="g2").id)
    assert migration.phase is Phase.FAILED and migration.failure is Failure.DRAIN_TIMEOUT
    assert "'r-stuck' (v1) not yet serving routing table v2" in migration.reason and "'r-ok'" not in migration.reason
    assert phases(migration)[-2:] == [Phase.CONFIRMING, Phase.FAILED]
    assert mesh.store.routing_table().version == 2 and mesh.replicas() == ("g0", "g2")
    assert PAIR in mesh.held("g0") and PAIR in mesh.held("g2")
    executor.close()


def test_router_stuck_before_the_break_lists_the_source_again(mesh):
    """A live router acknowledges v2 ({g0, g2}) and stops there: v3 ({g2}) never drains, so the
    source stays loaded and, still holding the expert, is listed again (v4 = {g0, g2}): the
    router keeps using what it uses, and nothing loaded is missing from the table."""
    executor = MigrationExecutor(mesh.store, poll_s=0.01, drain_timeout_s=1.0)
    with FollowingRouter(mesh.store, "r-stuck", stop_at=2):
        migration = executor.run(executor.submit(LAYER, EXPERT, target="g2").id)
    assert migration.phase is Phase.FAILED and migration.failure is Failure.DRAIN_TIMEOUT
    assert "'r-stuck' (v2) not yet serving routing table v3" in migration.reason
    assert phases(migration)[-2:] == [Phase.DRAINING, Phase.FAILED]
    assert mesh.store.routing_table().version == 4 and mesh.replicas() == ("g0", "g2")
    assert migration.table_version == 4
    assert PAIR in mesh.held("g0") and PAIR in mesh.held("g2")
    executor.close()


def test_evict_that_does_not_drain_rolls_back(mesh):
    executor = MigrationExecutor(mesh.store, poll_s=0.01, drain_timeout_s=0.3)
    executor.run(executor.submit(LAYER, EXPERT, target="g2", mode="replicate").id)  # v2: (g0, g2)
    mesh.store.publish_router_heartbeat(RouterHeartbeat("r-stuck", 2, time.time()))
    migration = executor.run(executor.submit(LAYER, EXPERT, source="g0", mode="evict").id)
    assert migration.phase is Phase.ROLLED_BACK and migration.failure is Failure.DRAIN_TIMEOUT
    assert "'r-stuck'" in migration.reason and "as before" in migration.reason
    assert mesh.store.routing_table().version == 4 and mesh.replicas() == ("g0", "g2")
    assert PAIR in mesh.held("g0") and PAIR in mesh.held("g2")
    executor.close()


def test_drain_waits_for_older_calls_in_flight_on_the_source(mesh):
    """A Dispatch a router sent with v2 is still executing on the source (its compute is held on an
    event) when every router already serves v3: the source is not unloaded until it returns."""
    executor = MigrationExecutor(mesh.store, **FAST)
    source = mesh.groups["g0"].hosted
    release, entered = threading.Event(), threading.Event()
    compute = source.compute

    def held_compute(*args):
        entered.set()
        release.wait(10)
        return compute(*args)

    with FollowingRouter(mesh.store, "r1"):
        migration = executor.submit(LAYER, EXPERT, target="g2")
        while migration.phase is not Phase.DRAINING:
            migration = executor.step(migration.id)
        assert migration.table_version == 3
        source.compute = held_compute
        request = pb.DispatchRequest(
            layer=LAYER,
            hidden_states=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 32], data=bytes(4 * 32)),
            expert_ids=pb.Tensor(dtype=pb.DTYPE_INT32, shape=[1, 1], data=EXPERT.to_bytes(4, "little")),
            routing_weights=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 1], data=torch.ones(1).numpy().tobytes()),
            routing_table_version=2,
        )
        channel = grpc.insecure_channel(mesh.groups["g0"].address)
        call = pb_grpc.ExpertGroupStub(channel).Dispatch.future(request, timeout=20)
        assert entered.wait(10)
        stepped = threading.Thread(target=lambda: executor.step(migration.id))
        stepped.start()
        time.sleep(0.3)
        assert load(mesh.store, migration.id).phase is Phase.DRAINING and PAIR in mesh.held("g0")
        release.set()
        call.result()
        stepped.join(10)
        channel.close()
    assert load(mesh.store, migration.id).phase is Phase.UNLOADING
    assert_move_done(mesh, executor.run(migration.id))
    executor.close()


def test_target_lost_after_the_switch_rolls_back(mesh):
    """The target's server stops after the make (v2 = {g0, g2}) while a router is still on v1: the
    drain times out, the source still holds the expert and the target no longer answers, so the
    pair goes back to {g0} as before the move (v3)."""
    executor = MigrationExecutor(mesh.store, poll_s=0.01, drain_timeout_s=0.3)
    migration = executor.submit(LAYER, EXPERT, target="g2")
    while migration.phase is not Phase.CONFIRMING:
        migration = executor.step(migration.id)
    mesh.store.publish_router_heartbeat(RouterHeartbeat("r-stuck", 1, time.time()))
    mesh.groups["g2"].server.stop(0)
    migration = executor.run(migration.id)
    assert migration.phase is Phase.ROLLED_BACK and migration.failure is Failure.DRAIN_TIMEOUT
    assert mesh.store.routing_table().version == 3 and mesh.replicas() == ("g0",)
    assert PAIR in mesh.held("g0")
    executor.close()


def test_span_and_counter_per_migration(mesh, monkeypatch):
    """One span per run with an event per phase, and ``expertmesh.migrations`` counted by result,
    reason and mode (SDK providers local to this test, patched in for the global API)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from expertmesh.orchestrator.migration import executor as executor_module

    spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    monkeypatch.setattr(executor_module, "tracer", lambda: tracer_provider.get_tracer("expertmesh"))
    monkeypatch.setattr(
        executor_module, "meter", lambda: MeterProvider(metric_readers=[reader]).get_meter("expertmesh")
    )

    executor = MigrationExecutor(mesh.store, **FAST)
    executor.run(executor.submit(LAYER, EXPERT, target="g2", mode="replicate").id)
    mesh.groups["g1"].server.stop(0)
    failed = executor.run(executor.submit(0, 0, target="g1").id)
    assert failed.phase is Phase.FAILED and failed.failure is Failure.GROUP_FAILED and "'g1'" in failed.reason

    ok, bad = spans.get_finished_spans()
    assert ok.name == bad.name == "expertmesh.migration"
    assert ok.attributes["expertmesh.migration.result"] == "succeeded" and ok.attributes["expertmesh.layer"] == LAYER
    assert [e.name for e in ok.events] == [
        f"expertmesh.migration.{p.value}" for p in PHASES[MigrationMode.REPLICATE][1:]
    ]
    assert not bad.status.is_ok and bad.attributes["expertmesh.migration.result"] == "failed"
    (metric,) = [m for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics for m in sm.metrics]
    assert metric.name == "expertmesh.migrations"
    counts = {tuple(sorted(p.attributes.items())): p.value for p in metric.data.data_points}
    assert counts == {
        (("mode", "replicate"), ("reason", "none"), ("result", "succeeded")): 1,
        (("mode", "move"), ("reason", "group_failed"), ("result", "failed")): 1,
    }
    executor.close()


# -- restarts -----------------------------------------------------------------------------------


def test_a_new_executor_finishes_a_move_the_old_one_left_draining(mesh):
    """The first executor is 'killed' once the break is published (phase DRAINING): it is dropped
    without another call. A new executor on the same store finds the record and finishes the move."""
    with FollowingRouter(mesh.store, "r1"):
        first = MigrationExecutor(mesh.store, **FAST)
        migration = first.submit(LAYER, EXPERT, target="g2")
        while migration.phase is not Phase.DRAINING:
            migration = first.step(migration.id)
        del first
        assert PAIR in mesh.held("g0") and mesh.replicas() == ("g2",)
        second = MigrationExecutor(mesh.store, **FAST)
        (finished,) = second.resume_all()
    assert finished.id == migration.id
    assert_move_done(mesh, finished)
    assert second.resume_all() == [], "nothing left half done"
    second.close()


def test_resume_after_a_publish_that_was_not_recorded(mesh):
    """Killed right after publishing the make table but before saving the record (still SWITCHING):
    the resumed migration sees its edit in the store and does not publish it twice."""
    executor = MigrationExecutor(mesh.store, **FAST)
    migration = executor.submit(LAYER, EXPERT, target="g2")
    while migration.phase is not Phase.SWITCHING:
        migration = executor.step(migration.id)
    table = mesh.store.routing_table()
    assert mesh.store.publish_routing_table(
        RoutingTable(2, table.num_experts, {**table.replicas, PAIR: ("g0", "g2")}, table.shares)
    )
    with FollowingRouter(mesh.store, "r1"):
        (finished,) = MigrationExecutor(mesh.store, **FAST).resume_all()
    assert_move_done(mesh, finished)


# -- the Redis store ------------------------------------------------------------------------------


def test_move_on_the_redis_store(path, redis_url):
    namespace = f"test-migration-{uuid.uuid4().hex[:8]}"
    store = open_store(redis_url, deployment=namespace)
    mesh = start_mesh(store, path)
    try:
        executor = MigrationExecutor(store, **FAST)
        with FollowingRouter(store, "r1"):
            migration = executor.run(executor.submit(LAYER, EXPERT, target="g2").id)
        assert_move_done(mesh, migration)
        reopened = open_store(redis_url, deployment=namespace)
        assert load(reopened, migration.id) == migration, "another process reads the same record"
        reopened.close()
        executor.close()
    finally:
        for group in mesh.groups.values():
            group.server.stop(0)
        client = store._kv._client
        for key in client.scan_iter(f"{namespace}:*"):
            client.delete(key)
        store.close()
