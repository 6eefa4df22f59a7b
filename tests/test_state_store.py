"""The state store against both backends: in-process and a real redis-server
(the one `make test` starts on loopback)."""

import re
import threading

import pytest

from expertmesh.contracts.group_map import GroupPlacement
from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.store import open_store


@pytest.fixture(params=["memory", "redis"])
def store(request):
    if request.param == "memory":
        s = open_store("memory://")
    else:
        s = open_store(
            request.getfixturevalue("redis_url"),
            deployment=re.sub(r"[^A-Za-z0-9._-]", "-", f"test-{request.node.name}")[:63],
        )
        s._kv._client.flushdb()
    yield s
    s.close()


def _table(version: int) -> RoutingTable:
    return RoutingTable.from_placement(GroupPlacement({"g0": ((0, 0), (0, 1))}), 2, version=version)


def test_empty_store(store):
    assert store.routing_table() is None
    assert store.routing_table_version() == 0
    assert store.endpoints() == {}


def test_routing_table_versions_advance_one_at_a_time(store):
    assert store.publish_routing_table(_table(1))
    assert store.routing_table() == _table(1)
    assert not store.publish_routing_table(_table(1)), "same version twice must be refused"
    assert not store.publish_routing_table(_table(3)), "skipping a version must be refused"
    assert store.publish_routing_table(_table(2))
    assert store.routing_table_version() == 2


def test_concurrent_writers_one_wins(store):
    assert store.publish_routing_table(_table(1))
    results = []
    barrier = threading.Barrier(8)

    def writer():
        barrier.wait()
        results.append(store.publish_routing_table(_table(2)))

    threads = [threading.Thread(target=writer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(True) == 1
    assert store.routing_table_version() == 2


def test_endpoints(store):
    store.set_endpoint("g0", "127.0.0.1:1000")
    store.set_endpoint("g1", "127.0.0.1:1001")
    store.set_endpoint("g0", "127.0.0.1:2000")
    store.remove_endpoint("g1")
    assert store.endpoints() == {"g0": "127.0.0.1:2000"}


def test_hidden_state_samples_per_layer_and_router_and_pinned_probes(store):
    """Raw bytes in, the same bytes out (``state.samples`` gives them their form)."""
    import torch

    from expertmesh.store import samples

    store.publish_hidden_sample(3, "r1", samples.encode(torch.ones(2, 4, dtype=torch.bfloat16)))
    store.publish_hidden_sample(3, "r2", b"\x00\xff")
    store.publish_hidden_sample(5, "r1", b"five")
    assert torch.equal(samples.decode(store.hidden_samples(3)["r1"]), torch.ones(2, 4, dtype=torch.bfloat16))
    assert store.hidden_samples(3)["r2"] == b"\x00\xff" and store.hidden_samples(4) == {}
    store.remove_hidden_samples("r1", [3, 5])
    assert store.hidden_samples(3) == {"r2": b"\x00\xff"} and store.hidden_samples(5) == {}
    store.save_health_probe(3, b"probe")
    assert store.health_probes() == {"3": b"probe"}


def test_unknown_url_and_unreachable_redis():
    with pytest.raises(ValueError, match="unknown state store URL"):
        open_store("etcd://x")
    with pytest.raises(ConnectionError, match="cannot reach the Redis state store"):
        open_store("redis://127.0.0.1:1/0")


def test_an_empty_store_takes_a_restored_later_version(store):
    """After a flush the orchestrator restores the table after the last version routers saw."""
    assert store.publish_routing_table(_table(7))
    assert store.routing_table_version() == 7
    assert not store.publish_routing_table(_table(9)), "once a table is there, versions advance one at a time"


def test_records_with_unknown_fields_are_read_and_unreadable_ones_skipped(store):
    """A newer writer's extra field raised TypeError in the router's heartbeat thread before it beat."""
    import json

    store._kv.hset(
        store._key("routers"),
        "r1",
        json.dumps({"router_id": "r1", "table_version": 3, "at": 1.0, "zone": "b"}).encode(),
    )
    store._kv.hset(store._key("routers"), "r2", b"{broken")
    assert set(store.router_heartbeats()) == {"r1"} and store.router_heartbeats()["r1"].table_version == 3
    entry = {
        "layer": 0,
        "expert": 1,
        "group": "g0",
        "state": "quarantined",
        "reason": "t",
        "since": 1.0,
        "withdrawn": False,
    }
    store._kv.hset(store._key("quarantine"), "0/1/g0", json.dumps({**entry, "added_later": 1}).encode())
    store._kv.hset(store._key("quarantine"), "0/2/g0", json.dumps({"layer": 0}).encode())  # fields missing
    assert list(store.quarantined()) == [(0, 1, "g0")]
