"""The drift policy as a pure function, driven by scripted utilisation series.

Groups ``a`` (the crowded one), ``b`` and ``c`` over 2 MoE layers x 4 experts;
every expert weighs ``UNIT`` bytes and every group's budget is ``10 * UNIT``, so
a group's memory utilisation is its weight in units / 10. A scan's observation is
written as the groups' weights (and busy counters) at that scan.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.orchestrator.drift.config import DriftConfig
from expertmesh.orchestrator.drift.policy import busy_fraction, decide, memory_level
from expertmesh.orchestrator.drift.rebalance import LayerLoads
from expertmesh.orchestrator.drift.state import (
    BusySample,
    DriftState,
    ExpertLoad,
    GroupSample,
    Hold,
    Move,
    Observation,
    Trigger,
)
from expertmesh.orchestrator.migration.state import Migration, MigrationMode, Phase

UNIT = 100
BUDGET = 10 * UNIT
INTERVAL = 300.0
#: a holds layers 0 and 1 experts 0-2 (6 pairs), b expert 3 of both layers, c nothing yet
TABLE = RoutingTable(
    version=7,
    num_experts=4,
    replicas={
        **{(layer, e): ("a",) for layer in (0, 1) for e in (0, 1, 2)},
        (0, 3): ("b",),
        (1, 3): ("b",),
    },
)
#: tokens per expert: on a, (1, 2) is used least, then (0, 1), then (1, 0) ...
LOAD = {
    (0, 0): 400.0,
    (0, 1): 20.0,
    (0, 2): 300.0,
    (0, 3): 500.0,
    (1, 0): 60.0,
    (1, 1): 350.0,
    (1, 2): 5.0,
    (1, 3): 450.0,
}


def config(**changes) -> DriftConfig:
    base = dict(
        high_watermark=0.9,
        low_watermark=0.4,
        consecutive_scans=3,
        experts_per_move=2,
        cooldown_s=1800.0,
        min_window_tokens=100.0,
    )
    return DriftConfig(**{**base, **changes})


def sample(group: str, memory: float, busy_seconds: float = 0.0, budget: int = BUDGET) -> GroupSample:
    return GroupSample(group, int(round(memory * budget)), budget, busy_seconds, UNIT)


def observe(scan: int, memories: dict[str, float], *, table=TABLE, load=LOAD, migrations=(), busy=None) -> Observation:
    busy = busy or {}
    return Observation(
        at=scan * INTERVAL,
        table=table,
        groups=tuple(sample(g, m, busy.get(g, 0.0)) for g, m in memories.items()),
        loads=tuple(ExpertLoad(layer, e, t) for (layer, e), t in load.items()),
        top_k=2,
        migrations=tuple(migrations),
    )


def run(series: list[dict[str, float]], cfg: DriftConfig | None = None, max_moves: int = 2, **kwargs):
    """Scan each observation in turn, keeping the state; the decisions of every scan."""
    cfg = cfg or config()
    state, out = DriftState(), []
    for scan, memories in enumerate(series, start=1):
        result, state = decide(observe(scan, memories, **kwargs), state, cfg, max_moves)
        out.append(result)
    return out, state


def moves(scan) -> list[Move]:
    return [d.move for d in scan.decisions if d.move is not None]


def migration(pair, started_at: float, phase: Phase = Phase.SUCCEEDED, source="a", target="c") -> Migration:
    return Migration(
        id=f"m{pair}{started_at}",
        layer=pair[0],
        expert=pair[1],
        mode=MigrationMode.MOVE,
        source=source,
        target=target,
        phase=phase,
        table_version=7,
        replicas_before=(source,),
        shares_before=(),
        started_at=started_at,
    )


# -- the high-watermark trigger -----------------------------------------------------------------


def test_fires_on_the_third_consecutive_scan_above_the_high_watermark():
    cold = {"b": 0.2, "c": 0.0}
    series = [
        {"a": 0.95, **cold},
        {"a": 0.95, **cold},
        {"a": 0.85, **cold},
        {"a": 0.95, **cold},
        {"a": 0.91, **cold},
        {"a": 0.95, **cold},
    ]
    scans, state = run(series)
    assert [[u.scans_above for u in s.groups if u.group == "a"][0] for s in scans] == [1, 2, 0, 1, 2, 3]
    assert [s.decisions for s in scans[:5]] == [()] * 5  # the dip at scan 3 starts the count again
    assert all(d.trigger is Trigger.HIGH_WATERMARK and d.hold is None for d in scans[5].decisions)
    assert len(moves(scans[5])) == 2
    assert state.scans_above["a"] == 0  # it fired: judged afresh once the moves show


def test_measured_memory_fills_a_group_its_budget_does_not():
    """Group a's weights are at 30 % of its budget, but the memory measured where it computes (another process on
    its GPU, say) is at 95 %: it fires on the third scan, as one above the watermark by its weights would; with
    ``measured_memory`` off only the weights count. Group c's measured memory keeps it from being a target."""

    def observed(scan: int) -> Observation:
        obs = observe(scan, {"a": 0.3, "b": 0.2, "c": 0.0})
        measured = {"a": (95, 100), "b": (10, 100), "c": (50, 100)}
        groups = tuple(replace(g, memory_used_bytes=measured[g.group][0], memory_total_bytes=100) for g in obs.groups)
        return replace(obs, groups=groups)

    for cfg, fires in ((config(), True), (config(measured_memory=False), False)):
        state, scans = DriftState(), []
        for scan in (1, 2, 3):
            result, state = decide(observed(scan), state, cfg, 2)
            scans.append(result)
        a = [u for u in scans[-1].groups if u.group == "a"][0]
        assert (a.memory == pytest.approx(0.95 if fires else 0.3)) and (a.scans_above == (3 if fires else 0))
        assert bool(moves(scans[-1])) is fires
        assert all(m.target == "b" for m in moves(scans[-1]))  # c: 50 % measured, above the low watermark


