"""The capacity controller against real expert-group gRPC servers on loopback (``HostedExperts`` + ``start_server``,
no Ray) and the in-process state store: a scan observes the load windows and Describe, replicates the busiest
group's expert with a real REPLICATE migration (make-before-break) and retires a cold replica with an EVICT; the
orchestrator runs it in its control loop when enabled.

Tiny Mixtral: 2 MoE layers x 4 experts. ``g0`` holds experts 0-2 of both layers, ``g1`` expert 3 of both and a
second replica of layer 0's expert 2. No router heartbeats: with no live router, drains are immediate."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from tests.helpers import wait_for

from expertmesh.contracts.load_window import LoadSnapshot
from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.expert_group.service import start_server
from expertmesh.models.checkpoint import Checkpoint
from expertmesh.models.hosted_experts import HostedExperts
from expertmesh.orchestrator.admin import MigrationRunner, start_orchestrator
from expertmesh.orchestrator.capacity.config import CapacityConfig
from expertmesh.orchestrator.capacity.controller import CapacityController, Result
from expertmesh.orchestrator.capacity.policy import Action
from expertmesh.orchestrator.migration.executor import MigrationExecutor
from expertmesh.orchestrator.migration.state import Phase, load_all
from expertmesh.store import open_store

REPLICAS = {
    **{(layer, e): ("g0",) for layer in (0, 1) for e in (0, 1)},
    (0, 2): ("g0", "g1"),
    (1, 2): ("g0",),
    (0, 3): ("g1",),
    (1, 3): ("g1",),
}
#: tokens per expert per MoE layer: layer 1's g1 (expert 3) carries 900 of 1200; layer 0's expert 2 is cold
LOAD = np.array([[300.0, 300.0, 10.0, 600.0], [100.0, 100.0, 100.0, 900.0]])
CONFIG = CapacityConfig(enabled=True, min_window_tokens=100.0, max_changes_per_scan=4, min_gain=0.05)


@pytest.fixture
def mesh(tiny_checkpoints):
    path = tiny_checkpoints("mixtral")
    spec = Checkpoint(path).spec
    store = open_store("memory://")
    servers = []
    for name in ("g0", "g1"):
        hosted = HostedExperts(Checkpoint(path))
        hosted.load([pair for pair, groups in REPLICAS.items() if name in groups])
        server, port = start_server(name, hosted, max_concurrent_dispatch=4, workers=2)
        servers.append(server)
        store.set_endpoint(name, f"127.0.0.1:{port}")
    assert store.publish_routing_table(RoutingTable(1, 4, dict(REPLICAS)))
    window = LoadSnapshot(
        spec.moe_layers, 4, 2, LOAD, np.zeros((2, 4, 4)), np.zeros((2, 16, 4)), spec.max_context or 4096
    )
    store.publish_load("r1", window.to_bytes())
    yield store
    for server in servers:
        server.stop(0)


def test_a_scan_replicates_the_hot_expert_and_retires_the_cold_replica_by_live_migrations(mesh, caplog):
    runner = MigrationRunner(mesh, MigrationExecutor(mesh, poll_s=0.01, drain_timeout_s=10.0), max_concurrent=2)
    controller = CapacityController(mesh, runner.submit, CONFIG)
    try:
        scan, dry = controller.update(dry_run=True)
        assert [r.result for r in dry] == [Result.DRY_RUN] * len(dry) and load_all(mesh) == []
        with caplog.at_level(logging.INFO, logger="expertmesh.orchestrator.capacity.controller"):
            scan, records = controller.update()
        actions = {(r.decision.action, r.decision.layer, r.decision.expert, r.decision.group) for r in records}
        assert (Action.REPLICATE, 1, 3, "g0") in actions, scan
        assert (Action.RETIRE, 0, 2, "g0") in actions or (Action.RETIRE, 0, 2, "g1") in actions, scan
        assert all(r.result is Result.SUBMITTED and r.started for r in records)
        assert any("capacity submitted (replicate)" in m and "layer 1" in m for m in caplog.messages)
        done = wait_for(
            lambda: (ms := load_all(mesh)) and all(m.phase.terminal for m in ms) and ms, "the migrations", 60
        )
        assert [m.phase for m in done] == [Phase.SUCCEEDED] * len(done), [(m.id, m.failure) for m in done]
        table = mesh.routing_table()
        assert set(table.replicas[(1, 3)]) == {"g0", "g1"}
        assert len(table.replicas[(0, 2)]) == 1
        # the next scan: layer 1 is balanced enough now, expert 3's pair cools down: nothing more to do there
        _, again = controller.update()
        assert not any(r.decision.layer == 1 and r.decision.expert == 3 for r in again)
    finally:
        controller.close()
        runner.close()


def test_the_orchestrator_runs_the_controller_only_when_enabled(mesh):
    for config, expected in ((CapacityConfig(), False), (CONFIG, True)):
        orchestrator = start_orchestrator(mesh, "127.0.0.1", 0, capacity=config)
        try:
            names = [m.name for m in orchestrator.loop.managers]
            assert ("capacity" in names) is expected and (orchestrator.capacity is not None) is expected
        finally:
            orchestrator.stop()
