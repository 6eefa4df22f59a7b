"""The capacity policy (``orchestrator.capacity.policy.decide``) as the pure function it is: observations in,
decisions out. No store, no groups."""

from __future__ import annotations

import pytest

from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.orchestrator.capacity.config import CapacityConfig
from expertmesh.orchestrator.capacity.policy import Action, CapacityState, decide
from expertmesh.orchestrator.drift.state import ExpertLoad, GroupSample, Observation
from expertmesh.orchestrator.migration.state import Migration, MigrationMode, Phase

EXPERT_BYTES = 100
CONFIG = CapacityConfig(enabled=True, min_window_tokens=0, cooldown_s=60, scans=2, group_cooldown_s=100)


def _obs(
    at: float,
    replicas: dict,
    loads: dict,
    busy_s: dict | None = None,
    budget: int = 0,
    held: dict | None = None,
    migrations=(),
    shares: dict | None = None,
) -> Observation:
    groups = sorted({g for names in replicas.values() for g in names} | set(busy_s or {}))
    held = held or {}
    return Observation(
        at=at,
        table=RoutingTable(1, 4, {p: tuple(n) for p, n in replicas.items()}, shares=shares or {}),
        groups=tuple(
            GroupSample(g, held.get(g, EXPERT_BYTES), budget, (busy_s or {}).get(g, 0.0), EXPERT_BYTES) for g in groups
        ),
        loads=tuple(ExpertLoad(l, e, float(t)) for (l, e), t in loads.items()),
        top_k=1,
        migrations=tuple(migrations),
    )


#: one layer, four experts: g0 holds the two hot ones, g1 and g2 one cold one each
REPLICAS = {(0, 0): ["g0"], (0, 1): ["g0"], (0, 2): ["g1"], (0, 3): ["g2"]}
LOADS = {(0, 0): 600, (0, 1): 300, (0, 2): 50, (0, 3): 50}


def test_a_hot_groups_heaviest_expert_gets_a_replica_on_the_least_loaded_group():
    scan, _ = decide(_obs(0.0, REPLICAS, LOADS), CapacityState(), CONFIG)
    replicas = [d for d in scan.decisions if d.action is Action.REPLICATE]
    assert scan.balancedness[0] == pytest.approx((1000 / 3) / 900)
    assert replicas, scan
    first = replicas[0]
    assert (first.layer, first.expert) == (0, 0) and first.group in ("g1", "g2")
    assert "balancedness" in first.detail and "expert 0" in first.detail
    # each decision raised the estimate: no pair twice in one scan, and at most max_changes_per_scan
    assert len({(d.layer, d.expert) for d in replicas}) == len(replicas) <= CONFIG.max_changes_per_scan


def test_a_balanced_layer_gets_nothing():
    even = {(0, 0): 100, (0, 1): 100, (0, 2): 200, (0, 3): 200}
    scan, _ = decide(_obs(0.0, REPLICAS, even), CapacityState(), CONFIG)
    assert scan.balancedness[0] == pytest.approx(1.0)
    assert scan.decisions == ()


def test_memory_budgets_bound_the_replicas():
    """A target keeps its weights at or under memory_high of its budget with the replica: g1, the least loaded,
    has no room, so the hot experts' replicas go to g2; without budgets g1 takes the first."""
    held = {"g0": 200, "g1": 900, "g2": 100}
    scan, _ = decide(_obs(0.0, REPLICAS, LOADS, budget=1000, held=held), CapacityState(), CONFIG)
    targets = [d.group for d in scan.decisions if d.action is Action.REPLICATE]
    assert targets[0] == "g2" and "g1" not in targets
    unbounded, _ = decide(_obs(0.0, REPLICAS, LOADS, held=held), CapacityState(), CONFIG)
    assert unbounded.decisions[0].group == "g1"


def test_pairs_migrating_or_cooling_down_and_groups_in_flux_are_left_alone():
    moving = Migration(
        "m1", 0, 0, MigrationMode.REPLICATE, "g0", "g1", Phase.PENDING, 1, ("g0",), (1.0,), started_at=0.0
    )
    scan, _ = decide(_obs(10.0, REPLICAS, LOADS, migrations=[moving]), CapacityState(), CONFIG)
    # g0 (the hot group) and g1 are in flux: nothing is decided for the layer
    assert [d for d in scan.decisions if d.action is Action.REPLICATE] == []
    done = Migration("m2", 0, 0, MigrationMode.MOVE, "g3", "g0", Phase.SUCCEEDED, 1, ("g3",), (1.0,), started_at=0.0)
    scan, _ = decide(_obs(30.0, REPLICAS, LOADS, migrations=[done]), CapacityState(), CONFIG)
    experts = {d.expert for d in scan.decisions if d.action is Action.REPLICATE}
    assert 0 not in experts and experts  # expert 0 cools down; the next heaviest of g0 goes instead