def test_memory_level_is_the_larger_of_budget_and_measurement():
    assert memory_level(GroupSample("g", 30, 100, 0.0, 10)) == 0.3
    assert memory_level(GroupSample("g", 30, 100, 0.0, 10, 80, 100)) == 0.8
    assert memory_level(GroupSample("g", 30, 100, 0.0, 10, 80, 100), measured=False) == 0.3
    assert memory_level(GroupSample("g", 30, 0, 0.0, 10, 20, 100)) == 0.2  # no budget: the measurement alone
    assert memory_level(GroupSample("g", 30, 0, 0.0, 10)) is None  # neither: unbounded, as before


def test_exactly_at_the_high_watermark_is_not_above_it():
    scans, _ = run([{"a": 0.9, "b": 0.2, "c": 0.0}] * 4)
    assert all(s.decisions == () for s in scans)


def test_picks_its_two_least_used_experts():
    scans, _ = run([{"a": 0.95, "b": 0.2, "c": 0.0}] * 3)
    assert [(m.layer, m.expert, m.source) for m in moves(scans[2])] == [(1, 2, "a"), (0, 1, "a")]


def test_experts_per_move_is_configurable():
    scans, _ = run([{"a": 0.95, "b": 0.2, "c": 0.0}] * 3, config(experts_per_move=3))
    assert [(m.layer, m.expert) for m in moves(scans[2])] == [(1, 2), (0, 1), (1, 0)]


def test_replica_load_counts_only_the_share_a_group_takes():
    # (0, 0) is hot, but a takes only 1% of it (4 tokens) as one of two replicas: on a it is used least.
    table = replace(TABLE, replicas={**TABLE.replicas, (0, 0): ("a", "b")}, shares={(0, 0): (0.01, 0.99)})
    scans, _ = run([{"a": 0.95, "b": 0.2, "c": 0.0}] * 3, table=table)
    assert [(m.layer, m.expert, m.source, m.target) for m in moves(scans[2])] == [(0, 0, "a", "c"), (1, 2, "a", "c")]


