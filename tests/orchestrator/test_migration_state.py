"""The migration record: lifecycle bookkeeping, JSON round trip, and the store's
``migrations`` hash (in-process backend; the executor tests also use Redis)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertmesh.contracts.errors import MigrationNotFound
from expertmesh.orchestrator.migration.state import (
    Failure,
    Migration,
    MigrationMode,
    Phase,
    PhaseChange,
    load,
    load_all,
    save,
)
from expertmesh.store import open_store


def _record(**kw) -> Migration:
    base = dict(
        id="m1",
        layer=1,
        expert=2,
        mode=MigrationMode.MOVE,
        source="g0",
        target="g1",
        phase=Phase.PENDING,
        table_version=4,
        replicas_before=("g0",),
        shares_before=(),
        started_at=100.0,
        history=(PhaseChange(Phase.PENDING, 100.0, 4),),
    )
    return Migration(**{**base, **kw})


def test_entering_appends_history_and_stamps_the_end():
    m = _record().entering(Phase.LOADING, 101.0, target_preloaded=True)
    assert m.phase is Phase.LOADING and m.target_preloaded and m.completed_at is None
    m = m.entering(Phase.FAILED, 102.5, failure=Failure.OVER_BUDGET, reason="full", table_version=4)
    assert m.completed_at == 102.5 and m.phase.terminal
    assert [(h.phase, h.at) for h in m.history] == [
        (Phase.PENDING, 100.0),
        (Phase.LOADING, 101.0),
        (Phase.FAILED, 102.5),
    ]
    assert m.pair == (1, 2)
    assert "g0 -> g1" in m.describe() and "off g0" in _record(mode=MigrationMode.EVICT, target=None).describe()


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(list(MigrationMode)),
    st.sampled_from(list(Phase)),
    st.sampled_from([None, *Failure]),
    st.lists(st.sampled_from(["g0", "g1", "g2"]), min_size=1, max_size=3, unique=True),
    st.lists(st.floats(0, 1), max_size=3),
    st.text(max_size=40),
    st.lists(st.tuples(st.sampled_from(list(Phase)), st.floats(0, 1e10), st.integers(0, 1000)), max_size=6),
)
def test_json_round_trip(mode, phase, failure, replicas, shares, reason, history):
    m = _record(
        mode=mode,
        phase=phase,
        failure=failure,
        replicas_before=tuple(replicas),
        shares_before=tuple(shares),
        reason=reason,
        target=None if mode is MigrationMode.EVICT else "g1",
        completed_at=5.0 if phase.terminal else None,
        history=tuple(PhaseChange(*h) for h in history),
    )
    assert Migration.from_json(m.to_json()) == m


def test_store_keeps_records_by_id():
    store = open_store("memory://")
    assert load_all(store) == []
    with pytest.raises(MigrationNotFound, match="no migration 'nope'"):
        load(store, "nope")
    first, second = _record(id="a", started_at=2.0), _record(id="b", started_at=1.0)
    save(store, first)
    save(store, second)
    assert load(store, "a") == first
    assert [m.id for m in load_all(store)] == ["b", "a"], "oldest first"
    moved = first.entering(Phase.LOADING, 3.0)
    save(store, moved)
    assert load(store, "a") == moved and len(load_all(store)) == 2
