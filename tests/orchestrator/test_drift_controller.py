"""The drift controller against real expert-group gRPC servers on loopback
(``HostedExperts`` + ``start_server``, no Ray) and the in-process state store:
observation (Describe, busy time, load windows), scans that start real
migrations through the ``MigrationRunner``, dry runs, the ``ScanDrift`` admin
RPC and ``expertmesh drift --once``.

Tiny Mixtral: 2 MoE layers x 4 experts, every expert ``unit`` bytes. ``g0`` holds
experts 0-2 of both layers (6 units) and ``g1`` expert 3 (2 units), both with a
budget of 6.5 units: g0 is at 92 %, above the high watermark, g1 at 31 %, below
the low one. No router heartbeats: with no live router, drains are immediate.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from expertmesh.cli.main import main
from expertmesh.contracts.errors import MigrationRefused
from expertmesh.contracts.group_map import GroupPlacement
from expertmesh.contracts.load_window import LoadSnapshot
from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.expert_group.busy import BusyClock
from expertmesh.expert_group.service import start_server
from expertmesh.infra.telemetry.logs import JsonFormatter
from expertmesh.models.checkpoint import Checkpoint
from expertmesh.models.hosted_experts import HostedExperts
from expertmesh.orchestrator.admin import MigrationRunner, start_orchestrator
from expertmesh.orchestrator.drift.config import DriftConfig
from expertmesh.orchestrator.drift.controller import DriftController, Result
from expertmesh.orchestrator.drift.observe import Observer
from expertmesh.orchestrator.drift.state import Hold, Trigger
from expertmesh.orchestrator.migration import plan
from expertmesh.orchestrator.migration.executor import MigrationExecutor
from expertmesh.orchestrator.migration.group_calls import GroupChannels
from expertmesh.orchestrator.migration.state import Migration, MigrationMode, Phase, load_all
from expertmesh.store import StateStore, open_store
from expertmesh.v1 import admin_pb2 as pb
from expertmesh.v1 import admin_pb2_grpc as pb_grpc

PLACEMENT = GroupPlacement({"g0": tuple((layer, e) for layer in (0, 1) for e in (0, 1, 2)), "g1": ((0, 3), (1, 3))})
#: tokens per expert per MoE layer: (1, 1) and (0, 2) are g0's least used
LOAD = np.array([[300.0, 250.0, 40.0, 500.0], [200.0, 10.0, 90.0, 400.0]])
FAST = dict(consecutive_scans=3, experts_per_move=2, cooldown_s=3600.0, min_window_tokens=100.0)


@dataclass
class Mesh:
    store: StateStore
    servers: list
    unit: int

    def held(self, group: str) -> set[tuple[int, int]]:
        channels = GroupChannels(self.store.endpoints)
        try:
            return set(channels.describe(group).pairs)
        finally:
            channels.close()


@pytest.fixture
def mesh(tiny_checkpoints):
    path = tiny_checkpoints("mixtral")
    spec = Checkpoint(path).spec
    unit = HostedExperts(Checkpoint(path)).expert_bytes([(0, 0)])
    store = open_store("memory://")
    servers = []
    for name, pairs in PLACEMENT.groups.items():
        hosted = HostedExperts(Checkpoint(path), budget_bytes=int(6.5 * unit))
        hosted.load(list(pairs))
        server, port = start_server(name, hosted, max_concurrent_dispatch=4, workers=2)
        servers.append(server)
        store.set_endpoint(name, f"127.0.0.1:{port}")
    assert store.publish_routing_table(RoutingTable.from_placement(PLACEMENT, num_experts=4, version=1))
    # Two routers' windows, as their LoadPublishers write them: the observation sums them.
    for router, share in (("r1", 0.25), ("r2", 0.75)):
        window = LoadSnapshot(
            spec.moe_layers, 4, 2, LOAD * share, np.zeros((2, 4, 4)), np.zeros((2, 16, 4)), spec.max_context or 4096
        )
        store.publish_load(router, window.to_bytes())
    yield Mesh(store, servers, unit)
    for server in servers:
        server.stop(0)


@pytest.fixture
def runner(mesh):
    runner = MigrationRunner(
        mesh.store, MigrationExecutor(mesh.store, poll_s=0.01, drain_timeout_s=10.0), max_concurrent=2
    )
    yield runner
    runner.close()


def test_busy_clock_counts_overlapping_calls_once():
    now = [0.0]
    clock = BusyClock(lambda: now[0])
    with clock.running():
        now[0] = 1.0
        with clock.running():
            now[0] = 3.0
        now[0] = 4.0
        assert clock.seconds() == 4.0  # a period still running counts
    now[0] = 10.0
    with clock.running():
        now[0] = 12.0
    assert clock.seconds() == 6.0


def test_observation_reads_describe_busy_time_and_summed_load_windows(mesh):
    observer = Observer(mesh.store)
    first = observer.observe()
    samples = {s.group: s for s in first.groups}
    assert (samples["g0"].weight_bytes, samples["g0"].budget_bytes, samples["g0"].expert_bytes) == (
        6 * mesh.unit,
        int(6.5 * mesh.unit),
        mesh.unit,
    )
    # the memory each group measured where it computes (here: its process's resident bytes against the host's)
    assert all(0 < s.memory_used_bytes < s.memory_total_bytes for s in first.groups)
    assert samples["g1"].weight_bytes == 2 * mesh.unit
    loads = {(e.layer, e.expert): e.tokens for e in first.loads}
    assert loads == {(layer, e): LOAD[row, e] for row, layer in enumerate((0, 1)) for e in range(4)}
    assert first.top_k == 2 and first.table.version == 1 and first.migrations == ()

    # Real Dispatch calls on g0 add to its busy time, not to g1's.
    channels = GroupChannels(mesh.store.endpoints)
    view = channels.describe("g0")
    for _ in range(20):
        channels.dispatch("g0", 0, plan.canary(view.hidden_size, view.dtype, 1))
    channels.close()
    second = {s.group: s for s in observer.observe().groups}
    assert second["g0"].busy_seconds > samples["g0"].busy_seconds
    assert second["g1"].busy_seconds == samples["g1"].busy_seconds
    observer.close()


def test_a_router_gone_for_two_windows_is_left_out(mesh):
    """A crashed router's last window used to count for ever; a live router's never stops counting (its records
    are deleted by the retention manager: test_retention)."""
    from expertmesh.contracts.load_report import LoadPulse

    now = 1_000_000.0
    gone = LoadPulse((0, 1), 4, 2, np.full((2, 4), 1000.0), written_at=now - 1201.0, window_s=600.0)
    recent = LoadPulse((0, 1), 4, 2, np.ones((2, 4)), written_at=now - 1199.0, window_s=600.0)
    mesh.store.publish_load("gone", gone.to_bytes())
    mesh.store.publish_load("recent", recent.to_bytes())
    observer = Observer(mesh.store, clock=lambda: now)
    try:
        loads = {(e.layer, e.expert): e.tokens for e in observer.observe().loads}
    finally:
        observer.close()
        mesh.store.remove_load("recent")
        mesh.store.remove_load("gone")
    assert loads == {(layer, e): LOAD[row, e] + 1.0 for row, layer in enumerate((0, 1)) for e in range(4)}


def test_a_group_that_does_not_answer_is_left_out(mesh):
    mesh.store.set_endpoint("gone", "127.0.0.1:1")
    observer = Observer(mesh.store)
    assert sorted(s.group for s in observer.observe().groups) == ["g0", "g1"]
    observer.close()


def test_third_scan_moves_the_two_least_used_experts_live(mesh, runner, caplog):
    seen = []
    drift = DriftController(mesh.store, runner, DriftConfig(**FAST), on_decision=seen.append)
    caplog.set_level(logging.INFO, logger="expertmesh.orchestrator.drift")
    first, second = drift.update(), drift.update()
    assert first.records == () and second.records == ()
    g0 = next(u for u in second.scan.groups if u.group == "g0")
    assert g0.memory == pytest.approx(6 / 6.5, rel=1e-3) and g0.scans_above == 2
    assert g0.busy is not None  # differenced against the first scan

    rehearsal = drift.update(dry_run=True)  # decides, but moves nothing and counts nothing
    assert [r.result for r in rehearsal.records] == [Result.DRY_RUN] * 2
    assert load_all(mesh.store) == []

    third = drift.update()
    assert [r.result for r in third.records] == [Result.SUBMITTED] * 2
    moved = [(r.decision.move.layer, r.decision.move.expert) for r in third.records]
    assert moved == [(1, 1), (0, 2)] == [(r.decision.move.layer, r.decision.move.expert) for r in rehearsal.records]
    assert all(r.decision.move.source == "g0" and r.decision.move.target == "g1" for r in third.records)
    assert runner.wait_idle(60)
    records = {m.id: m for m in load_all(mesh.store)}
    for r in third.records:
        migration = records[r.migration_id]
        assert migration.phase is Phase.SUCCEEDED, migration.reason
        assert migration.initiator == "drift:high_watermark"
    assert set(moved) <= mesh.held("g1") and not set(moved) & mesh.held("g0")
    assert seen == [*rehearsal.records, *third.records]

    after = drift.update()
    g0 = next(u for u in after.scan.groups if u.group == "g0")
    assert g0.memory == pytest.approx(4 / 6.5, rel=1e-3) and g0.scans_above == 0 and after.records == ()

    line = next(r for r in caplog.records if getattr(r, "drift", {}).get("result") == "submitted")
    logged = json.loads(JsonFormatter().format(line))
    assert logged["drift"]["trigger"] == "high_watermark" and logged["drift"]["source"] == "g0"
    assert "least-used expert layer 1 expert 1 (10 tokens)" in logged["drift"]["detail"]
    drift.close()


def test_a_move_the_runner_refuses_is_recorded_as_refused(mesh):
    class Refusing:
        max_concurrent = 2

        def submit(self, *args, **kwargs):
            raise MigrationRefused("layer 1 expert 1 is busy elsewhere")

    drift = DriftController(mesh.store, Refusing(), DriftConfig(**{**FAST, "consecutive_scans": 1}))
    report = drift.update()
    assert [r.result for r in report.records] == [Result.REFUSED] * 2
    assert "refused: layer 1 expert 1 is busy elsewhere" in report.records[0].detail
    drift.close()


def test_configured_dry_run_never_moves(mesh, runner):
    drift = DriftController(mesh.store, runner, DriftConfig(**{**FAST, "consecutive_scans": 1, "dry_run": True}))
    assert [r.result for r in drift.update().records] == [Result.DRY_RUN] * 2
    assert [r.result for r in drift.update().records] == [Result.DRY_RUN] * 2  # and counts nothing
    assert load_all(mesh.store) == []
    drift.close()


def test_quiet_windows_hold(mesh, runner):
    drift = DriftController(
        mesh.store, runner, DriftConfig(**{**FAST, "consecutive_scans": 1, "min_window_tokens": 1e6})
    )
    (record,) = drift.update().records
    assert (record.result, record.decision.hold, record.decision.trigger) == (
        Result.HELD,
        Hold.LOW_TRAFFIC,
        Trigger.HIGH_WATERMARK,
    )
    drift.close()


def test_the_control_loop_scans_until_stopped(mesh):
    config = DriftConfig(**{**FAST, "enabled": True, "scan_interval_s": 0.05})
    orchestrator = start_orchestrator(mesh.store, "127.0.0.1", 0, drift=config)
    assert [m.name for m in orchestrator.loop.managers] == ["drift", "retention"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(load_all(mesh.store)) < 2:
        time.sleep(0.05)
    orchestrator.stop()  # the migrations under way finish first
    assert [m.phase for m in load_all(mesh.store)] == [Phase.SUCCEEDED] * 2


def test_scan_drift_rpc_and_the_drift_command(mesh, capsys):
    orchestrator = start_orchestrator(mesh.store, "127.0.0.1", 0, drift=DriftConfig(**{**FAST, "consecutive_scans": 2}))
    server, drift = orchestrator.server, orchestrator.drift
    address = f"127.0.0.1:{server.port}"
    try:
        assert not drift.config.enabled  # no loop: scans only on demand
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.AdminStub(channel)
            first = stub.ScanDrift(pb.ScanDriftRequest(dry_run=True))
            assert first.dry_run and list(first.decisions) == []
            groups = {g.group: g for g in first.groups}
            assert groups["g0"].memory == pytest.approx(6 / 6.5) and not groups["g0"].HasField("busy")
            assert groups["g0"].scans_above == 1 and first.window_tokens == pytest.approx(
                1090 / 2
            )  # layer 0's tokens over top-2
            assert [(b.layer, round(b.balancedness, 3)) for b in first.layers] == [
                (0, round(545 / 590, 3)),
                (1, round(350 / 400, 3)),
            ]
            stub.ScanDrift(pb.ScanDriftRequest())  # a real scan: the first of two in a row

        assert main(["drift", "--once", "--dry-run", "--admin", address]) == 0
        out = capsys.readouterr().out
        assert out.startswith("dry run: nothing moves")
        assert "dry_run high_watermark layer 1 expert 1 g0 -> g1" in out and "load windows: 545 tokens" in out

        assert main(["drift", "--once", "--admin", address]) == 0
        out = capsys.readouterr().out
        assert out.count("submitted high_watermark") == 2 and "(migration " in out
        assert orchestrator.runner.wait_idle(60)
        with grpc.insecure_channel(address) as channel:
            listed = pb_grpc.AdminStub(channel).ListMigrations(pb.ListMigrationsRequest()).migrations
        assert [(m.initiator, m.phase) for m in listed] == [("drift:high_watermark", pb.MIGRATION_PHASE_SUCCEEDED)] * 2
    finally:
        orchestrator.stop()


def test_the_drift_command_without_an_orchestrator_is_one_line(capsys):
    assert main(["drift", "--once", "--admin", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "no orchestrator admin API at 127.0.0.1:1" in err and len(err.strip().splitlines()) == 1


def test_migration_records_say_who_started_them():
    record = Migration(
        id="m1",
        layer=0,
        expert=1,
        mode=MigrationMode.MOVE,
        source="g0",
        target="g1",
        phase=Phase.PENDING,
        table_version=3,
        replicas_before=("g0",),
        shares_before=(),
        initiator="drift:rebalance",
    )
    assert Migration.from_json(record.to_json()) == record
    older = json.loads(record.to_json())
    del older["initiator"]  # a record stored before the field existed
    assert Migration.from_json(json.dumps(older)).initiator == "operator"