def test_target_is_below_the_low_watermark_with_the_most_room():
    # c has the most room but is at the low watermark (not below it); b has more room than d.
    scans, _ = run([{"a": 0.95, "b": 0.3, "c": 0.4, "d": 0.1}] * 3)
    assert {m.target for m in moves(scans[2])} == {"d"}
    scans, _ = run([{"a": 0.95, "b": 0.1, "c": 0.4, "d": 0.3}] * 3)
    # b takes the first; with one more unit it still has the most room, so it takes the second too.
    assert [m.target for m in moves(scans[2])] == ["b", "b"]


def test_rooms_promised_in_one_scan_count():
    # c has more room than b, until it takes the first expert; neither may end above 0.5.
    scans, _ = run([{"a": 0.95, "b": 0.39, "c": 0.35}] * 3, config(high_watermark=0.5))
    assert [m.target for m in moves(scans[2])] == ["c", "b"]
    scans, _ = run([{"a": 0.95, "b": 0.39, "c": 0.35}] * 3, config(high_watermark=0.46))
    assert [m.target for m in moves(scans[2])] == ["c"]  # b would end at 0.49


def test_a_target_that_already_serves_the_expert_is_passed_over():
    table = replace(TABLE, replicas={**TABLE.replicas, (1, 2): ("a", "c")})
    scans, _ = run([{"a": 0.95, "b": 0.3, "c": 0.0}] * 3, table=table)
    by_pair = {(m.layer, m.expert): m.target for m in moves(scans[2])}
    assert by_pair[(1, 2)] == "b"


def test_a_group_without_a_budget_never_fills_and_has_unbounded_room():
    unbounded = GroupSample("u", 50 * UNIT, 0, 0.0, UNIT)
    obs = observe(1, {"a": 0.95, "b": 0.0})
    state = DriftState(scans_above={"a": 2})
    scan, _ = decide(replace(obs, groups=(*obs.groups, unbounded)), state, config(), 2)
    assert {m.target for m in moves(scan)} == {"u"}
    assert next(u for u in scan.groups if u.group == "u").memory is None


def test_nothing_moves_below_min_window_tokens():
    quiet = {pair: 1.0 for pair in LOAD}
    scans, state = run([{"a": 0.95, "b": 0.2, "c": 0.0}] * 4, load=quiet)
    assert [d.hold for d in scans[2].decisions] == [Hold.LOW_TRAFFIC]
    assert "2 tokens, fewer than 100" in scans[2].decisions[0].detail  # 4 per layer over top-2
    assert state.scans_above["a"] == 4  # still counting: it fires once there is traffic


def test_held_without_a_target_then_fires_when_one_appears():
    scans, _ = run([{"a": 0.95, "b": 0.5, "c": 0.45}] * 3 + [{"a": 0.95, "b": 0.5, "c": 0.1}])
    assert [d.hold for d in scans[2].decisions] == [Hold.NO_TARGET]
    assert moves(scans[3]) and {m.target for m in moves(scans[3])} == {"c"}


def test_respects_the_cooldown():
    """Scan 3 moves (1, 2) and (0, 1); the store then holds their records (the table is left as it
    was, so a stays full and keeps serving them). Three scans later it moves the next least-used
    two, since the first two are cooling; once their cooldown is over they are the first again."""
    cfg = config(cooldown_s=5 * INTERVAL)
    full = {"a": 0.95, "b": 0.2, "c": 0.0}
    state, records = DriftState(), []
    fired = {}
    for scan in range(1, 13):
        result, state = decide(observe(scan, full, migrations=records), state, cfg, 2)
        for m in moves(result):
            records.append(migration((m.layer, m.expert), scan * INTERVAL, target=m.target))
        fired[scan] = result
    assert [(m.layer, m.expert) for m in moves(fired[3])] == [(1, 2), (0, 1)]
    assert [(m.layer, m.expert) for m in moves(fired[6])] == [(1, 0), (0, 2)]
    # Scan 9: (1, 2) and (0, 1), moved at scan 3, cooled down at scan 8; those of scan 6 cool until 11.
    assert [(m.layer, m.expert) for m in moves(fired[9])] == [(1, 2), (0, 1)]
    assert [(m.layer, m.expert) for m in moves(fired[12])] == [(1, 0), (0, 2)]
    assert all(fired[n].decisions == () for n in (4, 5, 7, 8, 10, 11))


