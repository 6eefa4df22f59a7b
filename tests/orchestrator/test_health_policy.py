"""The health verdicts (``orchestrator.health.policy``): every finding at its threshold,
the state machine healthy -> suspect -> quarantined -> probation -> healthy with its
reasons and times, baselines, repairs, and the routing-table edit that never
unhosts an expert. Plain data in and out."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from expertmesh.contracts.errors import InvalidRequest
from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.orchestrator.health import policy
from expertmesh.orchestrator.health.config import HealthConfig, health_config
from expertmesh.orchestrator.health.state import (
    Baseline,
    Check,
    FindingKind,
    HealthState,
    Histogram,
    Initiator,
    ReplicaId,
    ReplicaRecord,
    Severity,
)

CONFIG = HealthConfig(suspect_checks=2, probation_checks=2)
RID = ReplicaId(1, 2, "g0")
HIST = Histogram((1.0,), (5, 5))


def baseline(fingerprint: str = "f", norm_mean: float = 10.0, at: float = 1.0, probe: str = "p") -> Baseline:
    return Baseline(
        taken_at=at, fingerprint=fingerprint, norm_mean=norm_mean, norms=HIST, activations=HIST, probe=probe
    )


def check(at: float = 100.0, **changes) -> Check:
    clean = Check(
        at=at,
        fingerprint="f",
        fingerprint_intact=True,
        probe="p",
        probe_source="recorded",
        probe_non_finite=0,
        served_non_finite=0,
        norm_mean=10.0,
        kl=0.0,
        candidate=baseline(at=at),
        deviation=None,
        replicas=1,
    )
    return replace(clean, **changes)


def record(state: HealthState = HealthState.HEALTHY, **changes) -> ReplicaRecord:
    return ReplicaRecord(RID, state=state, **{"baseline": baseline(), **changes})


def kinds(found) -> dict[FindingKind, Severity]:
    return {f.kind: f.severity for f in found}


# -- findings ------------------------------------------------------------------------------------


def test_a_clean_check_finds_nothing():
    assert policy.findings(record(), check(), CONFIG) == ()


def test_a_changed_fingerprint_or_a_non_finite_probe_quarantines():
    assert kinds(policy.findings(record(), check(fingerprint_intact=False), CONFIG)) == {
        FindingKind.FINGERPRINT: Severity.QUARANTINE
    }
    found = policy.findings(record(), check(probe_non_finite=3), CONFIG)
    assert (
        kinds(found) == {FindingKind.PROBE_NON_FINITE: Severity.QUARANTINE} and "3 probe output rows" in found[0].detail
    )


@pytest.mark.parametrize(
    ("kl", "expected"),
    [
        (0.05, {}),
        (0.0501, {FindingKind.DIVERGENCE: Severity.SUSPECT}),
        (0.5, {FindingKind.DIVERGENCE: Severity.SUSPECT}),
        (0.5001, {FindingKind.DIVERGENCE: Severity.QUARANTINE}),
    ],
)
def test_kl_thresholds(kl, expected):
    assert kinds(policy.findings(record(), check(kl=kl), CONFIG)) == expected


def test_mean_shift_threshold_is_relative_to_the_baseline():
    assert policy.findings(record(), check(norm_mean=10.5), CONFIG) == ()  # exactly 5 %
    found = policy.findings(record(), check(norm_mean=9.4), CONFIG)
    assert kinds(found) == {FindingKind.MEAN_SHIFT: Severity.SUSPECT} and "6.0%" in found[0].detail


@pytest.mark.parametrize("stale", [baseline(fingerprint="old"), baseline(probe="another input")])
def test_a_baseline_of_other_weights_or_another_probe_input_judges_nothing(stale):
    old = record(baseline=stale)
    assert policy.current_baseline(old, "f", "p") is None
    assert policy.findings(old, check(kl=9.0, norm_mean=1.0), CONFIG) == ()
    assert policy.judge(old, check(kl=None, at=9.0), CONFIG)[0].baseline == baseline(at=9.0), (
        "a clean check takes a new one"
    )


def test_the_verdict_says_what_the_probe_input_was():
    assert policy.judge(record(), check(probe_source="seeded"), CONFIG)[0].probe_source == "seeded"
    assert policy.judge(record(), check(), CONFIG)[0].probe_source == "recorded"


def test_a_probe_input_changes_only_when_every_replica_was_judged_healthy_on_it():
    healthy, other = record(), replace(record(), replica=ReplicaId(1, 3, "g1"))
    assert policy.may_change_probe([healthy, other], {}, "p")
    assert not policy.may_change_probe([healthy, other], {}, "q"), "judged on another input"
    assert not policy.may_change_probe([healthy, record(baseline=None)], {}, "p"), (
        "one was never judged against a baseline"
    )
    assert not policy.may_change_probe([healthy, record(HealthState.SUSPECT)], {}, "p")
    assert not policy.may_change_probe([healthy, record(HealthState.PROBATION)], {}, "p")
    found = policy.findings(healthy, check(kl=0.06), CONFIG)
    assert not policy.may_change_probe([healthy], {RID: found}, "p"), "a finding this round, though still healthy"
    moved = policy.rebaselined(healthy, baseline(probe="q", at=50.0), "recorded")
    assert moved.baseline.probe == "q" and moved.probe_source == "recorded" and moved.state is HealthState.HEALTHY
    assert moved.history == healthy.history


def test_served_non_finite_rows_count_since_the_last_check():
    seen = record(non_finite_seen=4)
    assert policy.findings(seen, check(served_non_finite=4), CONFIG) == ()
    found = policy.findings(seen, check(served_non_finite=7), CONFIG)
    assert kinds(found) == {FindingKind.SERVED_NON_FINITE: Severity.NOTICE} and found[0].detail.startswith("3 served")
    assert policy.new_non_finite(seen, check(served_non_finite=2)) == 2, "the count restarted: the expert was reloaded"


def test_replica_mismatch_needs_three_replicas_to_blame_one():
    assert policy.findings(record(), check(deviation=0.2, replicas=2), CONFIG) == ()
    assert policy.findings(record(), check(deviation=0.05, replicas=3), CONFIG) == ()
    assert kinds(policy.findings(record(), check(deviation=0.2, replicas=3), CONFIG)) == {
        FindingKind.REPLICA_MISMATCH: Severity.SUSPECT
    }


# -- baselines -------------------------------------------------------------------------------------


def test_the_first_clean_check_of_a_healthy_replica_takes_the_baseline():
    fresh = ReplicaRecord(RID)
    after, found = policy.judge(fresh, check(kl=None, at=7.0), CONFIG)
    assert found == () and after.baseline == baseline(at=7.0) and after.state is HealthState.HEALTHY
    assert (after.last_check, after.norm_mean, after.kl) == (7.0, 10.0, None)


def test_no_baseline_from_a_check_with_findings_a_disagreement_or_a_suspect():
    fresh = ReplicaRecord(RID)
    assert policy.judge(fresh, check(kl=None, probe_non_finite=1), CONFIG)[0].baseline is None
    assert policy.judge(fresh, check(kl=None, deviation=0.3, replicas=2), CONFIG)[0].baseline is None
    suspect = ReplicaRecord(RID, state=HealthState.SUSPECT, suspect_checks=1)
    assert policy.judge(suspect, check(kl=None), CONFIG)[0].baseline is None


def test_weights_loaded_anew_replace_the_baseline():
    old = record(baseline=baseline(fingerprint="old"))
    assert policy.judge(old, check(kl=None, at=9.0), CONFIG)[0].baseline == baseline(at=9.0)
    kept = policy.judge(record(), check(at=9.0), CONFIG)[0]
    assert kept.baseline == baseline(), "a current baseline stays as it was taken"


# -- the state machine -------------------------------------------------------------------------------


def test_healthy_to_suspect_to_quarantined_after_suspect_checks():
    one, _ = policy.judge(record(), check(kl=0.1, at=10.0), CONFIG)
    assert one.state is HealthState.SUSPECT and one.suspect_checks == 1 and one.since == 10.0
    assert one.reason.startswith("divergence: KL(baseline || now) 0.1 > 0.05")
    two, _ = policy.judge(one, check(kl=0.2, at=20.0), CONFIG)
    assert two.state is HealthState.QUARANTINED and two.quarantined_by is Initiator.MONITOR
    assert two.reason.startswith("suspect for 2 checks in a row: divergence") and two.since == 20.0
    assert [(t.state, t.at) for t in two.history] == [(HealthState.SUSPECT, 10.0), (HealthState.QUARANTINED, 20.0)]


def test_a_suspect_with_a_clean_check_is_healthy_again():
    one, _ = policy.judge(record(), check(kl=0.1, at=10.0), CONFIG)
    back, _ = policy.judge(one, check(at=20.0), CONFIG)
    assert back.state is HealthState.HEALTHY and back.suspect_checks == 0 and back.reason == "cleared: a clean check"
    again, _ = policy.judge(back, check(kl=0.1, at=30.0), CONFIG)
    assert again.state is HealthState.SUSPECT and again.suspect_checks == 1, "the count starts over"


def test_suspect_checks_of_one_quarantines_at_the_first_finding():
    after, _ = policy.judge(record(), check(kl=0.1), HealthConfig(suspect_checks=1))
    assert after.state is HealthState.QUARANTINED


@pytest.mark.parametrize("state", [HealthState.HEALTHY, HealthState.SUSPECT])
def test_a_quarantine_level_finding_quarantines_at_once(state):
    after, _ = policy.judge(
        record(state, suspect_checks=int(state is HealthState.SUSPECT)), check(fingerprint_intact=False), CONFIG
    )
    assert after.state is HealthState.QUARANTINED and after.reason.startswith("fingerprint: weights changed in memory")


def test_a_quarantined_replica_stays_so_however_its_checks_look():
    q = policy.quarantine(record(), Initiator.MONITOR, "bad", 5.0)
    after, found = policy.judge(q, check(at=50.0), CONFIG)
    assert found == () and after.state is HealthState.QUARANTINED and after.since == 5.0 and after.last_check == 50.0


def test_probation_needs_clean_checks_then_healthy_and_a_relapse_is_quarantine():
    q = policy.quarantine(record(), Initiator.MONITOR, "bad", 5.0)
    p = policy.repaired(q, baseline(at=6.0), 6.0)
    assert p.state is HealthState.PROBATION and p.repairs == 1 and p.baseline == baseline(at=6.0)
    one, _ = policy.judge(p, check(at=10.0), CONFIG)
    assert one.state is HealthState.PROBATION and one.clean_checks == 1
    two, _ = policy.judge(one, check(at=20.0), CONFIG)
    assert (
        two.state is HealthState.HEALTHY
        and two.reason == "2 clean checks since the repair"
        and two.quarantined_by is None
    )
    assert [t.state for t in two.history] == [HealthState.QUARANTINED, HealthState.PROBATION, HealthState.HEALTHY]
    relapse, _ = policy.judge(one, check(kl=0.1, at=20.0), CONFIG)
    assert relapse.state is HealthState.QUARANTINED and relapse.reason.startswith("relapsed on probation: divergence")
    assert relapse.clean_checks == 0


def test_operator_quarantine_from_any_state_and_who_repairs_what():
    for state in HealthState:
        q = policy.quarantine(record(state), Initiator.OPERATOR, "looks odd", 3.0)
        assert (q.state, q.quarantined_by, q.reason, q.since) == (
            HealthState.QUARANTINED,
            Initiator.OPERATOR,
            "looks odd",
            3.0,
        )
        assert not policy.wants_repair(q, CONFIG), "an operator's quarantine waits for release"
    mine = policy.quarantine(record(), Initiator.MONITOR, "bad", 3.0)
    assert policy.wants_repair(mine, CONFIG) and not policy.wants_repair(mine, HealthConfig(auto_repair=False))
    assert not policy.wants_repair(record(), CONFIG)


def test_a_failed_repair_stays_quarantined_with_the_reason():
    q = policy.quarantine(record(), Initiator.MONITOR, "bad", 3.0)
    failed = policy.repair_failed(q, "differs by 0.3")
    assert failed.state is HealthState.QUARANTINED and failed.reason == "repair failed: differs by 0.3"
    assert failed.repairs == 1 and failed.since == 3.0 and failed.history == q.history


def test_scores_order_the_states():
    s = policy.SCORE
    assert s[HealthState.HEALTHY] > s[HealthState.PROBATION] > s[HealthState.SUSPECT] > s[HealthState.QUARANTINED] == 0


def test_reference_tolerance_by_dtype():
    assert policy.reference_tolerance(torch.float32).atol == 1e-4
    assert policy.reference_tolerance(torch.bfloat16).atol == policy.reference_tolerance(torch.float16).atol == 1e-2


# -- the routing table ---------------------------------------------------------------------------------

TABLE = RoutingTable(
    version=4,
    num_experts=4,
    replicas={(1, 0): ("g0", "g1"), (1, 1): ("g0",), (1, 2): ("g0", "g1", "g2")},
    shares={(1, 0): (0.7, 0.3), (1, 2): (0.5, 0.25, 0.25)},
)


def at(layer, expert, group, state=HealthState.HEALTHY, **changes):
    rid = ReplicaId(layer, expert, group)
    return rid, ReplicaRecord(rid, state=state, **changes)


def test_no_edit_while_every_replica_is_in_service():
    assert policy.plan_table(TABLE, dict([at(1, 0, "g0"), at(1, 0, "g1", HealthState.SUSPECT)])) is None


def test_an_out_of_service_replica_with_another_in_service_leaves_the_table():
    for state in (HealthState.QUARANTINED, HealthState.PROBATION):
        table = policy.plan_table(TABLE, dict([at(1, 0, "g1", state)]))
        assert table.version == 5 and table.replicas[(1, 0)] == ("g0",)
        assert (1, 0) not in table.shares, "the shares of the edited expert go"
        assert table.shares[(1, 2)] == (0.5, 0.25, 0.25) and table.replicas[(1, 1)] == ("g0",)


def test_the_last_replica_is_never_unlisted():
    assert policy.plan_table(TABLE, dict([at(1, 1, "g0", HealthState.QUARANTINED)])) is None
    both = dict([at(1, 0, "g0", HealthState.QUARANTINED), at(1, 0, "g1", HealthState.QUARANTINED)])
    assert policy.plan_table(TABLE, both) is None


def test_several_experts_change_in_one_version():
    records = dict(
        [
            at(1, 0, "g1", HealthState.QUARANTINED),
            at(1, 2, "g0", HealthState.QUARANTINED),
            at(1, 2, "g2", HealthState.PROBATION),
        ]
    )
    table = policy.plan_table(TABLE, records)
    assert table.version == 5 and table.replicas[(1, 0)] == ("g0",) and table.replicas[(1, 2)] == ("g1",)


def test_a_withdrawn_replica_healthy_again_is_listed_again():
    table = RoutingTable(version=5, num_experts=4, replicas={(1, 0): ("g0",)})
    assert policy.plan_table(table, dict([at(1, 0, "g1", HealthState.PROBATION, withdrawn=True)])) is None
    back = policy.plan_table(table, dict([at(1, 0, "g1", withdrawn=True)]))
    assert back.version == 6 and back.replicas[(1, 0)] == ("g0", "g1")
    assert policy.plan_table(table, dict([at(1, 0, "g1")])) is None, "only what the monitor took out goes back"


def test_a_healthy_replica_coming_back_lets_the_last_quarantined_one_go():
    table = RoutingTable(version=5, num_experts=4, replicas={(1, 0): ("g0",)})
    records = dict([at(1, 0, "g0", HealthState.QUARANTINED), at(1, 0, "g1", withdrawn=True)])
    assert policy.plan_table(table, records).replicas[(1, 0)] == ("g1",)


def test_mark_withdrawn_follows_the_table():
    table = RoutingTable(version=5, num_experts=4, replicas={(1, 0): ("g0",), (1, 1): ("g0",)})
    records = dict(
        [
            at(1, 0, "g1", HealthState.QUARANTINED),  # out of the table: withdrawn
            at(1, 1, "g0", HealthState.QUARANTINED, withdrawn=True),  # listed (the last one): not withdrawn
            at(1, 0, "g0"),  # healthy and listed
            at(1, 1, "g1", withdrawn=True),  # healthy, not listed back yet: still withdrawn
        ]
    )
    marked = policy.mark_withdrawn(records, table)
    assert {rid.key: r.withdrawn for rid, r in marked.items()} == {
        "1/0/g1": True,
        "1/1/g0": False,
        "1/0/g0": False,
        "1/1/g1": True,
    }


# -- records and settings ------------------------------------------------------------------------------


def test_records_survive_json():
    q = policy.quarantine(record(non_finite_seen=3, kl=0.2, norm_mean=9.0), Initiator.OPERATOR, "why", 4.0)
    p = policy.repaired(q, baseline(at=5.0), 5.0)
    for r in (ReplicaRecord(RID), q, p, replace(p, withdrawn=True)):
        assert ReplicaRecord.from_json(r.to_json()) == r


def test_the_history_keeps_the_last_transitions():
    r = record()
    for i in range(40):
        r = r.entering(HealthState.SUSPECT if i % 2 else HealthState.HEALTHY, float(i), f"step {i}")
    assert len(r.history) == 32 and r.history[-1].reason == "step 39" and r.history[0].reason == "step 8"


def test_settings_are_checked_and_named_by_their_variable(monkeypatch):
    assert health_config(type("Args", (), {"health_monitor": True})()).enabled
    monkeypatch.setenv("EXPERTMESH_HEALTH_KL_SUSPECT", "0.9")
    with pytest.raises(
        InvalidRequest, match=r"EXPERTMESH_HEALTH_KL_SUSPECT \(0.9\) must be below EXPERTMESH_HEALTH_KL_QUARANTINE"
    ):
        health_config(type("Args", (), {"health_monitor": None})())
    monkeypatch.setenv("EXPERTMESH_HEALTH_KL_SUSPECT", "0.01")
    monkeypatch.setenv("EXPERTMESH_HEALTH_TOKENS", "3")
    with pytest.raises(InvalidRequest, match="EXPERTMESH_HEALTH_TOKENS"):
        health_config(type("Args", (), {"health_monitor": None})())


def test_served_non_finite_rows_alone_never_quarantine_a_replica_whose_probe_is_clean():
    """A finite but extreme input from any Dispatch caller overflows a healthy expert's output to Inf: counted
    as a suspect finding, such traffic checks after checks quarantined a healthy replica."""
    state = record()
    for served in range(1, 3 * CONFIG.suspect_checks + 2):
        state, found = policy.judge(state, check(served_non_finite=100 * served), CONFIG)
        assert kinds(found) == {FindingKind.SERVED_NON_FINITE: Severity.NOTICE}
        assert state.state is HealthState.HEALTHY
