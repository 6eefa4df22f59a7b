"""The migration protocol's pure parts: phase order, table edits that never leave
an expert unhosted, repair after a failure, the drain rule and the canary rule."""

import re
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expertmesh.contracts.errors import InvalidRequest, MigrationRefused
from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.orchestrator.migration import plan
from expertmesh.orchestrator.migration.plan import InFlightCalls, Tolerance
from expertmesh.orchestrator.migration.state import MigrationMode, Phase
from expertmesh.store import RouterHeartbeat

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GROUPS = ["g0", "g1", "g2", "g3"]
PAIR = (0, 1)


@st.composite
def tables(draw):
    """A table over 2 layers x 3 experts, each pair with 1..4 distinct replicas, some with explicit shares."""
    replicas, shares = {}, {}
    for pair in [(layer, e) for layer in range(2) for e in range(3)]:
        groups = tuple(draw(st.lists(st.sampled_from(GROUPS), min_size=1, max_size=4, unique=True)))
        replicas[pair] = groups
        if len(groups) > 1 and draw(st.booleans()):
            raw = [draw(st.integers(1, 9)) for _ in groups]
            shares[pair] = tuple(x / sum(raw) for x in raw)
    return RoutingTable(version=draw(st.integers(1, 50)), num_experts=3, replicas=replicas, shares=shares)


# -- phases -------------------------------------------------------------------------------


def test_phase_orders():
    assert [p.value for p in plan.PHASES[MigrationMode.MOVE]] == [
        "pending",
        "loading",
        "checking",
        "switching",
        "confirming",
        "retiring",
        "draining",
        "unloading",
        "succeeded",
    ]
    assert plan.PHASES[MigrationMode.REPLICATE][-2:] == (Phase.SWITCHING, Phase.SUCCEEDED)
    assert plan.PHASES[MigrationMode.EVICT] == (
        Phase.PENDING,
        Phase.RETIRING,
        Phase.DRAINING,
        Phase.UNLOADING,
        Phase.SUCCEEDED,
    )
    for mode, order in plan.PHASES.items():
        walked = [Phase.PENDING]
        while not walked[-1].terminal:
            walked.append(plan.next_phase(mode, walked[-1]))
        assert tuple(walked) == order
        with pytest.raises(ValueError):
            plan.next_phase(mode, Phase.SUCCEEDED)


@pytest.mark.parametrize(
    "mode, phase, replicas, touched",
    [
        (MigrationMode.MOVE, Phase.CHECKING, ("g0",), False),
        (MigrationMode.MOVE, Phase.SWITCHING, ("g0",), False),  # crashed before the publish
        (MigrationMode.MOVE, Phase.SWITCHING, ("g0", "g1"), True),  # crashed after it
        (MigrationMode.MOVE, Phase.CONFIRMING, ("g0", "g1"), True),
        (MigrationMode.MOVE, Phase.UNLOADING, ("g1",), True),
        (MigrationMode.REPLICATE, Phase.LOADING, ("g0",), False),
        (MigrationMode.EVICT, Phase.PENDING, ("g0", "g2"), False),
        (MigrationMode.EVICT, Phase.RETIRING, ("g0", "g2"), False),
        (MigrationMode.EVICT, Phase.RETIRING, ("g2",), True),
        (MigrationMode.EVICT, Phase.DRAINING, ("g2",), True),
    ],
)
def test_table_touched(mode, phase, replicas, touched):
    target = None if mode is MigrationMode.EVICT else "g1"
    assert plan.table_touched(mode, phase, replicas, "g0", target) is touched


# -- table edits --------------------------------------------------------------------------


@SETTINGS
@given(tables(), st.sampled_from(GROUPS))
def test_add_replica(table, group):
    new = plan.add_replica(table, PAIR, group)
    if group in table.replicas[PAIR]:
        assert new is None
        return
    assert new.version == table.version + 1
    assert new.replicas[PAIR] == (*table.replicas[PAIR], group)
    assert PAIR not in new.shares, "the edited pair takes equal shares"
    assert {p: r for p, r in new.replicas.items() if p != PAIR} == {
        p: r for p, r in table.replicas.items() if p != PAIR
    }
    assert {p: s for p, s in new.shares.items()} == {p: s for p, s in table.shares.items() if p != PAIR}
    plan.check_all_hosted(table, new)


