"""The orchestrator's reconcile decision (pure) and one round against the in-process store."""

import pytest
import yaml

from expertmesh.checkpoint import MoESpec
from expertmesh.errors import PlacementError
from expertmesh.orchestrator.reconcile import Reconciler, next_table
from expertmesh.placement import GroupPlacement
from expertmesh.routing_table import ModelIdentity, RoutingTable
from expertmesh.state import open_store

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
    # a table without the model's identity (written before tables carried it) is republished with it
    assert next_table(RoutingTable(1, 2, A.hosts()), A, model).model == model


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
    from expertmesh.routing_table import RoutingTable

    moved = dict(store.routing_table().replicas)
    moved[(0, 1)] = ("g0",)
    assert store.publish_routing_table(RoutingTable(2, 2, moved))
    assert Reconciler(store, SPEC, path).reconcile_once() is None  # a restart
    assert store.routing_table().replicas[(0, 1)] == ("g0",)
    path.write_text(yaml.safe_dump({"groups": {"g0": {"*": [0, 1]}, "g1": {"*": [1]}}}))
    assert Reconciler(store, SPEC, path).reconcile_once().version == 3


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
