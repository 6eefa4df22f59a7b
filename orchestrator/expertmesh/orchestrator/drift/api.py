"""A drift scan as the admin API's ``ScanDriftResponse`` (``expertmesh.v1.Admin/ScanDrift``)."""

from __future__ import annotations

from expertmesh.orchestrator.drift.controller import DriftRecord, ScanReport
from expertmesh.orchestrator.drift.state import GroupUtilisation
from expertmesh.v1 import admin_pb2 as pb


def _group(u: GroupUtilisation) -> pb.DriftGroup:
    group = pb.DriftGroup(
        group=u.group, weight_bytes=u.weight_bytes, budget_bytes=u.budget_bytes, scans_above=u.scans_above
    )
    if u.memory is not None:
        group.memory = u.memory
    if u.busy is not None:
        group.busy = u.busy
    return group


def _decision(r: DriftRecord) -> pb.DriftDecision:
    d, move = r.decision, r.decision.move
    decision = pb.DriftDecision(
        trigger=d.trigger.value,
        result=r.result.value,
        hold=d.hold.value if d.hold else "",
        detail=r.detail,
        migration_id=r.migration_id,
    )
    if move is not None:
        decision.layer, decision.expert, decision.source, decision.target = (
            move.layer,
            move.expert,
            move.source,
            move.target,
        )
    return decision


def to_proto(report: ScanReport) -> pb.ScanDriftResponse:
    return pb.ScanDriftResponse(
        dry_run=report.dry_run,
        groups=[_group(u) for u in report.scan.groups],
        layers=[
            pb.DriftLayer(layer=b.layer, balancedness=b.balancedness, scans_below=b.scans_below)
            for b in report.scan.layers
        ],
        decisions=[_decision(r) for r in report.records],
        window_tokens=report.scan.window_tokens,
    )
