"""The orchestrator's reconcile decision (pure) and one round against the in-process store."""

import pytest
import yaml

from expertmesh.contracts.errors import PlacementError
from expertmesh.contracts.group_map import GroupPlacement
from expertmesh.contracts.routing_table import ModelIdentity, RoutingTable
from expertmesh.models.checkpoint import MoESpec
from expertmesh.orchestrator.reconcile import Reconciler, next_table, observed_table
from expertmesh.store import open_store

SPEC = MoESpec("mixtral", 2, (0, 1), 2, 1, 8, ("gate_up_proj", "down_proj"))
A = GroupPlacement({"g0": ((0, 0), (0, 1), (1, 0), (1, 1))})
B = GroupPlacement({"g0": ((0, 0), (1, 0)), "g1": ((0, 1), (1, 1))})


def test_next_table_publishes_first_then_only_on_change():
    model = ModelIdentity.of(SPEC)
    first = next_table(None, A, model)
    assert first.version == 1 and first.replicas == A.hosts() and first.model == model
    assert next_table(first, A, model) is None
    second = next_table(first, B, model)
    assert second.version == 2 and second.replicas[(0, 1)] == ("g1",)
    # a table without an identity (written before tables carried one) is this model's when its shape fits;
    # another model's is not
    assert next_table(RoutingTable(1, 2, A.hosts()), A, model) is None
    foreign = RoutingTable(1, 2, A.hosts(), model=ModelIdentity("ffff", (0, 1), 2))
    assert next_table(foreign, A, model).model == model


def test_reconciler_rounds(tmp_path):
    path = tmp_path / "placement.yaml"
    path.write_text(yaml.safe_dump({"groups": {"g0": {"*": [0, 1]}}}))
    store = open_store()
    reconciler = Reconciler(store, SPEC, path)
    assert reconciler.reconcile_once().version == 1
    assert reconciler.reconcile_once() is None
    path.write_text(yaml.safe_dump({"groups": {"g0": {"*": [0]}, "g1": {"*": [1]}}}))
    assert reconciler.reconcile_once().version == 2
    path.write_text(yaml.safe_dump({"groups": {"g0": {"*": [0]}}}))
    with pytest.raises(PlacementError, match="unhosted"):
        reconciler.reconcile_once()
    assert store.routing_table_version() == 2


def test_a_restarted_reconciler_keeps_live_edits_until_the_file_changes(tmp_path):
    """Migrations edit the table; re-applying an unchanged placement file would undo them."""
    path = tmp_path / "placement.yaml"
    path.write_text(yaml.safe_dump({"groups": {"g0": {"*": [0]}, "g1": {"*": [1]}}}))
    store = open_store()
    assert Reconciler(store, SPEC, path).reconcile_once().version == 1
    from expertmesh.contracts.routing_table import RoutingTable

    moved = dict(store.routing_table().replicas)
    moved[(0, 1)] = ("g0",)
    assert store.publish_routing_table(RoutingTable(2, 2, moved))
    assert Reconciler(store, SPEC, path).reconcile_once() is None  # a restart
    assert store.routing_table().replicas[(0, 1)] == ("g0",)
    path.write_text(yaml.safe_dump({"groups": {"g0": {"*": [0, 1]}, "g1": {"*": [1]}}}))
    assert Reconciler(store, SPEC, path).reconcile_once().version == 3


def test_ups_table_keeper_leaves_a_move_made_right_after_the_start_alone():
    """`expertmesh up --orchestrator` publishes its first table itself, and its keeper (the reconciler that
    gives a flushed store its table back) takes its first round at once, over that table: a live move
    published before the keeper's next round stays, not overwritten with the start's placement."""
    from types import SimpleNamespace

    from expertmesh.cli.up import _table_keeper

    store, model = open_store(), ModelIdentity.of(SPEC)
    assert store.publish_routing_table(RoutingTable(1, 2, B.hosts(), model=model))
    plane = SimpleNamespace(store=store, store_is_shared=True, checkpoint=SimpleNamespace(spec=SPEC), placement=B)
    (keeper,) = _table_keeper(plane)
    moved = {**store.routing_table().replicas, (0, 1): ("g1", "g0")}  # a move's switch, make before break
    assert store.publish_routing_table(RoutingTable(2, 2, moved, model=model))
    keeper.update()
    assert store.routing_table().version == 2 and store.routing_table().replicas[(0, 1)] == ("g1", "g0")