@SETTINGS
@given(tables(), st.sampled_from(GROUPS))
def test_remove_replica_never_leaves_a_pair_unhosted(table, group):
    replicas = table.replicas[PAIR]
    if group not in replicas:
        assert plan.remove_replica(table, PAIR, group) is None
    elif len(replicas) == 1:
        with pytest.raises(MigrationRefused, match="no replica left"):
            plan.remove_replica(table, PAIR, group)
    else:
        new = plan.remove_replica(table, PAIR, group)
        assert new.version == table.version + 1
        assert new.replicas[PAIR] == tuple(g for g in replicas if g != group)
        assert PAIR not in new.shares
        plan.check_all_hosted(table, new)


def test_edits_of_an_unknown_pair_are_refused():
    table = RoutingTable(1, 3, {(0, 0): ("g0",)})
    with pytest.raises(MigrationRefused, match="layer 0 expert 1 is not in routing table v1"):
        plan.add_replica(table, PAIR, "g1")


def test_with_replicas_keeps_explicit_shares_only_for_several_replicas():
    table = RoutingTable(3, 3, {PAIR: ("g0",)})
    assert plan.with_replicas(table, PAIR, ("g0",)) is None
    two = plan.with_replicas(table, PAIR, ("g0", "g1"), (0.25, 0.75))
    assert two.version == 4 and two.shares[PAIR] == (0.25, 0.75)
    assert plan.with_replicas(two, PAIR, ("g0", "g1"), (0.25, 0.75)) is None
    assert PAIR not in plan.with_replicas(two, PAIR, ("g1",), (1.0,)).shares
    with pytest.raises(MigrationRefused):
        plan.with_replicas(table, PAIR, ())


def test_check_all_hosted_refuses_dropped_or_empty_pairs():
    before = RoutingTable(1, 3, {(0, 0): ("g0",), PAIR: ("g1",)})
    with pytest.raises(MigrationRefused, match=r"\(0, 1\)"):
        plan.check_all_hosted(before, RoutingTable(2, 3, {(0, 0): ("g0",)}))
    with pytest.raises(MigrationRefused, match=r"\(0, 1\)"):
        plan.check_all_hosted(before, RoutingTable(2, 3, {(0, 0): ("g0",), PAIR: ()}))
    plan.check_all_hosted(before, RoutingTable(2, 3, {(0, 0): ("g0",), PAIR: ("g2",)}))


# -- repair after a failure -----------------------------------------------------------------


@pytest.mark.parametrize(
    "current, before, source_holds, target, target_holds, expected",
    [
        # a move whose make was never acknowledged: both hold it, both stay listed
        (("g0", "g1"), ("g0",), True, "g1", True, ("g0", "g1")),
        # a move whose break was never drained: the source is listed again next to the target
        (("g1",), ("g0",), True, "g1", True, ("g0", "g1")),
        # the target lost the expert after the switch: back to the source alone
        (("g0", "g1"), ("g0",), True, "g1", False, ("g0",)),
        (("g1",), ("g0",), True, "g1", False, ("g0",)),
        # the source is gone: the target stays, even if it is the only one left
        (("g1",), ("g0",), False, "g1", True, ("g1",)),
        (("g1",), ("g0",), False, "g1", False, ("g1",)),
        # an evict that did not drain: the evicted replica comes back in its old place
        (("g2",), ("g0", "g2"), True, None, False, ("g0", "g2")),
    ],
)
def test_repaired_replicas(current, before, source_holds, target, target_holds, expected):
    assert plan.repaired_replicas(current, before, "g0", source_holds, target, target_holds) == expected


