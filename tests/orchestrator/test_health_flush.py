"""A flushed state store (FLUSHDB on a real redis-server) under the health monitor and the reconciler: the
quarantine entries and health records come back from the orchestrator's memory before the table does, the
rebuilt table lists no quarantined or withdrawn replica, and the monitor keeps its baselines and pinned probes,
so a fault that only the probe output shows is caught on a sole replica after the flush as before it.

Expert groups are real gRPC servers on loopback (``health_mesh``); the faults are injected in-process
(``corrupt``, ``drift_only``: nothing in the product writes weights so). The groups' registration loop is
played by ``mesh.register()`` (they re-register every few seconds)."""

from __future__ import annotations

import uuid

import pytest
import redis
import torch
from health_mesh import CONFIG, PLACEMENT, REPLICATED, SINGLE, drift_only, rid, running

from expertmesh.orchestrator.health import probes
from expertmesh.orchestrator.health.monitor import HealthMonitor
from expertmesh.orchestrator.health.state import FindingKind, HealthState, Initiator, load_all
from expertmesh.orchestrator.reconcile import Reconciler, what_runs
from expertmesh.store import open_store
from expertmesh.store.samples import encode

pytestmark = pytest.mark.redis


@pytest.fixture
def mesh(tiny_checkpoints, redis_url):
    store = open_store(redis_url, deployment=f"flush-{uuid.uuid4().hex[:8]}")
    with running(tiny_checkpoints("mixtral"), store) as m:
        yield m
    store.close()


@pytest.fixture
def monitor(mesh):
    m = HealthMonitor(mesh.store, mesh.checkpoint, CONFIG)
    yield m
    m.close()


@pytest.fixture
def reconciler(mesh, monitor):
    """The orchestrator's reconciler, rebuilding an empty store from what the groups hold, asking the monitor."""
    observe, close = what_runs(mesh.store)
    yield Reconciler(mesh.store, mesh.checkpoint.spec, PLACEMENT, observe=observe, health=monitor)
    close()


def _flush(redis_url: str) -> None:
    with redis.Redis.from_url(redis_url) as client:
        client.flushdb()


def test_quarantines_survive_a_flush_and_the_rebuilt_table_lists_no_quarantined_replica(
    mesh, monitor, reconciler, redis_url
):
    """The issue's reproduction: `expertmesh quarantine`, FLUSHDB, and the replica was back in service."""
    reconciler.reconcile_once()  # the file recorded as applied over the table in use
    monitor.update()
    monitor.quarantine(*REPLICATED, "g1", "odd outputs")  # another replica serves: withdrawn from the table
    monitor.quarantine(*SINGLE, reason="odd outputs")  # its only replica: listed, routers fall back
    entries = mesh.store.quarantined()
    assert set(entries) == {(*REPLICATED, "g1"), (*SINGLE, "g1")} and mesh.replicas(REPLICATED) == ("g0",)
    assert reconciler.reconcile_once() is None  # the loop's next round: nothing to apply, version 2 seen
    before = mesh.store.routing_table_version()

    _flush(redis_url)
    assert mesh.store.quarantined() == {} and mesh.store.routing_table() is None
    mesh.register()
    table = reconciler.reconcile_once()

    assert table is not None and table.version > before
    assert table.replicas[REPLICATED] == ("g0",), "the rebuilt table listed the quarantined replica again"
    assert table.replicas[SINGLE] == ("g1",), "an expert is never left unhosted"
    assert mesh.store.quarantined() == entries, "the quarantine entries routers read are back as they were"
    records = load_all(mesh.store)
    for replica in (rid(REPLICATED, "g1"), rid(SINGLE, "g1")):
        assert records[replica].state is HealthState.QUARANTINED
        assert records[replica].quarantined_by is Initiator.OPERATOR and records[replica].reason == "odd outputs"
    assert records[rid((0, 0), "g0")].baseline is not None, "the healthy replicas' baselines are back too"

    # the next round keeps the operator's quarantines (no auto repair) and the table as rebuilt
    round_ = monitor.update()
    assert round_.records[rid(REPLICATED, "g1")].state is HealthState.QUARANTINED
    assert round_.records[rid(REPLICATED, "g1")].withdrawn and mesh.replicas(REPLICATED) == ("g0",)
    assert mesh.store.quarantined()[(*SINGLE, "g1")].withdrawn is False


def test_a_drift_on_a_sole_replica_is_caught_after_a_flush_on_the_baseline_and_probe_from_before(
    mesh, monitor, reconciler, redis_url
):
    """Before: the flush took the records (baselines) and the pinned probes; the monitor took a fresh baseline
    on whatever the replica computed then, so a fault that only output drift shows went unseen."""
    hidden = mesh.checkpoint.config.get_text_config().hidden_size
    for layer in mesh.checkpoint.spec.moe_layers:  # what a router sampling its traffic publishes
        sample = torch.randn(64, hidden, generator=torch.Generator().manual_seed(layer))  # [rows, H]
        mesh.store.publish_hidden_sample(layer, "router-1", encode(sample))
    monitor.update()  # baselines on the seeded probes
    second = monitor.update()  # every replica healthy: the routers' samples pinned, baselines on them
    assert set(second.probes.values()) == {"recorded"}
    pinned = probes.load_pinned(mesh.store, hidden)
    reconciler.reconcile_once()

    _flush(redis_url)  # the routers' samples go too: no new probe can be pinned from them
    drift_only(mesh, "g1", SINGLE)  # a fault that starts around the flush; the fingerprint cannot see it
    mesh.register()
    assert reconciler.reconcile_once() is not None

    assert {layer: p.digest for layer, p in probes.load_pinned(mesh.store, hidden).items()} == {
        layer: p.digest for layer, p in pinned.items()
    }, "the pinned probes are back"
    round_ = monitor.update()
    found = {f.kind for f in round_.findings[rid(SINGLE, "g1")]}
    assert FindingKind.DIVERGENCE in found and FindingKind.FINGERPRINT not in found
    assert round_.records[rid(SINGLE, "g1")].state is HealthState.QUARANTINED
    assert round_.probes == {layer: "recorded" for layer in mesh.checkpoint.spec.moe_layers}
