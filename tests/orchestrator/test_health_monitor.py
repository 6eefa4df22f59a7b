"""The health monitor against real expert-group gRPC servers on loopback
(``HostedExperts`` + ``start_server``, no Ray) and the in-process state store:
clean rounds, quarantine with and without failover, fingerprints, repair through
probation back into the routing table, the operator's quarantine and release, the
admin RPCs with ``expertmesh experts / quarantine / release``, and the gauges.

Every corrupted weight here is a fault the test injects in-process: it overwrites
one expert's weights in one group's memory, in place, as a stray write would
(``corrupt``). Nothing in the product does that.

The mesh (tiny Mixtral, g0 and g1, (1, 1) replicated, (1, 2) alone) is ``health_mesh``'s.
"""

from __future__ import annotations

import socket
import threading

import grpc
import pytest
from health_mesh import CONFIG, REPLICATED, SINGLE, corrupt, rid, running

from expertmesh.cli.main import main
from expertmesh.contracts.errors import QuarantineRefused
from expertmesh.models.checkpoint import Checkpoint
from expertmesh.orchestrator.admin import start_orchestrator
from expertmesh.orchestrator.drift.config import DriftConfig
from expertmesh.orchestrator.health import monitor as monitor_module
from expertmesh.orchestrator.health.monitor import HealthMonitor
from expertmesh.orchestrator.health.state import FindingKind, HealthState, Initiator, load_all
from expertmesh.router.dispatch.routing_view import RoutingView
from expertmesh.store import open_store
from expertmesh.v1 import admin_pb2 as pb
from expertmesh.v1 import admin_pb2_grpc as pb_grpc


@pytest.fixture
def mesh(tiny_checkpoints):
    with running(tiny_checkpoints("mixtral")) as m:
        yield m


@pytest.fixture
def monitor(mesh):
    m = HealthMonitor(mesh.store, mesh.checkpoint, CONFIG)
    yield m
    m.close()


def test_clean_rounds_quarantine_nothing(mesh, monitor):
    for _ in range(5):
        round_ = monitor.update()
        assert all(found == () for found in round_.findings.values())
    assert len(round_.findings) == 9 and round_.unreachable == ()
    assert {r.state for r in round_.records.values()} == {HealthState.HEALTHY}
    assert all(r.kl == 0.0 and r.baseline is not None for r in round_.records.values()), (
        "the same probe, the same figures"
    )
    assert all(r.history == () for r in round_.records.values())
    assert mesh.store.routing_table().version == 1 and round_.table_version == 1
    assert mesh.store.quarantined() == {}
    assert set(load_all(mesh.store)) == set(round_.records)


def test_a_corrupted_replica_is_quarantined_and_the_table_stops_routing_to_it(mesh, monitor):
    monitor.update()  # baselines
    corrupt(mesh, "g1", REPLICATED)
    round_ = monitor.update()
    bad = round_.records[rid(REPLICATED, "g1")]
    assert bad.state is HealthState.QUARANTINED and bad.quarantined_by is Initiator.MONITOR and bad.withdrawn
    assert {f.kind for f in round_.findings[rid(REPLICATED, "g1")]} >= {FindingKind.FINGERPRINT, FindingKind.DIVERGENCE}
    assert round_.records[rid(REPLICATED, "g0")].state is HealthState.HEALTHY, "the sound replica is left alone"
    assert mesh.replicas(REPLICATED) == ("g0",) and round_.table_version == 2
    view = RoutingView.build(mesh.store.routing_table(), mesh.checkpoint.spec.moe_layers)
    assert [view.groups[i] for i in view.holders[REPLICATED]] == ["g0"]
    (entry,) = mesh.store.quarantined().values()
    assert (entry.layer, entry.expert, entry.group, entry.state, entry.withdrawn) == (1, 1, "g1", "quarantined", True)
    assert "fingerprint" in entry.reason and entry.since == bad.since