@SETTINGS
@given(
    st.lists(st.sampled_from(GROUPS), min_size=1, max_size=4, unique=True),
    st.lists(st.sampled_from(GROUPS), min_size=1, max_size=4, unique=True),
    st.booleans(),
    st.sampled_from([None, *GROUPS[1:]]),
    st.booleans(),
)
def test_repaired_replicas_properties(current, before, source_holds, target, target_holds):
    source = "g0"
    out = plan.repaired_replicas(tuple(current), tuple(before), source, source_holds, target, target_holds)
    assert out, "never without a replica"
    assert len(set(out)) == len(out)
    assert (source in out) == (source in current or source_holds)
    if target is not None and not target_holds and len(out) > 1:
        assert target not in out
    assert set(out) <= set(current) | {source}


# -- draining -------------------------------------------------------------------------------

NOW = 1000.0


def beat(name, version, age=0.0):
    return RouterHeartbeat(name, version, NOW - age)


def test_drain_waits_for_every_live_router_and_names_the_laggards():
    beats = [beat("r1", 7), beat("r2", 5), beat("r3", 6, age=3), beat("dead", 1, age=60)]
    ready, why = plan.drain_ready(beats, NOW, 7, [], liveness_s=15)
    assert not ready
    assert why == "routers 'r2' (v5), 'r3' (v6) not yet serving routing table v7"
    assert plan.drain_ready(beats, NOW, 5, [], liveness_s=15) == (True, "")
    assert plan.drain_ready([], NOW, 9, [], liveness_s=15) == (True, ""), "no live router uses anything"


def test_drain_waits_for_older_calls_in_flight_but_not_unversioned_ones():
    beats = [beat("r1", 8)]
    ready, why = plan.drain_ready(beats, NOW, 8, [InFlightCalls(7, 2), InFlightCalls(6, 1)], liveness_s=15)
    assert not ready and why == "Dispatch calls still in flight (1 of v6, 2 of v7), older than v8"
    assert plan.drain_ready(beats, NOW, 8, [InFlightCalls(0, 5), InFlightCalls(8, 3)], liveness_s=15) == (True, "")


@SETTINGS
@given(
    st.lists(st.tuples(st.integers(0, 12), st.floats(0, 40)), max_size=6),
    st.lists(st.tuples(st.integers(0, 12), st.integers(0, 3)), max_size=4),
    st.integers(1, 12),
    st.floats(1, 30),
)
def test_drain_ready_is_the_rule(routers, calls, version, liveness):
    beats = [beat(f"r{i}", v, age) for i, (v, age) in enumerate(routers)]
    in_flight = [InFlightCalls(v, n) for v, n in calls]
    ready, why = plan.drain_ready(beats, NOW, version, in_flight, liveness)
    live_ok = all(b.table_version >= version for b in beats if NOW - b.at <= liveness)
    calls_ok = not any(0 < c.table_version < version and c.calls for c in in_flight)
    assert ready == (live_ok and calls_ok)
    assert (why == "") == ready
    for b in beats:
        if NOW - b.at <= liveness and b.table_version < version:
            assert repr(b.router_id) in why


# -- canary ---------------------------------------------------------------------------------


def test_canary_inputs_are_seeded_and_name_one_expert():
    a, b = plan.canary(32, torch.bfloat16, 3), plan.canary(32, torch.bfloat16, 3)
    assert a.hidden.shape == (16, 32) and a.hidden.dtype == torch.bfloat16
    assert torch.equal(a.hidden, b.hidden)
    assert a.expert_ids.dtype == torch.int32 and bool((a.expert_ids == 3).all()) and a.expert_ids.shape == (16, 1)
    assert bool((a.weights == 1).all()) and a.weights.shape == (16, 1)


@pytest.mark.parametrize(
    "a, b, expected",
    [
        (torch.float32, torch.float32, Tolerance(0.0, 0.0)),
        (torch.bfloat16, torch.bfloat16, Tolerance(1e-2, 1e-2)),
        (torch.float16, torch.float32, Tolerance(1e-2, 1e-2)),
        (torch.float32, torch.bfloat16, Tolerance(1e-2, 1e-2)),
    ],
)
def test_canary_tolerance_by_dtype(a, b, expected):
    assert plan.canary_tolerance(a, b) == expected