def test_a_flushed_store_gets_the_table_back_at_a_later_version(tmp_path):
    """Routers cached version N; a table restored as version 1 would look older than what they serve."""
    path = tmp_path / "placement.yaml"
    path.write_text(yaml.safe_dump({"groups": {"g0": {"*": [0]}, "g1": {"*": [1]}}}))
    store = open_store()
    reconciler = Reconciler(store, SPEC, path)
    assert reconciler.reconcile_once().version == 1
    path.write_text(yaml.safe_dump({"groups": {"g0": {"*": [0, 1]}, "g1": {"*": [1]}}}))
    assert reconciler.reconcile_once().version == 2
    store._kv._values.clear(), store._kv._hashes.clear()  # what FLUSHDB does to the in-process backend
    assert reconciler.reconcile_once().version == 3
    assert store.routing_table().replicas[(0, 1)] == ("g0", "g1")


def test_observed_table_lists_only_replicas_that_hold_their_experts():
    model = ModelIdentity.of(SPEC)
    # the file says g0 holds (0, 1); a live move put it on g1 and g0 unloaded it
    held = {"g0": frozenset({(0, 0), (1, 0), (1, 1)}), "g1": frozenset({(0, 1), (1, 1)})}
    table = observed_table(A, held, model, version=8)
    assert table.version == 8 and table.model == model
    assert table.replicas == {(0, 0): ("g0",), (0, 1): ("g1",), (1, 0): ("g0",), (1, 1): ("g0", "g1")}
    # nobody reported (0, 1): the file's group stays listed rather than leaving it unhosted
    assert observed_table(A, {"g0": frozenset({(0, 0), (1, 0), (1, 1)})}, model, 2).replicas[(0, 1)] == ("g0",)


def test_a_flushed_store_is_rebuilt_from_what_the_groups_hold_above_the_routers_versions(tmp_path):
    """Re-applying the placement file after a flush listed expert (0, 1) on g0 again, which had unloaded it
    in a move: NOT_FOUND for every token routed there, while routers went back to a lower version."""
    from expertmesh.store import RouterHeartbeat

    path = tmp_path / "placement.yaml"
    path.write_text(yaml.safe_dump({"groups": {"g0": {"*": [0, 1]}}}))
    store = open_store()
    store.publish_router_heartbeat(RouterHeartbeat("r1", 7, 0.0))  # a router serving version 7 (a live move's)
    held: dict = {}
    now = [0.0]
    reconciler = Reconciler(
        store,
        SPEC,
        path,
        observe=lambda groups: {g: held[g] for g in groups if g in held},
        observe_grace_s=30,
        clock=lambda: now[0],
    )
    assert reconciler.reconcile_once() is None, "published before the groups said what they hold"
    held.update({"g0": frozenset({(0, 0), (1, 0), (1, 1)}), "g1": frozenset({(0, 1)})})
    store.set_endpoint("g1", "127.0.0.1:1")  # g1 is not in the file: found through its registration
    table = reconciler.reconcile_once()
    assert table.version == 8 and table.replicas[(0, 1)] == ("g1",) and table.replicas[(1, 1)] == ("g0",)
    assert reconciler.reconcile_once() is None  # the file, unchanged, is not applied over it

    # a group that never answers: after the grace period its experts are listed as the file says
    other = open_store()
    late = Reconciler(other, SPEC, path, observe=lambda groups: {}, observe_grace_s=30, clock=lambda: now[0])
    assert late.reconcile_once() is None
    now[0] = 31.0
    assert late.reconcile_once().replicas == A.hosts()