def test_repair_then_probation_then_healthy_and_listed_again(mesh, monitor):
    monitor.update()
    corrupt(mesh, "g1", REPLICATED)
    monitor.update()  # quarantined, withdrawn
    repaired = monitor.update().records[rid(REPLICATED, "g1")]
    assert repaired.state is HealthState.PROBATION and repaired.repairs == 1 and repaired.withdrawn
    assert repaired.baseline.taken_at == repaired.since, "the verified output of the repair is the new baseline"
    assert mesh.replicas(REPLICATED) == ("g0",), "not serving while on probation"
    assert mesh.store.quarantined()[(1, 1, "g1")].state == "probation"
    assert {(l, e): a == b for l, e, a, b in mesh.hosted["g1"].fingerprints()}[REPLICATED]
    on_probation = monitor.update().records[rid(REPLICATED, "g1")]
    assert on_probation.state is HealthState.PROBATION and on_probation.clean_checks == 1
    healthy = monitor.update().records[rid(REPLICATED, "g1")]
    assert healthy.state is HealthState.HEALTHY and not healthy.withdrawn and healthy.quarantined_by is None
    assert mesh.replicas(REPLICATED) == ("g0", "g1") and mesh.store.routing_table().version == 3
    assert mesh.store.quarantined() == {}
    assert [t.state for t in healthy.history] == [HealthState.QUARANTINED, HealthState.PROBATION, HealthState.HEALTHY]
    times = [t.at for t in healthy.history]
    assert times == sorted(times) and all(t.reason for t in healthy.history)


def test_a_corrupted_only_replica_is_quarantined_without_a_table_edit(mesh, monitor):
    monitor.update()
    corrupt(mesh, "g1", SINGLE)
    round_ = monitor.update()
    bad = round_.records[rid(SINGLE, "g1")]
    assert bad.state is HealthState.QUARANTINED and not bad.withdrawn
    assert mesh.replicas(SINGLE) == ("g1",) and mesh.store.routing_table().version == 1, "never unhosted"
    entry = mesh.store.quarantined()[(1, 2, "g1")]
    assert entry.state == "quarantined" and entry.withdrawn is False, "the router must fall back for this expert"
    (listed,) = [s for s in monitor.listing(1) if s.record.replica == rid(SINGLE, "g1")]
    assert listed.listed and listed.record.state is HealthState.QUARANTINED
    assert monitor.update().records[rid(SINGLE, "g1")].state is HealthState.PROBATION
    assert mesh.store.quarantined()[(1, 2, "g1")].state == "probation"


def test_a_changed_fingerprint_alone_quarantines(mesh, monitor):
    monitor.update()
    corrupt(mesh, "g0", (0, 0), scale=1.0 + 2**-20, at=(0, 0))  # one weight, by one part in a million
    round_ = monitor.update()
    assert [f.kind for f in round_.findings[rid((0, 0), "g0")]] == [FindingKind.FINGERPRINT], "KL and mean stay put"
    assert round_.records[rid((0, 0), "g0")].state is HealthState.QUARANTINED


def test_a_repair_that_does_not_match_the_checkpoint_stays_quarantined(mesh, tiny_checkpoints):
    other = HealthMonitor(mesh.store, Checkpoint(tiny_checkpoints("mixtral", seed=1)), CONFIG)
    try:
        other.update()
        corrupt(mesh, "g1", REPLICATED)
        other.update()
        after = other.update().records[rid(REPLICATED, "g1")]
        assert after.state is HealthState.QUARANTINED and after.repairs == 1
        assert after.reason.startswith("repair failed: reloaded on g1, but its output differs from the checkpoint's")
        assert mesh.replicas(REPLICATED) == ("g0",)
    finally:
        other.close()


def test_an_unreachable_group_waits_for_the_next_round(mesh, monitor):
    monitor.update()
    mesh.servers[1].stop(0)
    round_ = monitor.update()
    assert round_.unreachable == ("g1",)
    assert {r.group for r in round_.findings} == {"g0"}
    assert round_.records[rid(SINGLE, "g1")].state is HealthState.HEALTHY and mesh.store.routing_table().version == 1


def test_operator_quarantine_waits_for_release(mesh, monitor):
    monitor.update()
    (status,) = monitor.quarantine(1, 1, "g0", "odd outputs")
    assert status.record.state is HealthState.QUARANTINED and status.record.quarantined_by is Initiator.OPERATOR
    assert status.record.reason == "odd outputs" and not status.listed
    assert mesh.replicas(REPLICATED) == ("g1",)
    assert monitor.update().records[rid(REPLICATED, "g0")].state is HealthState.QUARANTINED, "no auto repair"
    (released,) = monitor.release(1, 1)
    assert released.record.state is HealthState.PROBATION
    monitor.update()
    monitor.update()
    assert mesh.replicas(REPLICATED) == ("g1", "g0")
    with pytest.raises(QuarantineRefused, match="no quarantined replica of layer 1 expert 1"):
        monitor.release(1, 1)
    with pytest.raises(
        QuarantineRefused, match=r"group 'g9' does not serve layer 1 expert 1 \(replicas: \['g0', 'g1'\]\)"
    ):
        monitor.quarantine(1, 1, "g9")


