"""The ExpertMigration status as a pure function of the migration record
(``kube.conditions``), and the resource's JSON forms (``kube.resource``)."""

from __future__ import annotations

import pytest

from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.orchestrator.kube.conditions import refused_status, status_of
from expertmesh.orchestrator.kube.controller import migration_id_for
from expertmesh.orchestrator.kube.experts import expert_rows, render_table
from expertmesh.orchestrator.kube.resource import (
    ConditionType,
    ExpertMigration,
    MigrationSpec,
    MigrationStatus,
    Origin,
    manifest,
)
from expertmesh.orchestrator.migration.plan import PHASES
from expertmesh.orchestrator.migration.state import Failure, Migration, MigrationMode, Phase, PhaseChange

T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z


def record(mode: MigrationMode, upto: Phase, *, end: Phase | None = None, failure: Failure | None = None) -> Migration:
    """A record of ``mode`` that went through its phases up to ``upto`` (one second each), then ``end``."""
    order = PHASES[mode]
    phases = list(order[: order.index(upto) + 1]) + ([end] if end else [])
    history = tuple(PhaseChange(p, T0 + i, 1 if i < 3 else 3) for i, p in enumerate(phases))
    last = phases[-1]
    return Migration(
        id="abc123def456",
        layer=1,
        expert=2,
        mode=mode,
        source="g0",
        target=None if mode is MigrationMode.EVICT else "g2",
        phase=last,
        table_version=history[-1].table_version,
        replicas_before=("g0",),
        shares_before=(),
        bytes_loaded=4096,
        started_at=T0,
        completed_at=T0 + len(phases) - 1 if last.terminal else None,
        failure=failure,
        reason="canary mismatch: 'g2' differs" if failure else "",
        history=history,
    )


def conditions(status: MigrationStatus) -> dict[str, tuple[str, str]]:
    return {c.type.value: (c.status, c.reason) for c in status.conditions}


def test_a_move_reports_each_milestone_as_it_passes():
    running = status_of(record(MigrationMode.MOVE, Phase.CHECKING), generation=1)
    assert running.phase == "Checking" and not running.finished
    assert conditions(running) == {
        "Loaded": ("Unknown", "Waiting"),
        "Switched": ("Unknown", "Waiting"),
        "Drained": ("Unknown", "Waiting"),
    }
    draining = status_of(record(MigrationMode.MOVE, Phase.DRAINING), generation=1)
    assert conditions(draining) == {
        "Loaded": ("True", "CanaryPassed"),
        "Switched": ("True", "TablePublished"),
        "Drained": ("Unknown", "Waiting"),
    }
    # Loaded turned True when SWITCHING began (CHECKING passed), not when someone looked.
    assert draining.condition(ConditionType.LOADED).last_transition_time == "2023-11-14T22:13:23Z"
    done = status_of(record(MigrationMode.MOVE, Phase.SUCCEEDED), generation=3)
    assert done.finished and done.phase == "Succeeded" and done.completed_at == "2023-11-14T22:13:28Z"
    assert conditions(done) == {
        "Loaded": ("True", "CanaryPassed"),
        "Switched": ("True", "TablePublished"),
        "Drained": ("True", "SourceDrained"),
        "Succeeded": ("True", "Completed"),
    }
    assert {c.observed_generation for c in done.conditions} == {3} and done.observed_generation == 3
    assert (done.migration_id, done.source, done.target, done.bytes_loaded) == ("abc123def456", "g0", "g2", 4096)


def test_a_failure_says_why_and_what_was_not_reached():
    failed = status_of(record(MigrationMode.MOVE, Phase.CHECKING, end=Phase.FAILED, failure=Failure.CANARY_MISMATCH), 1)
    assert failed.finished and failed.phase == "Failed"
    assert conditions(failed) == {
        "Loaded": ("False", "CanaryMismatch"),
        "Switched": ("False", "CanaryMismatch"),
        "Drained": ("False", "CanaryMismatch"),
        "Failed": ("True", "CanaryMismatch"),
    }
    assert failed.condition(ConditionType.FAILED).message.startswith("canary mismatch")
    rolled = status_of(
        record(MigrationMode.MOVE, Phase.CONFIRMING, end=Phase.ROLLED_BACK, failure=Failure.DRAIN_TIMEOUT), 1
    )
    assert rolled.phase == "RolledBack"
    assert conditions(rolled)["Switched"] == ("True", "TablePublished") and conditions(rolled)["Failed"] == (
        "True",
        "DrainTimeout",
    )


