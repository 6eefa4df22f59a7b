"""Finished migration and group records leave the store after a while (``orchestrator.retention``): the policy as a
pure function, the manager on a store, and the control loop's step that runs it."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from expertmesh.orchestrator.elastic.state import GroupPhase, GroupRecord
from expertmesh.orchestrator.migration.state import Migration, MigrationMode, Phase, load_all, save
from expertmesh.orchestrator.retention import RecordRetention, RetentionConfig
from expertmesh.orchestrator.retention.policy import expired, routers_gone
from expertmesh.store import RouterHeartbeat, open_store

NOW = 1_000_000.0
DAY = 86_400.0


# -- the policy ------------------------------------------------------------------------------------------


def test_records_older_than_keep_s_go_and_younger_ones_stay():
    finished = [("old", NOW - DAY - 1), ("day", NOW - DAY + 1), ("new", NOW - 5)]
    assert expired(finished, NOW, DAY, 100, 1800) == ["old"]


def test_past_keep_at_most_the_oldest_go_first_but_never_one_within_protect_s():
    finished = [(f"m{i}", NOW - 4000 + 100 * i) for i in range(10)]  # m0 oldest (4000 s), m9 newest (3100 s)
    assert expired(finished, NOW, DAY, 7, 1800) == ["m0", "m1", "m2"]
    # the three oldest are inside the protected span: the cap waits rather than lift a cooldown
    assert expired(finished, NOW, DAY, 7, 5000) == []
    assert expired(finished, NOW, DAY, 100, 1800) == []
    assert expired([], NOW, DAY, 1, 0) == []


def test_ties_and_order_are_deterministic():
    finished = [("b", NOW - 10), ("a", NOW - 10), ("c", NOW - 20)]
    assert expired(finished, NOW, 5, 100, 0) == ["c", "a", "b"]
    assert expired(list(reversed(finished)), NOW, 1e9, 1, 0) == ["c", "a"]


def test_a_router_silent_longer_than_router_gone_s_is_gone():
    beats = [("live", NOW - 1), ("slow", NOW - 1199), ("gone", NOW - 1201)]
    assert routers_gone(beats, NOW, 1200) == ["gone"]
    assert routers_gone([], NOW, 1200) == []


@pytest.mark.parametrize("field,value", [("keep_s", 0), ("keep_at_most", 0), ("interval_s", -1), ("router_gone_s", 59)])
def test_settings_are_bounded(field, value):
    with pytest.raises(ValueError):
        RetentionConfig(**{field: value})


# -- the manager on a store ------------------------------------------------------------------------------


def _migration(mid: str, phase: Phase, completed_at: float | None) -> Migration:
    return Migration(
        mid, 0, 1, MigrationMode.MOVE, "g0", "g1", phase, 2, ("g0",), (), started_at=NOW - 3 * DAY,
        completed_at=completed_at,
    )  # fmt: skip


def test_the_manager_deletes_what_expired_and_never_a_record_in_flight(caplog):
    store = open_store("memory://")
    save(store, _migration("done-long-ago", Phase.SUCCEEDED, NOW - 2 * DAY))
    save(store, _migration("failed-long-ago", Phase.FAILED, NOW - 2 * DAY))
    save(store, _migration("done-today", Phase.SUCCEEDED, NOW - 3600))
    save(store, _migration("running-for-days", Phase.LOADING, None))
    stopped = GroupRecord("g7", GroupPhase.STOPPED, finished_at=NOW - 2 * DAY)
    store.save_group_record("g7", stopped.to_json().encode())
    store.save_group_record("g8", GroupRecord("g8", GroupPhase.STOPPED, finished_at=NOW - 60).to_json().encode())
    store.save_group_record("g9", GroupRecord("g9", GroupPhase.FAILED, finished_at=NOW - 2 * DAY).to_json().encode())
    store.save_group_record("bad", b"not json")
    forgotten = []
    retention = RecordRetention(store, RetentionConfig(), 1800, forget_group=forgotten.append, clock=lambda: NOW)
    caplog.set_level(logging.INFO, logger="expertmesh.orchestrator.retention")
    assert retention.update() == (2, 1)
    assert [m.id for m in load_all(store)] == ["done-today", "running-for-days"]
    # a failed group may still be drained and removed: only STOPPED ones go
    assert sorted(store.group_records()) == ["bad", "g8", "g9"] and forgotten == ["g7"]
    assert "deleted 2 finished migration records and 1 stopped group records" in caplog.text
    assert retention.update() == (0, 0)


def test_every_record_of_a_router_gone_is_deleted_and_a_live_routers_kept(caplog):
    """Routers that come and go (pods rescheduled under new names, crashes) used to leave their heartbeat, load
    window, hidden-state samples and anomaly records in the store for ever."""
    from expertmesh.contracts.load_report import LoadPulse
    from expertmesh.contracts.routing_table import RoutingTable

    store = open_store("memory://")
    store.publish_routing_table(
        RoutingTable(1, 2, {(0, 0): ("g0",), (0, 1): ("g0",), (2, 0): ("g0",), (2, 1): ("g0",)})
    )
    pulse = LoadPulse((0, 2), 2, 1, np.ones((2, 2)), written_at=NOW - 5, window_s=600.0)
    for router, beat_at in (("live", NOW - 1), ("crashed", NOW - 1300)):
        store.publish_router_heartbeat(RouterHeartbeat(router, 1, beat_at))
        store.publish_load(router, pulse.to_bytes())
        store.publish_load_detail(router, b"window")
        for layer in (0, 2):
            store.publish_hidden_sample(layer, router, b"sample")
        store.publish_anomalies(router, [])
    # stopped long ago (its heartbeat removed at stop): only its stale pulse is left
    store.publish_load("stopped", LoadPulse((0, 2), 2, 1, np.ones((2, 2)), NOW - 1300, 600.0).to_bytes())
    retention = RecordRetention(store, RetentionConfig(), 1800, clock=lambda: NOW)
    caplog.set_level(logging.INFO, logger="expertmesh.orchestrator.retention")
    assert retention.forget_routers(NOW) == ["crashed", "stopped"]
    assert set(store.router_heartbeats()) == {"live"} and store.router_count() == 1
    assert set(store.loads()) == set(store.load_details()) == {"live"}
    assert all(set(store.hidden_samples(layer)) == {"live"} for layer in (0, 2))
    assert store._kv.hgetall(store._key("anomalies")).keys() == {"live"}
    assert "records of 2 routers gone" in caplog.text
    assert retention.forget_routers(NOW) == []


def test_a_capped_store_keeps_the_newest(caplog):
    store = open_store("memory://")
    for i in range(12):
        save(store, _migration(f"m{i:02d}", Phase.SUCCEEDED, NOW - 10_000 + i))
    retention = RecordRetention(store, RetentionConfig(keep_at_most=5), 1800, clock=lambda: NOW)
    assert retention.update() == (7, 0)
    assert [m.id for m in load_all(store)] == [f"m{i:02d}" for i in range(7, 12)]


def test_the_orchestrators_control_loop_runs_it():
    """The real orchestrator (admin server, runner, loop) on an in-process store: a record finished two days ago
    goes at the manager's first round, today's stays."""
    import time

    from expertmesh.orchestrator.admin import start_orchestrator

    store = open_store("memory://")
    now = time.time()
    save(store, _migration("two-days-ago", Phase.SUCCEEDED, now - 2 * DAY))
    save(store, _migration("an-hour-ago", Phase.SUCCEEDED, now - 3600))
    orchestrator = start_orchestrator(store, "127.0.0.1", 0, retention=RetentionConfig(interval_s=0.05))
    try:
        assert [m.name for m in orchestrator.loop.managers] == ["retention"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(load_all(store)) > 1:
            time.sleep(0.05)
        assert [m.id for m in load_all(store)] == ["an-hour-ago"]
    finally:
        orchestrator.stop()