def test_every_expert_cooling_holds():
    records = [migration(pair, 0.0) for pair, replicas in TABLE.replicas.items() if replicas == ("a",)]
    scans, state = run([{"a": 0.95, "b": 0.2, "c": 0.0}] * 3, migrations=records)
    assert [d.hold for d in scans[2].decisions] == [Hold.COOLDOWN]
    assert state.scans_above["a"] == 3


def test_a_migration_in_flight_holds_its_groups_and_pairs():
    running = [migration((0, 0), 0.0, Phase.DRAINING, source="a", target="b")]
    scans, state = run([{"a": 0.95, "b": 0.2, "c": 0.0}] * 3, migrations=running)
    assert [d.hold for d in scans[2].decisions] == [Hold.IN_FLIGHT]
    assert state.scans_above["a"] == 3
    # Between other groups it only takes the pair out.
    elsewhere = [migration((1, 2), 0.0, Phase.LOADING, source="x", target="y")]
    scans, _ = run([{"a": 0.95, "b": 0.2, "c": 0.0}] * 3, migrations=elsewhere)
    assert [(m.layer, m.expert) for m in moves(scans[2])] == [(0, 1), (1, 0)]


def test_a_group_that_does_not_answer_starts_its_count_again():
    scans, state = run([{"a": 0.95, "b": 0.2, "c": 0.0}, {"a": 0.95, "b": 0.2, "c": 0.0}, {"b": 0.2, "c": 0.0}])
    assert "a" not in state.scans_above
    assert scans[2].decisions == ()


def test_the_hottest_group_goes_first():
    table = replace(TABLE, replicas={**TABLE.replicas, (0, 3): ("z",), (1, 3): ("z",)})
    scans, _ = run(
        [{"a": 0.92, "z": 0.99, "c": 0.0}] * 3, table=table, cfg=config(high_watermark=0.9, experts_per_move=1)
    )
    assert [m.source for m in moves(scans[2])] == ["z", "a"]


# -- busy time ------------------------------------------------------------------------------------


def test_busy_fraction_differences_the_counter():
    assert busy_fraction(None, BusySample(5.0, 10.0)) is None
    assert busy_fraction(BusySample(5.0, 10.0), BusySample(8.0, 20.0)) == 0.3
    assert busy_fraction(BusySample(5.0, 10.0), BusySample(1.0, 20.0)) is None  # the group restarted
    assert busy_fraction(BusySample(5.0, 10.0), BusySample(30.0, 20.0)) == 1.0  # clamped


def test_a_busy_group_fires_on_compute_alone():
    # a's memory is low, but it computes 95% of every interval from scan 2 on.
    series = [{"a": 0.5, "b": 0.2, "c": 0.0}] * 4
    busy = {}
    state, scans = DriftState(), []
    for scan, memories in enumerate(series, start=1):
        busy = {"a": 0.95 * INTERVAL * (scan - 1), "b": 0.0, "c": 0.0}
        result, state = decide(observe(scan, memories, busy=busy), state, config(), 2)
        scans.append(result)
    a = [next(u for u in s.groups if u.group == "a") for s in scans]
    assert [u.busy for u in a] == [None, 0.95, 0.95, 0.95]
    assert [u.scans_above for u in a] == [0, 1, 2, 3]
    assert len(moves(scans[3])) == 2 and scans[2].decisions == ()


# -- rebalance -------------------------------------------------------------------------------------

