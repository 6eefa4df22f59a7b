"""The health verdicts as pure functions: what a check finds, how a replica's state
moves, and the routing table that keeps out-of-service replicas out of it without
ever leaving an expert unhosted. Plain data in and out; the monitor does the I/O.

The state machine (every change is a ``Transition`` with its reason and time)::

    HEALTHY --finding--> SUSPECT --finding, suspect_checks in a row--> QUARANTINED
       ^  ^                 |                                        ^  |
       |  +---clean check---+        quarantine-level finding --------+  | repair: reloaded
       |                                  (from any state)            |  | and verified
       |                                                              |  v
       +-------- probation_checks clean checks ------------------ PROBATION
                                                 (any finding: back to QUARANTINED)

Findings (``findings``) and their severity:

- fingerprint: the weights changed in memory since load -> quarantine;
- probe_non_finite: the probe's output holds a NaN or an Inf -> quarantine;
- divergence: KL(baseline || now) above ``kl_quarantine`` -> quarantine, above ``kl_suspect`` -> suspect;
- mean_shift: the mean output norm moved more than ``mean_shift_suspect`` -> suspect;
- served_non_finite: new NaN/Inf rows in served traffic (Describe) since the last check -> a notice
  only: a finite but extreme input from any Dispatch caller overflows a healthy expert, so served rows
  alone must not move a replica towards quarantine; the probe, whose input is ours, tells;
- replica_mismatch: with three or more replicas, one whose output norms are further than
  ``replica_deviation`` from their median -> suspect. With two, a disagreement cannot say
  which one is wrong: it only holds back a baseline (the fingerprint and KL still judge each).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

import torch

from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.orchestrator.health.config import HealthConfig
from expertmesh.orchestrator.health.state import (
    Baseline,
    Check,
    Finding,
    FindingKind,
    HealthState,
    Initiator,
    Pair,
    ReplicaId,
    ReplicaRecord,
    Severity,
)
from expertmesh.orchestrator.migration.plan import Tolerance

# -- findings ----------------------------------------------------------------------------------


def current_baseline(record: ReplicaRecord, fingerprint: str, probe: str) -> Baseline | None:
    """The record's baseline if it describes the weights loaded now (same load-time fingerprint) on the
    probe input used now (same digest)."""
    base = record.baseline
    return base if base is not None and base.fingerprint == fingerprint and base.probe == probe else None


def findings(record: ReplicaRecord, check: Check, config: HealthConfig) -> tuple[Finding, ...]:
    found = []
    if not check.fingerprint_intact:
        found.append(
            Finding(
                FindingKind.FINGERPRINT,
                Severity.QUARANTINE,
                f"weights changed in memory since they were loaded (fingerprint {check.fingerprint} no longer matches)",
            )
        )
    if check.probe_non_finite:
        found.append(
            Finding(
                FindingKind.PROBE_NON_FINITE,
                Severity.QUARANTINE,
                f"{check.probe_non_finite} probe output rows hold NaN or Inf",
            )
        )
    base = current_baseline(record, check.fingerprint, check.probe)
    if base is not None and check.kl is not None:
        if check.kl > config.kl_quarantine:
            found.append(
                Finding(
                    FindingKind.DIVERGENCE,
                    Severity.QUARANTINE,
                    f"KL(baseline || now) {check.kl:.3g} > {config.kl_quarantine:g}",
                )
            )
        elif check.kl > config.kl_suspect:
            found.append(
                Finding(
                    FindingKind.DIVERGENCE,
                    Severity.SUSPECT,
                    f"KL(baseline || now) {check.kl:.3g} > {config.kl_suspect:g}",
                )
            )
        shift = abs(check.norm_mean - base.norm_mean) / max(abs(base.norm_mean), 1e-12)
        if shift > config.mean_shift_suspect:
            found.append(
                Finding(
                    FindingKind.MEAN_SHIFT,
                    Severity.SUSPECT,
                    f"mean output norm {check.norm_mean:.4g} against {base.norm_mean:.4g} at baseline ({shift:.1%})",
                )
            )
    served = new_non_finite(record, check)
    if served:
        found.append(
            Finding(
                FindingKind.SERVED_NON_FINITE,
                Severity.NOTICE,
                f"{served} served output rows held NaN or Inf since the last check",
            )
        )
    if check.replicas >= 3 and check.deviation is not None and check.deviation > config.replica_deviation:
        found.append(
            Finding(
                FindingKind.REPLICA_MISMATCH,
                Severity.SUSPECT,
                f"output norms {check.deviation:.1%} from the median of the expert's {check.replicas} replicas",
            )
        )
    return tuple(found)


def new_non_finite(record: ReplicaRecord, check: Check) -> int:
    """Served non-finite rows since the last check; the count restarts when the expert is reloaded."""
    seen, now = record.non_finite_seen, check.served_non_finite
    return now - seen if now >= seen else now


# -- the state machine ---------------------------------------------------------------------------


def judge(record: ReplicaRecord, check: Check, config: HealthConfig) -> tuple[ReplicaRecord, tuple[Finding, ...]]:
    """The record after ``check``: its figures, a baseline when it is due, and the next state."""
    found = findings(record, check, config)
    base = current_baseline(record, check.fingerprint, check.probe)
    replicas_agree = check.deviation is None or check.deviation <= config.replica_deviation
    if base is None and record.state is HealthState.HEALTHY and not found and replicas_agree:
        base = check.candidate
    updated = replace(
        record,
        baseline=base,
        last_check=check.at,
        kl=check.kl,
        norm_mean=check.norm_mean,
        non_finite_seen=check.served_non_finite,
        probe_source=check.probe_source,
    )
    return _advance(updated, found, config, check.at), found


def may_change_probe(
    records: Iterable[ReplicaRecord], found: Mapping[ReplicaId, tuple[Finding, ...]], probe: str
) -> bool:
    """A layer's probe input may change (``probes``: re-pinned) only in a round that judged every replica of the
    layer healthy against a baseline on the old one (``probe``): a replica that went bad must not get a baseline
    on the new input as it is."""
    return all(
        r.state is HealthState.HEALTHY
        and not found.get(r.replica)
        and r.baseline is not None
        and r.baseline.probe == probe
        for r in records
    )


def rebaselined(record: ReplicaRecord, baseline: Baseline, probe_source: str) -> ReplicaRecord:
    """Its baseline on a new probe input, taken in the round that found it healthy on the old one."""
    return replace(record, baseline=baseline, probe_source=probe_source)


def _details(found: Iterable[Finding]) -> str:
    return "; ".join(f"{f.kind}: {f.detail}" for f in found)


def _advance(record: ReplicaRecord, found: tuple[Finding, ...], config: HealthConfig, at: float) -> ReplicaRecord:
    found = tuple(f for f in found if f.severity is not Severity.NOTICE)
    state = record.state
    if state is HealthState.QUARANTINED:
        return record
    if state is HealthState.PROBATION:
        if found:
            return quarantine(record, Initiator.MONITOR, f"relapsed on probation: {_details(found)}", at)
        clean = record.clean_checks + 1
        if clean >= config.probation_checks:
            return record.entering(
                HealthState.HEALTHY, at, f"{clean} clean checks since the repair", clean_checks=0, quarantined_by=None
            )
        return replace(record, clean_checks=clean)
    # HEALTHY or SUSPECT
    if any(f.severity is Severity.QUARANTINE for f in found):
        return quarantine(record, Initiator.MONITOR, _details(found), at)
    if not found:
        if state is HealthState.SUSPECT:
            return record.entering(HealthState.HEALTHY, at, "cleared: a clean check", suspect_checks=0)
        return record
    checks = (record.suspect_checks if state is HealthState.SUSPECT else 0) + 1
    if checks >= config.suspect_checks:
        return quarantine(record, Initiator.MONITOR, f"suspect for {checks} checks in a row: {_details(found)}", at)
    if state is HealthState.SUSPECT:
        return replace(record, suspect_checks=checks, reason=_details(found))
    return record.entering(HealthState.SUSPECT, at, _details(found), suspect_checks=checks)


def quarantine(record: ReplicaRecord, by: Initiator, reason: str, at: float) -> ReplicaRecord:
    """Out of service now, from any state (an operator's word, or a monitor's finding)."""
    return record.entering(HealthState.QUARANTINED, at, reason, quarantined_by=by, suspect_checks=0, clean_checks=0)


def same_quarantine(now: ReplicaRecord | None, then: ReplicaRecord | None) -> bool:
    """``now`` is in the quarantine ``then`` was in (a check may have refreshed its figures meanwhile): a repair
    begun on ``then`` applies to ``now``."""
    return (
        now is not None
        and then is not None
        and now.state is then.state is HealthState.QUARANTINED
        and now.since == then.since
    )


def repaired(record: ReplicaRecord, baseline: Baseline, at: float) -> ReplicaRecord:
    """Reloaded and verified against the checkpoint: on probation, with the verified output as its
    baseline and its served statistics restarted (the reload reset them)."""
    return record.entering(
        HealthState.PROBATION,
        at,
        "reloaded from the checkpoint and verified against its reference; on probation",
        baseline=baseline,
        clean_checks=0,
        repairs=record.repairs + 1,
        non_finite_seen=0,
        kl=None,
        norm_mean=baseline.norm_mean,
    )


def repair_failed(record: ReplicaRecord, detail: str) -> ReplicaRecord:
    """Still quarantined; the reason says why the repair did not take."""
    return replace(record, reason=f"repair failed: {detail}", repairs=record.repairs + 1)


def wants_repair(record: ReplicaRecord, config: HealthConfig) -> bool:
    """The monitor repairs its own quarantines on its own; an operator's wait for ``release``."""
    return config.auto_repair and record.state is HealthState.QUARANTINED and record.quarantined_by is Initiator.MONITOR