def test_placement_steps_make_before_break():
    from expertmesh.orchestrator.migration.state import MigrationMode
    from expertmesh.orchestrator.reconcile import Step, placement_steps

    current = RoutingTable(3, 2, {(0, 0): ("g0",), (0, 1): ("g0", "g1"), (1, 0): ("g0",), (1, 1): ("g1",)})
    desired = GroupPlacement({"g1": ((0, 0), (1, 1)), "g2": ((0, 1), (1, 0), (1, 1))})
    assert placement_steps(current, desired) == [
        Step((0, 0), MigrationMode.REPLICATE, "g1", "g0"),  # made on g1 first; g0 lets go only after
        Step((0, 1), MigrationMode.REPLICATE, "g2", "g0"),
        Step((1, 0), MigrationMode.REPLICATE, "g2", "g0"),
        Step((1, 1), MigrationMode.REPLICATE, "g2", "g1"),
    ]
    made = RoutingTable(
        4, 2, {(0, 0): ("g0", "g1"), (0, 1): ("g0", "g1", "g2"), (1, 0): ("g0", "g2"), (1, 1): ("g1", "g2")}
    )
    assert placement_steps(made, desired, busy=[(0, 1)]) == [
        Step((0, 0), MigrationMode.EVICT, None, "g0"),
        Step((1, 0), MigrationMode.EVICT, None, "g0"),
    ]
    assert placement_steps(RoutingTable(9, 2, {p: tuple(sorted(g)) for p, g in desired.hosts().items()}), desired) == []


def test_a_changed_file_is_applied_as_migrations_once_a_runner_is_attached(tmp_path):
    from expertmesh.orchestrator.reconcile import PLACEMENT_FILE

    path = tmp_path / "placement.yaml"
    path.write_text(yaml.safe_dump({"groups": {"g0": {"*": [0, 1]}}}))
    store = open_store()
    reconciler = Reconciler(store, SPEC, path)
    assert reconciler.reconcile_once().version == 1
    submitted = []
    reconciler.use_migrations(lambda *args, **kwargs: submitted.append((args, kwargs)))
    path.write_text(yaml.safe_dump({"groups": {"g1": {"*": [0, 1]}}}))
    assert reconciler.reconcile_once() is None and store.routing_table_version() == 1  # no overwrite
    assert [a for a, _ in submitted] == [(layer, e, "g1", "g0", "replicate") for layer in (0, 1) for e in (0, 1)]
    assert all(k == {"initiator": PLACEMENT_FILE} for _, k in submitted)
    # the migrations ran (as the runner would): every expert on g1 only; the file now counts as applied
    store.publish_routing_table(RoutingTable(2, 2, {p: ("g1",) for p in A.hosts()}, model=ModelIdentity.of(SPEC)))
    submitted.clear()
    assert reconciler.reconcile_once() is None and submitted == []
    assert store.placement_digest() is not None


def test_keep_out_drops_out_of_service_replicas_but_never_unhosts_an_expert():
    from expertmesh.orchestrator.reconcile import keep_out

    replicas = {(0, 0): ("g0", "g1"), (0, 1): ("g1",), (1, 0): ("g0", "g1"), (1, 1): ("g0",)}
    out = {(0, 0, "g1"), (0, 1, "g1"), (1, 0, "g0"), (1, 0, "g1"), (5, 5, "g9")}
    assert keep_out(replicas, out) == {
        (0, 0): ("g0",),
        (0, 1): ("g1",),  # its only replica: listed, the quarantine entry makes routers fall back
        (1, 0): ("g0", "g1"),  # every replica out: all stay listed
        (1, 1): ("g0",),
    }
    assert keep_out(replicas, ()) == replicas
