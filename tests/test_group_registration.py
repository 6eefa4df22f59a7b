"""A group keeps its endpoint in the state store: a flushed store heals without restarts; a group of
another checkpoint than the deployment's routing table names never registers there."""

import time

import grpc
import pytest

from expertmesh.contracts.errors import ForeignCheckpoint
from expertmesh.contracts.routing_table import ModelIdentity, RoutingTable
from expertmesh.expert_group.registration import EndpointRegistration
from expertmesh.store import open_store


def test_a_flushed_endpoint_comes_back_by_itself():
    store = open_store()
    registration = EndpointRegistration(store, "g7", "10.0.0.7:50107", interval_s=0.05).start()
    assert store.endpoints() == {"g7": "10.0.0.7:50107"}
    store._kv._hashes.clear()  # FLUSHDB of the in-process backend
    deadline = time.monotonic() + 5
    while store.endpoints() != {"g7": "10.0.0.7:50107"}:
        assert time.monotonic() < deadline, "the group never registered again"
        time.sleep(0.01)
    registration.stop()


OURS = ModelIdentity("a" * 16, (0, 1), 4)
THEIRS = ModelIdentity("b" * 16, (0, 1), 4)
REPLICAS = {(layer, e): ("g7",) for layer in (0, 1) for e in range(4)}


def test_a_group_of_another_checkpoint_does_not_register_beside_the_deployments_table():
    """Registered under g7's name, a group of another checkpoint of the same shapes would replace the good
    g7's address and routers would sum its partial sums. It is refused at start, naming both checkpoints and
    what to do; a group of the table's checkpoint registers."""
    store = open_store()
    store.set_endpoint("g7", "10.0.0.7:50107")
    assert store.publish_routing_table(RoutingTable(1, 4, REPLICAS, model=OURS))
    with pytest.raises(ForeignCheckpoint) as err:
        EndpointRegistration(store, "g7", "10.0.0.9:50107", model=THEIRS).start()
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert str(err.value).startswith(
        "expert group g7 holds another model than this deployment's routing table is for "
        f"(checkpoint fingerprint {THEIRS.fingerprint}, not {OURS.fingerprint}): it does not register"
    )
    assert "start it from the deployment's checkpoint, or under a deployment of its own" in str(err.value)
    assert store.endpoints() == {"g7": "10.0.0.7:50107"}, "the good group's address stays"
    EndpointRegistration(store, "g7", "10.0.0.8:50107", interval_s=0.05, model=OURS).start().stop()
    assert store.endpoints() == {"g7": "10.0.0.8:50107"}


def test_a_registered_group_stops_registering_once_the_table_is_another_checkpoints(caplog):
    """A group that registered before a table named the deployment's model (or under an older one) stops
    writing its address once the table is another checkpoint's, and says why once."""
    store = open_store()
    registration = EndpointRegistration(store, "g7", "10.0.0.7:50107", interval_s=0.02, model=THEIRS).start()
    assert store.endpoints() == {"g7": "10.0.0.7:50107"}, "no table yet: nothing to compare with"
    assert store.publish_routing_table(RoutingTable(1, 4, REPLICAS, model=OURS))
    store.remove_endpoint("g7")
    time.sleep(0.3)  # a dozen rounds
    assert store.endpoints() == {}
    registration.stop()
    refusals = [r for r in caplog.records if "expert group g7 holds another model" in r.getMessage()]
    assert len(refusals) == 1 and refusals[0].levelname == "ERROR"
