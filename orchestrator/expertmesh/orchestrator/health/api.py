"""Replica health as the admin API's messages (``ListExperts``, ``Quarantine``, ``Release``)."""

from __future__ import annotations

from expertmesh.orchestrator.health.monitor import ReplicaStatus
from expertmesh.orchestrator.health.state import HealthState
from expertmesh.v1 import admin_pb2 as pb


def state_to_proto(state: HealthState) -> int:
    return pb.ExpertHealthState.Value(f"EXPERT_HEALTH_STATE_{state.name}")


def state_from_proto(value: int) -> HealthState:
    return HealthState[pb.ExpertHealthState.Name(value).removeprefix("EXPERT_HEALTH_STATE_")]


def replica_to_proto(status: ReplicaStatus) -> pb.ReplicaHealth:
    r, rid = status.record, status.record.replica
    message = pb.ReplicaHealth(
        layer=rid.layer,
        expert=rid.expert,
        group=rid.group,
        state=state_to_proto(r.state),
        reason=r.reason,
        since=r.since,
        listed=status.listed,
        baseline_at=r.baseline.taken_at if r.baseline else 0.0,
        last_check=r.last_check,
        quarantined_by=r.quarantined_by.value if r.quarantined_by else "",
        repairs=r.repairs,
        probe_source=r.probe_source,
        history=[pb.HealthTransition(state=state_to_proto(t.state), at=t.at, reason=t.reason) for t in r.history],
    )
    if r.kl is not None:
        message.kl = r.kl
    if r.norm_mean is not None:
        message.norm_mean = r.norm_mean
    if r.baseline is not None:
        message.baseline_norm_mean = r.baseline.norm_mean
    return message


def to_proto(statuses: list[ReplicaStatus]) -> pb.ReplicaHealthList:
    return pb.ReplicaHealthList(replicas=[replica_to_proto(s) for s in statuses])