@pytest.mark.parametrize(
    "mode, kinds",
    [
        (MigrationMode.REPLICATE, ["Loaded", "Switched", "Succeeded"]),
        (MigrationMode.EVICT, ["Switched", "Drained", "Succeeded"]),
    ],
)
def test_each_mode_has_its_own_milestones(mode, kinds):
    done = status_of(record(mode, Phase.SUCCEEDED), 1)
    assert [c.type.value for c in done.conditions] == kinds
    assert all(c.status == "True" for c in done.conditions)


def test_status_round_trips_and_is_deterministic():
    m = record(MigrationMode.MOVE, Phase.RETIRING)
    status = status_of(m, 2)
    assert status_of(m, 2) == status, "the same record always gives the same status"
    assert MigrationStatus.from_dict(status.to_dict()) == status
    assert "completedAt" not in status.to_dict(), "unset timestamps are left out (the schema says date-time)"
    refused = refused_status("Refused", "unknown group 'g9'", T0, 1)
    assert refused.finished and conditions(refused) == {"Failed": ("True", "Refused")}


def test_spec_parsing_names_the_bad_field():
    good = ExpertMigration.from_dict(
        {
            "metadata": {
                "name": "m",
                "namespace": "ns",
                "uid": "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0",
                "generation": 1,
            },
            "spec": {"layer": 1, "expert": 2, "to": "g2"},
        }
    )
    assert good.spec == MigrationSpec(1, 2, MigrationMode.MOVE, None, "g2") and good.status == MigrationStatus()
    assert migration_id_for(good.uid) == "0f1e2d3c4b5a"
    for spec, words in [
        ({"layer": -1, "expert": 0}, "spec.layer"),
        ({"layer": 0}, "spec.expert"),
        ({"layer": 0, "expert": 0, "mode": "teleport"}, "spec.mode"),
        (None, "spec is missing"),
    ]:
        bad = ExpertMigration.from_dict({"metadata": {"name": "m"}, "spec": spec})
        assert bad.spec is None and words in bad.spec_problem


def test_manifest_names_origin_and_generates_a_name():
    doc = manifest(
        MigrationSpec(1, 2, MigrationMode.MOVE, "g0", "g2"), origin=Origin.DRIFT, initiator="drift:hot-expert"
    )
    assert doc["metadata"] == {
        "labels": {"expertmesh.io/origin": "drift"},
        "annotations": {"expertmesh.io/initiator": "drift:hot-expert"},
        "generateName": "l1-e2-",
    }
    named = manifest(MigrationSpec(1, 2, target="g2"), origin=Origin.MANUAL, name="m1", migration_id="abc")
    assert named["metadata"] == {
        "labels": {"expertmesh.io/origin": "manual"},
        "annotations": {"expertmesh.io/migration-id": "abc"},
        "name": "m1",
    }
    assert ExpertMigration.from_dict(named).submitted_as == "abc"
    assert doc["spec"] == {"layer": 1, "expert": 2, "mode": "move", "from": "g0", "to": "g2"}


def test_expert_rows_show_replicas_shares_and_load():
    table = RoutingTable(
        7, 2, {(0, 0): ("g0",), (0, 1): ("g0", "g1"), (1, 0): ("g1",), (1, 1): ("g1",)}, {(0, 1): (0.75, 0.25)}
    )
    rows = expert_rows(table, {0: (30.0, 10.0)})
    assert [(r.layer, r.expert, r.load_share) for r in rows] == [(0, 0, 0.75), (0, 1, 0.25), (1, 0, None), (1, 1, None)]
    text = render_table(table, rows, routers=2)
    assert text.splitlines()[0] == "routing table v7: 2 MoE layers, 2 groups; load from 2 routers"
    assert "g0 (75%), g1 (25%)" in text and "75.0%" in text
    assert [r.expert for r in expert_rows(table, {}, layer=1)] == [0, 1]