#: layer 0 all on a; layer 1 even over a and b. Loads uneven in layer 0.
LOPSIDED = RoutingTable(
    version=3,
    num_experts=4,
    replicas={
        **{(0, e): ("a",) for e in range(4)},
        (1, 0): ("a",),
        (1, 1): ("a",),
        (1, 2): ("b",),
        (1, 3): ("b",),
    },
)
EVEN_LOAD = {(layer, e): 100.0 + 10 * e for layer in (0, 1) for e in range(4)}


def test_rebalance_replans_a_layer_that_stays_unbalanced():
    cfg = config(rebalance=True, rebalance_below=0.8)
    scans, state = run([{"a": 0.5, "b": 0.3}] * 3, cfg, table=LOPSIDED, load=EVEN_LOAD)
    layer0 = [next(b for b in s.layers if b.layer == 0) for s in scans]
    assert [b.scans_below for b in layer0] == [1, 2, 3]
    assert layer0[0].balancedness == 0.5  # everything on one of two groups
    assert next(b for b in scans[2].layers if b.layer == 1).scans_below == 0
    assert scans[0].decisions == () and scans[1].decisions == ()
    planned = moves(scans[2])
    assert [d.trigger for d in scans[2].decisions] == [Trigger.REBALANCE] * 2
    assert all((m.layer, m.source, m.target) == (0, "a", "b") for m in planned)
    assert state.scans_below[0] == 0


def test_rebalance_moves_are_bounded_by_the_batch():
    cfg = config(rebalance=True)
    heavy = {(0, e): 100.0 * (e + 1) for e in range(4)} | {(1, e): 100.0 for e in range(4)}
    table = replace(LOPSIDED, replicas={**LOPSIDED.replicas, **{(1, e): ("a",) for e in range(4)}})
    scans, _ = run([{"a": 0.5, "b": 0.0, "c": 0.0}] * 3, cfg, max_moves=3, table=table, load=heavy)
    assert len(moves(scans[2])) == 3
    scans, _ = run(
        [{"a": 0.5, "b": 0.0, "c": 0.0}] * 3,
        cfg,
        max_moves=3,
        table=table,
        load=heavy,
        migrations=[migration((0, 0), 0.0, Phase.LOADING, source="x", target="y")] * 3,
    )
    assert {d.hold for d in scans[2].decisions} == {Hold.IN_FLIGHT}


def test_rebalance_holds_when_the_planner_gains_too_little():
    # One expert takes nearly everything: with two experts a group, no placement does better.
    skewed = {(0, 0): 1000.0, (0, 1): 1.0, (0, 2): 1.0, (0, 3): 1.0} | {(1, e): 100.0 for e in range(4)}
    table = replace(LOPSIDED, replicas={**LOPSIDED.replicas, (0, 2): ("b",), (0, 3): ("b",)})
    scans, state = run([{"a": 0.5, "b": 0.3}] * 3, config(rebalance=True), table=table, load=skewed)
    assert [d.hold for d in scans[2].decisions] == [Hold.NO_GAIN]
    assert state.scans_below[0] == 0


def test_rebalance_is_off_by_default():
    scans, state = run([{"a": 0.5, "b": 0.3}] * 4, table=LOPSIDED, load=EVEN_LOAD)
    assert all(s.decisions == () for s in scans)
    assert all(b.scans_below == 0 for b in scans[3].layers)


# -- invariants --------------------------------------------------------------------------------------


@st.composite
def observations(draw):
    groups = ["a", "b", "c", "d"]
    replicas = {
        (layer, e): tuple(draw(st.lists(st.sampled_from(groups), min_size=1, max_size=2, unique=True)))
        for layer in (0, 1)
        for e in range(4)
    }
    table = RoutingTable(version=1, num_experts=4, replicas=replicas)
    load = {pair: float(draw(st.integers(0, 500))) for pair in replicas}
    memories = {g: draw(st.floats(0.0, 1.0)) for g in groups if draw(st.booleans()) or g == "a"}
    running = [
        migration(
            pair,
            draw(st.sampled_from([0.0, 2500.0])),
            draw(st.sampled_from([Phase.LOADING, Phase.SUCCEEDED])),
            source=replicas[pair][0],
            target="d",
        )
        for pair in draw(st.lists(st.sampled_from(sorted(replicas)), max_size=3, unique=True))
    ]
    return observe(10, memories, table=table, load=load, migrations=running)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(observations(), st.integers(0, 3), st.booleans())