def test_a_cold_replica_is_retired_and_the_last_never():
    replicas = {(0, 0): ["g0", "g1"], (0, 1): ["g1"], (0, 2): ["g2"], (0, 3): ["g0", "g2"]}
    loads = {(0, 0): 10, (0, 1): 500, (0, 2): 500, (0, 3): 490}
    scan, _ = decide(_obs(0.0, replicas, loads), CapacityState(), CapacityConfig(min_window_tokens=0, min_gain=0.2))
    retired = [d for d in scan.decisions if d.action is Action.RETIRE]
    assert [(d.layer, d.expert) for d in retired] == [(0, 0)]
    assert retired[0].group in ("g0", "g1") and "retired" in retired[0].detail


def test_the_tables_shares_are_the_replica_loads():
    """A replicated expert whose table sends 90 % of its tokens to g0 leaves g0 the hot group."""
    replicas = {(0, 0): ["g0", "g1"], (0, 1): ["g1"], (0, 2): ["g2"], (0, 3): ["g2"]}
    loads = {(0, 0): 1000, (0, 1): 100, (0, 2): 100, (0, 3): 100}
    even, _ = decide(_obs(0.0, replicas, loads), CapacityState(), CONFIG)
    skewed, _ = decide(_obs(0.0, replicas, loads, shares={(0, 0): (0.9, 0.1)}), CapacityState(), CONFIG)
    assert skewed.balancedness[0] < even.balancedness[0]


def test_low_traffic_holds_the_replicas():
    scan, _ = decide(_obs(0.0, REPLICAS, LOADS), CapacityState(), CapacityConfig(min_window_tokens=10_000))
    assert scan.decisions == ()


def test_a_busy_cluster_asks_for_a_group_after_scans_in_a_row_then_cools_down():
    state = CapacityState()
    seen = []
    for i in range(6):  # 95 % busy every scan of 10 s
        busy = {g: 9.5 * i for g in ("g0", "g1", "g2")}
        scan, state = decide(_obs(10.0 * i, REPLICAS, LOADS, busy_s=busy), state, CONFIG)
        seen.append([d.action for d in scan.decisions if d.action in (Action.ADD_GROUP, Action.REMOVE_GROUP)])
    # scan 0 has no busy fraction; scans 1 and 2 are two in a row: advice at scan 2; then the group cooldown
    assert seen == [[], [], [Action.ADD_GROUP], [], [], []]
    assert scan.cluster_busy == pytest.approx(0.95)


def test_an_idle_cluster_gives_back_its_least_busy_group_but_never_the_last():
    state = CapacityState()
    for i in range(3):
        busy = {"g0": 0.5 * i, "g1": 0.1 * i, "g2": 1.5 * i}  # 5 %, 1 %, 15 % busy
        scan, state = decide(_obs(10.0 * i, REPLICAS, LOADS, busy_s=busy), state, CONFIG)
    removes = [d for d in scan.decisions if d.action is Action.REMOVE_GROUP]
    assert [d.group for d in removes] == ["g1"]
    alone = {(0, e): ["g0"] for e in range(4)}
    state = CapacityState()
    for i in range(4):
        scan, state = decide(_obs(10.0 * i, alone, LOADS, busy_s={"g0": 0.1 * i}), state, CONFIG)
        assert not any(d.action is Action.REMOVE_GROUP for d in scan.decisions)


@pytest.mark.parametrize(
    "bad, named",
    [
        (dict(add_busy=0.2, remove_busy=0.5), "EXPERTMESH_CAPACITY_REMOVE_BUSY"),
        (dict(replicate_below=0.0), "replicate_below"),
        (dict(scans=0), "scans"),
        (dict(max_replicas_per_pair=0), "max_replicas_per_pair"),
    ],
)
def test_settings_out_of_range_are_refused_with_what_to_change(bad, named):
    with pytest.raises(ValueError, match=named):
        CapacityConfig(**bad)


def test_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("EXPERTMESH_CAPACITY_ENABLED", "true")
    monkeypatch.setenv("EXPERTMESH_CAPACITY_REPLICATE_BELOW", "0.75")
    config = CapacityConfig()
    assert config.enabled and config.replicate_below == 0.75 and not CapacityConfig.model_fields["enabled"].default
