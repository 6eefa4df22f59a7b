"""Early health rounds on routers' anomalies (orchestrator/health/anomalies.py, ``HealthMonitor.update(only=...)``):
the pure decision (new records, old news, the cooldown), a round limited to the implicated replicas, and end to end
against real expert-group gRPC servers and the state store (``health_mesh``): a fault injected into one replica of
an expert, a router's anomaly record naming that expert, and the orchestrator's control loop quarantines it in an
early round while the regular rounds are an hour apart.

The router's side runs as in a router (``AnomalyMonitor`` with the ``health_round`` action, its load window, the
``AnomalyPublisher`` writing to the mesh's store), but its load window is fed constructed routing (as in
tests/test_anomaly_health_round.py) rather than the tiny model's traffic: the expert that goes bad then takes every
token of its layer, a load-share shift as deterministic as the test needs. The regular round is an hour away, so
only an early round can quarantine it."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
from health_mesh import CONFIG, REPLICATED, SINGLE, rid, running
from opentelemetry.sdk.metrics import MeterProvider

from expertmesh.contracts.load_window import LoadWindow
from expertmesh.orchestrator.admin import start_orchestrator
from expertmesh.orchestrator.drift.config import DriftConfig
from expertmesh.orchestrator.health.anomalies import AnomalyRounds, decide
from expertmesh.orchestrator.health.monitor import HealthMonitor
from expertmesh.orchestrator.health.state import HealthState
from expertmesh.router.reporting.anomaly import BaselineConfig
from expertmesh.router.reporting.anomaly_monitor import AnomalyMonitor
from expertmesh.router.reporting.anomaly_publisher import AnomalyPublisher
from expertmesh.store import AnomalyRecord, open_store
from test_anomaly_health_round import _route


def _record(router="r1", seq=1, pairs=((1, 1),), at=100.0, signal="load_share") -> AnomalyRecord:
    return AnomalyRecord(router, seq, signal, pairs[0][0], tuple(pairs), at, 0.6, 0.25, 0.02, 3.0)


# -- decide: pure ----------------------------------------------------------------------------------------------


def test_new_records_ask_for_their_pairs_once():
    records = [_record(seq=1, pairs=((1, 1),)), _record(seq=2, pairs=((1, 1), (0, 2))), _record("r2", 1, ((0, 3),))]
    d = decide(records, {}, {}, now=110.0, cooldown_s=300, max_age_s=600)
    assert d.pairs == ((0, 2), (0, 3), (1, 1)) and d.seen == {"r1": 2, "r2": 1} and len(d.causes) == 3
    again = decide(records, d.seen, {}, now=111.0, cooldown_s=300, max_age_s=600)
    assert again.pairs == () and again.causes == () and again.seen == d.seen, "each (router, seq) acted on once"
    later = decide([*records, _record("r2", 2, ((1, 2),))], d.seen, {}, now=112.0, cooldown_s=300, max_age_s=600)
    assert later.pairs == ((1, 2),) and later.seen == {"r1": 2, "r2": 2}


def test_old_records_are_read_but_not_acted_on():
    d = decide([_record(at=100.0)], {}, {}, now=100.0 + 601, cooldown_s=300, max_age_s=600)
    assert d.pairs == () and d.seen == {"r1": 1}


def test_a_flapping_signal_waits_out_the_cooldown():
    probed = {(1, 1): 100.0}
    flaps = [_record(seq=s, pairs=((1, 1),), at=100.0 + s) for s in range(1, 6)]
    assert decide(flaps, {}, probed, now=110.0, cooldown_s=300, max_age_s=600).pairs == ()
    mixed = decide([_record(pairs=((1, 1), (1, 2)), at=105.0)], {}, probed, now=110.0, cooldown_s=300, max_age_s=600)
    assert mixed.pairs == ((1, 2),), "the pair still cooling down is left out, the other probed"
    assert decide(flaps, {}, probed, now=400.0, cooldown_s=300, max_age_s=600).pairs == ((1, 1),)


class _FakeMonitor:
    def __init__(self, store):
        self.config = CONFIG.model_copy(update={"anomaly_cooldown_s": 60.0})
        self.rounds = []
        self.store = store

    def update(self, only=None, cause=""):
        from expertmesh.orchestrator.health.monitor import HealthRound

        self.rounds.append((tuple(only), cause))
        return HealthRound(0.0, {}, {}, 1, (), {})


def test_the_manager_runs_one_round_per_new_anomaly_and_respects_the_cooldown():
    store = open_store("memory://")
    now = [1000.0]
    monitor = _FakeMonitor(store)
    rounds = AnomalyRounds(monitor, store, clock=lambda: now[0])
    publisher = AnomalyPublisher(store, router="r1")
    assert rounds.update() is None and monitor.rounds == []
    publisher.submit(_record(at=1000.0))
    publisher.flush()
    rounds.update()
    rounds.update()
    assert [only for only, _ in monitor.rounds] == [((1, 1),)]
    assert "router r1: load_share of layer 1" in monitor.rounds[0][1]
    for _ in range(3):  # the signal flaps: new records, the same expert, within the cooldown
        now[0] += 5
        publisher.submit(_record(at=now[0]))
        publisher.flush()
        rounds.update()
    assert len(monitor.rounds) == 1
    now[0] += 60
    publisher.submit(_record(at=now[0]))
    publisher.flush()
    rounds.update()
    assert [only for only, _ in monitor.rounds] == [((1, 1),), ((1, 1),)]


# -- against real groups ---------------------------------------------------------------------------------------


@pytest.fixture
def mesh(tiny_checkpoints):
    with running(tiny_checkpoints("mixtral")) as m:
        yield m


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def any_mesh(request, tiny_checkpoints):
    """The mesh over the in-process store, and over Redis (``EXPERTMESH_TEST_REDIS_URL``), as routers and the
    orchestrator of a cluster share it."""
    store = None
    if request.param == "redis":
        store = open_store(request.getfixturevalue("redis_url"), deployment=f"anomalies-{uuid.uuid4().hex[:8]}")
    with running(tiny_checkpoints("mixtral"), store) as m:
        yield m
    if store is not None:
        store.close()


def test_an_early_round_checks_only_the_named_experts(mesh):
    monitor = HealthMonitor(mesh.store, mesh.checkpoint, CONFIG)
    try:
        first = monitor.update()
        early = monitor.update(only=[REPLICATED, SINGLE], cause="a test")
        assert set(early.findings) == {rid(REPLICATED, "g0"), rid(REPLICATED, "g1"), rid(SINGLE, "g1")}
        assert early.records[rid((0, 0), "g0")].last_check == first.records[rid((0, 0), "g0")].last_check
        assert early.records[rid(SINGLE, "g1")].last_check >= first.records[rid(SINGLE, "g1")].last_check
        assert monitor.update(only=[]).findings == {}
    finally:
        monitor.close()


def test_an_anomaly_record_gets_the_faulty_expert_quarantined_before_the_regular_round(any_mesh, caplog):
    mesh = any_mesh
    config = CONFIG.model_copy(update={"enabled": True, "interval_s": 3600.0, "anomaly_poll_s": 0.05})
    monitor = HealthMonitor(mesh.store, mesh.checkpoint, config)
    monitor.update()  # baselines (the control loop's own first round is an hour away)
    orchestrator = start_orchestrator(mesh.store, "127.0.0.1", 0, drift=DriftConfig(), health=monitor)
    publisher = AnomalyPublisher(mesh.store, router="router-a").start()
    try:
        assert [m.name for m in orchestrator.loop.managers] == ["health", "health-anomalies", "retention"]
        # the router's monitor, its load window fed constructed routing: 30 observations of even load
        window = LoadWindow((0, 1), 4, 2)
        baseline = BaselineConfig(window=64, warm_up=8, persistence=2)
        router = AnomalyMonitor(
            None,
            baseline,
            "health_round",
            MeterProvider().get_meter("t"),
            load=window,
            load_share_every=1,
            publish=publisher.submit,  # as serve_plane wires it
        )
        rng = np.random.default_rng(0)
        for _ in range(30):
            _route(window, rng)
            router.end_step()
        assert publisher.records() == [], "nothing anomalous yet"
        mesh.hosted["g1"].inject_fault(*REPLICATED, "scale", 3.0)  # g1's copy of layer 1 expert 1 goes bad
        for _ in range(baseline.persistence):  # ... and its load share jumps
            _route(window, rng, hot=REPLICATED)
            router.end_step()
        assert any(REPLICATED in r.pairs for r in publisher.records())
        deadline = time.monotonic() + 120
        while (1, 1, "g1") not in mesh.store.quarantined():
            assert time.monotonic() < deadline, "no early round quarantined the faulty replica"
            time.sleep(0.05)
        entry = mesh.store.quarantined()[(1, 1, "g1")]
        assert entry.state == "quarantined" and entry.withdrawn and "fingerprint" in entry.reason
        assert mesh.replicas(REPLICATED) == ("g0",), "the sound replica serves the expert"
        listing = {s.record.replica: s.record for s in monitor.listing()}
        assert listing[rid(REPLICATED, "g0")].state is HealthState.HEALTHY
        deadline = time.monotonic() + 30
        while "the early round quarantined" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text[-2000:]
            time.sleep(0.05)
        assert "router router-a: load_share of layer 1" in caplog.text
        assert mesh.store.quarantined().keys() == {(1, 1, "g1")}, "the other experts the records named are sound"
    finally:
        publisher.stop()
        orchestrator.stop()