def test_no_decision_breaks_a_rule(obs, scans_before, rebalance):
    cfg = config(rebalance=rebalance, consecutive_scans=1)
    state = DriftState(scans_above={g.group: scans_before for g in obs.groups})
    scan, _ = decide(obs, state, cfg, 2)
    samples = {s.group: s for s in obs.groups}
    running = {m.pair for m in obs.migrations if not m.phase.terminal}
    busy = {g for m in obs.migrations if not m.phase.terminal for g in (m.source, m.target)}
    cooling = {m.pair for m in obs.migrations if obs.at - m.started_at < cfg.cooldown_s}
    decided = moves(scan)
    assert len({(m.layer, m.expert) for m in decided}) == len(decided)  # one move per expert
    added = {}
    for m in decided:
        pair = (m.layer, m.expert)
        assert m.source in obs.table.replicas[pair] and m.target not in obs.table.replicas[pair]
        assert pair not in running and pair not in cooling
        assert not {m.source, m.target} & busy
        added[m.target] = added.get(m.target, 0) + UNIT
    for target, extra in added.items():
        assert (samples[target].weight_bytes + extra) / BUDGET <= cfg.high_watermark
    watermark = [
        m for d, m in zip(scan.decisions, [d.move for d in scan.decisions]) if m and d.trigger is Trigger.HIGH_WATERMARK
    ]
    for source in {m.source for m in watermark}:
        assert sum(m.source == source for m in watermark) <= cfg.experts_per_move
    for d in scan.decisions:
        assert (d.move is None) == (d.hold is not None)


def test_planned_placement_balances_every_layer_and_replicates_the_hottest():
    """``LayerLoads.planned_placement`` (``bench serve --redundant``): every expert hosted, each group at most
    ceil((E + R) / G) experts a layer; without replicas a layer splits its load evenly where it can, with
    R = 2 the hot experts of a skewed layer get a second replica and its groups level."""

    table = RoutingTable(
        version=1, num_experts=4, replicas={(layer, e): ("a" if e < 2 else "b",) for layer in (0, 1) for e in range(4)}
    )
    load = {
        (0, 0): 40.0,
        (0, 1): 30.0,
        (0, 2): 20.0,
        (0, 3): 10.0,
        (1, 0): 1000.0,
        (1, 1): 1.0,
        (1, 2): 1.0,
        (1, 3): 1.0,
    }
    loads = LayerLoads.build(table, [ExpertLoad(layer, e, t) for (layer, e), t in load.items()], ["a", "b"])
    assert loads.balancedness()[0] == 50 / 70  # a: 70 of 100

    plain = loads.planned_placement(top_k=2, redundant=0)
    hosts = plain.hosts()
    assert set(hosts) == set(table.replicas) and all(len(g) == 1 for g in hosts.values())
    on_a = sum(load[(0, e)] for e in range(4) if hosts[(0, e)] == ("a",))
    assert on_a == 50.0  # 40 + 10 against 30 + 20

    def hosted(hosts, layer: int, group: str) -> int:
        return sum(1 for (row, _), groups in hosts.items() if row == layer and group in groups)

    assert all(hosted(hosts, layer, group) == 2 for layer in (0, 1) for group in "ab")

    replicated = loads.planned_placement(top_k=2, redundant=2).hosts()
    assert set(replicated) == set(table.replicas)
    assert replicated[(1, 0)] == ("a", "b")  # the expert with nearly all of layer 1's tokens, on both groups
    assert all(hosted(replicated, layer, group) <= 3 for layer in (0, 1) for group in "ab")