#: the value of ``expertmesh.expert.health`` for a replica in each state (an expert shows its worst replica)
SCORE = {HealthState.HEALTHY: 1.0, HealthState.PROBATION: 0.75, HealthState.SUSPECT: 0.5, HealthState.QUARANTINED: 0.0}


def reference_tolerance(dtype: torch.dtype) -> Tolerance:
    """How close a repaired replica must come to the reference the orchestrator computes from the
    checkpoint on its CPU: another device's kernels round differently, in the last bits for
    float32 and at the 1 % level in half precision (the migration canary's tolerance)."""
    return Tolerance(1e-4, 1e-4) if dtype == torch.float32 else Tolerance(1e-2, 1e-2)


# -- the routing table ------------------------------------------------------------------------------


def plan_table(table: RoutingTable, records: Mapping[ReplicaId, ReplicaRecord]) -> RoutingTable | None:
    """The next table version that lists no out-of-service replica of an expert that has another
    replica in service, and lists again the replicas the monitor took out that are healthy now;
    None when ``table`` already does. An expert whose listed replicas are all out of service
    keeps them listed (never unhosted): routers fall back for it (``QuarantinedReplica``)."""
    by_pair: dict[Pair, dict[str, ReplicaRecord]] = {}
    for rid, record in records.items():
        by_pair.setdefault(rid.pair, {})[rid.group] = record
    changed: dict[Pair, tuple[str, ...]] = {}
    for pair, recs in sorted(by_pair.items()):
        listed = table.replicas.get(pair)
        if listed is None:
            continue
        back = [g for g, r in sorted(recs.items()) if r.withdrawn and not r.state.out_of_service and g not in listed]
        serving = [g for g in listed if not (g in recs and recs[g].state.out_of_service)] + back
        wanted = tuple(serving) if serving else listed
        if wanted != listed:
            changed[pair] = wanted
    if not changed:
        return None
    return replace(
        table,
        version=table.version + 1,
        replicas={**table.replicas, **changed},
        shares={p: s for p, s in table.shares.items() if p not in changed},
    )


def mark_withdrawn(records: Mapping[ReplicaId, ReplicaRecord], table: RoutingTable) -> dict[ReplicaId, ReplicaRecord]:
    """Each record's ``withdrawn`` as ``table`` has it: an out-of-service replica (or one the
    monitor took out and has not put back yet) that the table does not list."""
    return {
        rid: replace(
            r,
            withdrawn=(r.state.out_of_service or r.withdrawn) and rid.group not in table.replicas.get(rid.pair, ()),
        )
        for rid, r in records.items()
    }
