"""The ``ExpertQuarantine`` custom resource as typed Python, and its status as a pure
function of the health monitor's replica records.

An object covers the replicas of (``spec.layer``, ``spec.expert``) on
``spec.group`` (every group, without one). Two kinds of object:

requested
    Someone created it (``kubectl create``): the controller quarantines the
    replicas it covers once (initiator ``kubernetes``), and deleting it releases
    them (``quarantine_controller``).
mirror
    The controller created it (label ``expertmesh.io/mirror: "true"``) for one
    replica that was taken out of service another way (the health monitor, or
    ``expertmesh quarantine``), so that every quarantine shows in Kubernetes; the
    controller deletes it when the replica is back in service, and deleting it
    by hand releases the replica like a requested one.

The status is the worst state among the covered replicas (quarantined, then
probation, suspect, healthy), that replica's reason, initiator and time, and one
entry per replica; empty until the controller acted, ``Refused`` (with the
reason) when the quarantine could not be made.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from expertmesh.orchestrator.health.monitor import ReplicaStatus
from expertmesh.orchestrator.health.state import HealthState
from expertmesh.orchestrator.kube.resource import API_VERSION, MIRROR_LABEL, _int, _optional_str, camel, rfc3339

KIND = "ExpertQuarantine"
PLURAL = "expertquarantines"


class State(StrEnum):
    QUARANTINED = "Quarantined"
    PROBATION = "Probation"
    SUSPECT = "Suspect"
    HEALTHY = "Healthy"
    REFUSED = "Refused"


#: worst first: an object shows the worst state among its replicas
_SEVERITY = (HealthState.QUARANTINED, HealthState.PROBATION, HealthState.SUSPECT, HealthState.HEALTHY)


@dataclass(frozen=True)
class QuarantineSpec:
    layer: int
    expert: int
    #: None: every replica of the expert
    group: str | None = None
    reason: str = ""

    def covers(self, layer: int, expert: int, group: str) -> bool:
        return (layer, expert) == (self.layer, self.expert) and self.group in (None, group)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"layer": self.layer, "expert": self.expert}
        if self.group is not None:
            d["group"] = self.group
        if self.reason:
            d["reason"] = self.reason
        return d

    @classmethod
    def from_dict(cls, spec: Any) -> QuarantineSpec:
        if not isinstance(spec, dict):
            raise ValueError("spec must be an object with layer and expert")
        reason = spec.get("reason") or ""
        if not isinstance(reason, str):
            raise ValueError(f"spec.reason must be text, got {reason!r}")
        return cls(
            _int(spec.get("layer"), "spec.layer"),
            _int(spec.get("expert"), "spec.expert"),
            _optional_str(spec.get("group"), "spec.group"),
            reason,
        )


@dataclass(frozen=True)
class ReplicaEntry:
    group: str
    state: str
    reason: str
    since: str
    listed: bool
    repairs: int


@dataclass(frozen=True)
class QuarantineStatus:
    #: "" before the controller first wrote it
    state: str = ""
    reason: str = ""
    quarantined_by: str = ""
    since: str = ""
    observed_generation: int = 0
    replicas: tuple[ReplicaEntry, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"state": self.state, "reason": self.reason, "observedGeneration": self.observed_generation}
        if self.quarantined_by:
            d["quarantinedBy"] = self.quarantined_by
        if self.since:
            d["since"] = self.since
        d["replicas"] = [
            {"group": r.group, "state": r.state, "reason": r.reason, "listed": r.listed, "repairs": r.repairs}
            | ({"since": r.since} if r.since else {})
            for r in self.replicas
        ]
        return d

    @classmethod
    def from_dict(cls, data: Any) -> QuarantineStatus:
        if not isinstance(data, dict):
            return cls()
        replicas = tuple(
            ReplicaEntry(
                r.get("group", ""),
                r.get("state", ""),
                r.get("reason", ""),
                r.get("since", ""),
                bool(r.get("listed")),
                int(r.get("repairs", 0)),
            )
            for r in data.get("replicas") or ()
            if isinstance(r, dict)
        )
        return cls(
            str(data.get("state", "")),
            str(data.get("reason", "")),
            str(data.get("quarantinedBy", "")),
            str(data.get("since", "")),
            int(data.get("observedGeneration", 0)),
            replicas,
        )


@dataclass(frozen=True)
class ExpertQuarantine:
    name: str
    namespace: str
    uid: str
    resource_version: str
    generation: int
    #: None when the object's spec does not parse (``spec_problem`` says why)
    spec: QuarantineSpec | None
    status: QuarantineStatus = field(default_factory=QuarantineStatus)
    mirror: bool = False
    spec_problem: str = ""

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> ExpertQuarantine:
        meta = doc.get("metadata") or {}
        try:
            spec, problem = QuarantineSpec.from_dict(doc.get("spec")), ""
        except ValueError as err:
            spec, problem = None, str(err)
        return cls(
            name=meta.get("name", ""),
            namespace=meta.get("namespace", ""),
            uid=meta.get("uid", ""),
            resource_version=str(meta.get("resourceVersion", "")),
            generation=int(meta.get("generation", 0)),
            spec=spec,
            status=QuarantineStatus.from_dict(doc.get("status")),
            mirror=(meta.get("labels") or {}).get(MIRROR_LABEL) == "true",
            spec_problem=problem,
        )


def mirror_name(layer: int, expert: int, group: str) -> str:
    """A DNS-1123 name for the mirror of one replica, e.g. ``l1-e3-g0``."""
    tail = re.sub(r"[^a-z0-9-]+", "-", group.lower()).strip("-") or "group"
    return f"l{layer}-e{expert}-{tail}"[:253].rstrip("-")


def manifest(spec: QuarantineSpec, name: str, *, mirror: bool = False) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if mirror:
        metadata["labels"] = {MIRROR_LABEL: "true"}
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": spec.to_dict()}


def covered(spec: QuarantineSpec, replicas: Iterable[ReplicaStatus]) -> list[ReplicaStatus]:
    return [s for s in replicas if spec.covers(s.record.replica.layer, s.record.replica.expert, s.record.replica.group)]


def status_of(spec: QuarantineSpec, replicas: Iterable[ReplicaStatus], generation: int) -> QuarantineStatus:
    """The status of an object the controller acted on: its covered replicas' health."""
    mine = sorted(covered(spec, replicas), key=lambda s: (_SEVERITY.index(s.record.state), s.record.replica.group))
    if not mine:
        return QuarantineStatus(
            State.HEALTHY, "no replica of the expert is held any more", observed_generation=generation
        )
    worst = mine[0].record
    return QuarantineStatus(
        state=camel(worst.state.value),
        reason=worst.reason,
        quarantined_by=worst.quarantined_by.value if worst.quarantined_by else "",
        since=rfc3339(worst.since) if worst.since else "",
        observed_generation=generation,
        replicas=tuple(
            ReplicaEntry(
                s.record.replica.group,
                camel(s.record.state.value),
                s.record.reason,
                rfc3339(s.record.since) if s.record.since else "",
                s.listed,
                s.record.repairs,
            )
            for s in sorted(mine, key=lambda s: s.record.replica.group)
        ),
    )


def refused(reason: str, generation: int) -> QuarantineStatus:
    return QuarantineStatus(State.REFUSED, reason, observed_generation=generation)


def out_of_service(status: ReplicaStatus) -> bool:
    return status.record.state.out_of_service