class _HungGroup:
    """A registered group address that accepts connections and never answers (a hung group's host), until
    ``close``: every call to it waits for its deadline meanwhile."""

    def __init__(self):
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.connected = threading.Event()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        try:
            while True:
                conn, _ = self._listener.accept()
                self._conns.append(conn)
                self.connected.set()
        except OSError:  # closed
            pass

    def close(self):
        self._listener.close()
        for conn in self._conns:
            conn.close()


def test_an_operator_quarantine_does_not_wait_for_a_round_stuck_on_a_hung_group(mesh, monitor):
    """Before: one lock spanned the whole round, so `expertmesh quarantine` waited for every probe of it (here
    a group that never answers: the call deadline, 30 s). Now the round holds the records' lock only to read
    and to settle, and its settle keeps the operator's quarantine made meanwhile."""
    monitor.update()
    hung = _HungGroup()
    mesh.store.set_endpoint("g9", hung.address)
    rounds = []
    round_thread = threading.Thread(target=lambda: rounds.append(monitor.update()))
    quarantined = threading.Event()
    command = threading.Thread(target=lambda: (monitor.quarantine(*REPLICATED, "g1", "now"), quarantined.set()))
    try:
        round_thread.start()
        assert hung.connected.wait(30), "the round never called the hung group"
        command.start()
        while not quarantined.is_set() and round_thread.is_alive():
            quarantined.wait(0.05)
        assert quarantined.is_set() and round_thread.is_alive(), "the quarantine waited for the round"
        assert mesh.replicas(REPLICATED) == ("g0",)
    finally:
        hung.close()
        round_thread.join()
        command.join()
    (round_,) = rounds
    assert round_.unreachable == ("g9",)
    record = load_all(mesh.store)[rid(REPLICATED, "g1")]
    assert record.state is HealthState.QUARANTINED and record.quarantined_by is Initiator.OPERATOR, (
        "the round's settle undid the quarantine made during it"
    )
    assert mesh.replicas(REPLICATED) == ("g0",) and (*REPLICATED, "g1") in mesh.store.quarantined()


def test_quarantining_every_replica_keeps_the_last_listed(mesh, monitor):
    statuses = monitor.quarantine(1, 1)
    assert [(s.record.replica.group, s.record.state, s.listed) for s in statuses] == [
        ("g0", HealthState.QUARANTINED, True),
        ("g1", HealthState.QUARANTINED, True),
    ]
    assert mesh.replicas(REPLICATED) == ("g0", "g1") and mesh.store.routing_table().version == 1
    assert {q.withdrawn for q in mesh.store.quarantined().values()} == {False}


def test_admin_rpcs_and_the_commands(mesh, monitor, capsys):
    orchestrator = start_orchestrator(mesh.store, "127.0.0.1", 0, drift=DriftConfig(), health=monitor)
    server = orchestrator.server
    address = f"127.0.0.1:{server.port}"
    try:
        monitor.update()  # baselines
        monitor.update()  # the first comparison with them
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.AdminStub(channel)
            listed = stub.ListExperts(pb.ListExpertsRequest(layer=1)).replicas
            assert [(r.layer, r.expert, r.group) for r in listed][:3] == [(1, 0, "g0"), (1, 1, "g0"), (1, 1, "g1")]
            assert {r.state for r in listed} == {pb.EXPERT_HEALTH_STATE_HEALTHY} and all(r.listed for r in listed)
            assert listed[0].HasField("kl") and listed[0].kl == 0.0
            assert listed[0].baseline_at > 0 and listed[0].baseline_norm_mean == listed[0].norm_mean
            assert listed[0].probe_source == "seeded", "no router records hidden states here"
            with pytest.raises(grpc.RpcError) as err:
                stub.Quarantine(pb.QuarantineRequest(layer=1, expert=9))
            assert (
                err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
                and "not in routing table v1" in err.value.details()
            )

        assert main(["experts", "--layer", "0", "--admin", address]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].split() == [
            "LAYER",
            "EXPERT",
            "GROUP",
            "STATE",
            "LISTED",
            "KL",
            "NORM",
            "BASELINE",
            "LAST",
            "CHECK",
            "PROBE",
            "REASON",
        ]
        assert len(out) == 5 and out[1].split()[:6] == ["0", "0", "g0", "healthy", "yes", "0"]

        assert (
            main(
                [
                    "quarantine",
                    "--layer",
                    "1",
                    "--expert",
                    "1",
                    "--group",
                    "g1",
                    "--reason",
                    "suspicious",
                    "--admin",
                    address,
                ]
            )
            == 0
        )
        out = capsys.readouterr().out
        assert "quarantined (operator)" in out and "suspicious" in out
        assert mesh.replicas(REPLICATED) == ("g0",)

        assert main(["release", "--layer", "1", "--expert", "1", "--admin", address]) == 0
        assert "probation (operator)" in capsys.readouterr().out
        assert main(["release", "--layer", "1", "--expert", "1", "--admin", address]) == 2
        assert "FAILED_PRECONDITION: no quarantined replica" in capsys.readouterr().err
    finally:
        orchestrator.stop()