def test_canary_tolerance_refuses_other_dtypes():
    with pytest.raises(ValueError, match="no canary tolerance"):
        plan.canary_tolerance(torch.float64, torch.float32)


def test_canary_difference():
    ref = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    exact, loose = Tolerance(0.0, 0.0), Tolerance(1e-2, 1e-2)
    assert plan.canary_difference(ref, ref.clone(), exact) is None
    nudged = ref.clone()
    nudged[3, 4] += 1e-6
    assert plan.canary_difference(ref, nudged, exact) == pytest.approx(1e-6, rel=0.5), "float32 must be bit-equal"
    assert plan.canary_difference(ref, nudged, loose) is None
    far = ref.clone()
    far[0, 0] += 0.5
    assert plan.canary_difference(ref.bfloat16(), far.bfloat16(), loose) == pytest.approx(0.5, abs=0.02)
    assert plan.canary_difference(ref, ref[:8], exact) == float("inf")
    poisoned = ref.clone()
    poisoned[0, 0] = float("nan")
    assert plan.canary_difference(poisoned, poisoned.clone(), exact) is not None, "NaN never passes"
    assert plan.canary_difference(poisoned, poisoned.clone(), loose) is not None


# -- requests (``checked_request``: the executor's submit checks, as a pure function) --------------------------


def _request(**kw):
    table = RoutingTable(3, 2, {(0, 0): ("g0",), (0, 1): ("g0", "g1")})
    args = dict(
        layer=0,
        expert=0,
        target="g1",
        source=None,
        mode="move",
        table=table,
        endpoints={"g0", "g1", "g2"},
        quarantined=frozenset(),
        busy=(),
    )
    return plan.checked_request(**{**args, **kw})


def test_a_request_gets_its_mode_and_source():
    assert _request() == (MigrationMode.MOVE, "g0")
    assert _request(expert=1, mode="replicate", target="g2") == (MigrationMode.REPLICATE, "g0")
    assert _request(expert=1, mode="evict", target=None, source="g1") == (MigrationMode.EVICT, "g1")


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(mode="teleport"), InvalidRequest, "unknown migration mode 'teleport'"),
        (dict(table=None), MigrationRefused, "no routing table in the state store yet"),
        (dict(expert=5), MigrationRefused, "layer 0 expert 5 is not in routing table v3"),
        (dict(target="g9"), InvalidRequest, "unknown group 'g9'"),
        (dict(expert=1, target="g2"), InvalidRequest, "has 2 replicas ['g0', 'g1']; name the source"),
        (dict(source="g1"), MigrationRefused, "group 'g1' does not serve layer 0 expert 0"),
        (dict(mode="evict"), InvalidRequest, "an evict removes a replica and takes no target"),
        (dict(mode="evict", target=None), MigrationRefused, "holds the only replica of layer 0 expert 0"),
        (dict(target=None), InvalidRequest, "a move needs a target group"),
        (dict(expert=1, source="g0", target="g1"), MigrationRefused, "group 'g1' already serves layer 0 expert 1"),
        (dict(quarantined=frozenset({(0, 0, "g1")})), MigrationRefused, "holds a quarantined copy"),
        (dict(id_taken=True, migration_id="m1"), MigrationRefused, "migration m1 exists already"),
    ],
)
def test_a_wrong_request_is_refused_with_what_to_do(change, error, message):
    with pytest.raises(error, match=re.escape(message)):
        _request(**change)


def test_one_migration_per_expert_at_a_time():
    running = SimpleNamespace(describe=lambda: "move of layer 0 expert 0", phase=Phase.LOADING)
    with pytest.raises(MigrationRefused, match="is still loading; one migration per expert at a time"):
        _request(busy=[running])