def test_a_release_that_fails_verification_exits_one(mesh, tiny_checkpoints, capsys):
    other = HealthMonitor(mesh.store, Checkpoint(tiny_checkpoints("mixtral", seed=1)), CONFIG)
    orchestrator = start_orchestrator(mesh.store, "127.0.0.1", 0, drift=DriftConfig(), health=other)
    server = orchestrator.server
    try:
        other.quarantine(1, 2)
        assert main(["release", "--layer", "1", "--expert", "2", "--admin", f"127.0.0.1:{server.port}"]) == 1
        assert "repair failed" in capsys.readouterr().out
    finally:
        orchestrator.stop()


def test_gauges_show_the_worst_replica_and_the_largest_kl(mesh, monkeypatch):
    """``expertmesh.expert.health`` and ``expertmesh.expert.kl`` by layer and expert (an SDK meter
    provider local to this test, patched in for the global API)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    monkeypatch.setattr(monitor_module, "meter", lambda: MeterProvider(metric_readers=[reader]).get_meter("expertmesh"))
    m = HealthMonitor(mesh.store, mesh.checkpoint, CONFIG)
    try:
        m.update()
        corrupt(mesh, "g1", REPLICATED)
        m.update()
        metrics = {
            metric.name: {(p.attributes["layer"], p.attributes["expert"]): p.value for p in metric.data.data_points}
            for rm in reader.get_metrics_data().resource_metrics
            for sm in rm.scope_metrics
            for metric in sm.metrics
        }
        health, kl = metrics["expertmesh.expert.health"], metrics["expertmesh.expert.kl"]
        assert len(health) == 8 and health[REPLICATED] == 0.0 and health[(1, 0)] == 1.0
        assert kl[REPLICATED] > CONFIG.kl_quarantine and kl[(1, 0)] == 0.0
    finally:
        m.close()


def test_the_quarantine_set_in_redis(redis_url):
    """The store contract routers read, on the cluster backend."""
    import uuid

    from expertmesh.store import QuarantinedReplica

    store = open_store(redis_url, deployment=f"test-{uuid.uuid4().hex[:8]}")
    entry = QuarantinedReplica(1, 2, "g1", "quarantined", "fingerprint: changed", 12.5, False)
    store.set_quarantined(entry)
    assert store.quarantined() == {(1, 2, "g1"): entry}
    store.clear_quarantined(1, 2, "g1")
    assert store.quarantined() == {}
    store.close()


def test_a_release_holds_when_a_round_checked_the_quarantined_replica_during_its_reload(mesh, monitor, monkeypatch):
    """Issue 39's chaos run: a health round that ran while `expertmesh release` reloaded the replica refreshed the
    quarantined record's figures (last check, KL); the release's settle saw a record changed meanwhile and
    dropped its repair, so the replica stayed quarantined for good (nothing repairs an operator's quarantine but
    a release) though its weights had been reloaded and verified. Here the round runs inside the reload."""
    monitor.update()
    monitor.quarantine(1, 1, "g0", "odd outputs")
    before = load_all(mesh.store)[rid(REPLICATED, "g0")]
    repair = monitor._repair
    rounds = []

    def repair_with_a_round_meanwhile(record, view, probe, now):
        rounds.append(monitor.update())
        return repair(record, view, probe, now)

    monkeypatch.setattr(monitor, "_repair", repair_with_a_round_meanwhile)
    (released,) = monitor.release(1, 1)
    checked = rounds[0].records[rid(REPLICATED, "g0")]
    assert checked.state is HealthState.QUARANTINED and checked != before, "the round refreshed the record"
    assert released.record.state is HealthState.PROBATION, released.record.reason
    assert (*REPLICATED, "g0") in mesh.store.quarantined()  # on probation: still out of service
    monkeypatch.undo()
    monitor.update()
    monitor.update()
    assert mesh.replicas(REPLICATED) == ("g1", "g0") and mesh.store.quarantined() == {}
