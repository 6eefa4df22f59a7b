"""The ``ExpertGroup`` custom resource as typed Python, and what its controller does given the objects and the
group records (``plan``). Pure: no I/O.

An object named ``N`` is expert group ``N``: the object's name is the group's name. Two kinds of object:

requested
    Someone created it (``kubectl apply``): the controller adds the group (``GroupController.add``) with the
    spec's GPUs, island and node, and deleting the object removes it (drained by live moves, then stopped).
    An object named after a group that runs already (added by the CLI before) adopts it.
mirror
    The controller created it (label ``expertmesh.io/mirror: "true"``) for a group added another way
    (``expertmesh groups add``, the admin API, the capacity controller), so that ``kubectl get expertgroups``
    lists every group added live; deleting it removes the group like a requested one. Its spec is empty: a
    group's record does not keep what it was asked with.

The chart's own groups (``expertGroups.groups``) are never mirrored, and an object named after one is
``Refused``: ``helm upgrade`` owns them (it renders their applications again from the values, bringing back one
removed live), so an object standing for one would say it is gone while the next upgrade brings it back. They are
removed live with ``expertmesh groups remove`` (the admin API), which the launcher takes like any group's removal,
and for good by lowering ``expertGroups.groups``.

Status: ``phase`` is the group's lifecycle (``Starting``, ``Filling``, ``Serving``, ``Draining``, ``Stopped``,
``Failed``: ``elastic.state.GroupPhase``) with ``endpoint``, ``moves`` (done/planned) and the record's line in
``message``; before the group exists, ``Pending`` (the add was refused for now, e.g. another change is in
flight or the island is full: retried every pass, ``reason`` names the error) or ``Refused`` (the object can
never be acted on: a name that is no group name, a spec out of bounds, a chart group; delete it). A group
removed another way (``expertmesh groups remove``) takes its object with it once ``Stopped``: re-adding a group
an operator just removed would undo them.

Example: ``plan([g5 requested, gpus 1], [g0, g1 serving], gone=[], fixed={"g0", "g1"})`` ->
``[Add("g5", GroupSpec(gpus=1))]``.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from expertmesh.orchestrator.elastic.state import NAME, GroupPhase, GroupRecord
from expertmesh.orchestrator.kube.resource import API_VERSION, MIRROR_LABEL, camel

__all__ = ["ExpertGroup", "GroupSpec", "GroupObjectStatus", "ObjectPhase", "manifest", "plan", "status_of"]

KIND = "ExpertGroup"
PLURAL = "expertgroups"
#: GPUs one group may ask for: an NVL72 rack, the largest NVLink island built
MAX_GPUS = 72
#: an island's name as the chart's ``expertGroups.islands[].name`` takes it (a Ray resource's suffix)
ISLAND = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_ISLAND = 40
#: a node's name is a DNS subdomain
MAX_NODE = 253

#: the object's phase: the group's lifecycle, and the two states before there is a group
ObjectPhase = StrEnum(
    "ObjectPhase", {"PENDING": "Pending", **{p.name: camel(p.value) for p in GroupPhase}, "REFUSED": "Refused"}
)
#: phases written before the controller acted on the object (an add refused for now, or never)
_NOT_ACTED = ("", ObjectPhase.PENDING, ObjectPhase.REFUSED)
#: phases an Event about reads as a warning
WARNING_PHASES = (ObjectPhase.PENDING, ObjectPhase.REFUSED, ObjectPhase.FAILED)


@dataclass(frozen=True)
class GroupSpec:
    """What is asked: ``GroupRequest``'s placement. 0 GPUs / "" island / "" node: as the chart's groups run."""

    gpus: int = 0
    island: str = ""
    node: str = ""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"gpus": self.gpus} if self.gpus else {}
        return d | {k: v for k, v in (("island", self.island), ("node", self.node)) if v}

    @classmethod
    def from_dict(cls, spec: Any) -> GroupSpec:
        """Raises ValueError naming the field when ``spec`` is out of the CRD's bounds (an older CRD, or one
        edited by hand, may have let it through)."""
        if spec is None:
            return cls()
        if not isinstance(spec, dict):
            raise ValueError(f"spec must be an object with gpus, island and node, got {spec!r}")
        gpus = spec.get("gpus", 0)
        if isinstance(gpus, bool) or not isinstance(gpus, int) or not 0 <= gpus <= MAX_GPUS:
            raise ValueError(f"spec.gpus must be an integer from 0 to {MAX_GPUS}, got {gpus!r}")
        island = spec.get("island") or ""
        if not isinstance(island, str) or len(island) > MAX_ISLAND or (island and not ISLAND.match(island)):
            raise ValueError(
                f"spec.island must be an island of expertGroups.islands (up to {MAX_ISLAND} lower-case letters, "
                f"digits and '-'), got {island!r}"
            )
        node = spec.get("node") or ""
        if not isinstance(node, str) or len(node) > MAX_NODE:
            raise ValueError(f"spec.node must be a node name of up to {MAX_NODE} characters, got {node!r}")
        return cls(gpus, island, node)


@dataclass(frozen=True)
class GroupObjectStatus:
    #: an ObjectPhase value; "" before the controller first wrote it
    phase: str = ""
    #: CamelCase, why the phase is Pending, Refused or Failed ("" otherwise)
    reason: str = ""
    #: one line a person can act on (for a group: its record's line)
    message: str = ""
    #: host:port of the group's gRPC server once it registered
    endpoint: str = ""
    #: live moves of the group's last change, done/planned (e.g. ``8/8``)
    moves: str = ""
    observed_generation: int = 0

    @property
    def acted(self) -> bool:
        """The controller added (or adopted) the group: the status follows its record."""
        return self.phase not in _NOT_ACTED

    def to_dict(self) -> dict[str, Any]:
        d = {"phase": self.phase, "reason": self.reason, "message": self.message}
        d |= {"endpoint": self.endpoint, "moves": self.moves}
        return {k: v for k, v in d.items() if v} | {"observedGeneration": self.observed_generation}

    @classmethod
    def from_dict(cls, data: Any) -> GroupObjectStatus:
        if not isinstance(data, dict):
            return cls()
        return cls(
            *(str(data.get(k, "")) for k in ("phase", "reason", "message", "endpoint", "moves")),
            observed_generation=int(data.get("observedGeneration", 0)),
        )


@dataclass(frozen=True)
class ExpertGroup:
    """One object as read from the API server."""

    name: str
    namespace: str
    uid: str
    resource_version: str
    generation: int
    #: ``metadata.creationTimestamp`` (RFC 3339 sorts as text): older objects are added first
    created: str
    #: None when the object's spec does not parse (``spec_problem`` says why)
    spec: GroupSpec | None
    status: GroupObjectStatus = field(default_factory=GroupObjectStatus)
    mirror: bool = False
    spec_problem: str = ""

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> ExpertGroup:
        meta = doc.get("metadata") or {}
        try:
            spec, problem = GroupSpec.from_dict(doc.get("spec")), ""
        except ValueError as err:
            spec, problem = None, str(err)
        return cls(
            name=str(meta.get("name", "")),
            namespace=str(meta.get("namespace", "")),
            uid=str(meta.get("uid", "")),
            resource_version=str(meta.get("resourceVersion", "")),
            generation=int(meta.get("generation", 0) or 0),
            created=str(meta.get("creationTimestamp", "")),
            spec=spec,
            status=GroupObjectStatus.from_dict(doc.get("status")),
            mirror=(meta.get("labels") or {}).get(MIRROR_LABEL) == "true",
            spec_problem=problem,
        )


def manifest(name: str, spec: GroupSpec, *, mirror: bool = False) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if mirror:
        metadata["labels"] = {MIRROR_LABEL: "true"}
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": spec.to_dict()}


# -- what to do ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Add:
    """``GroupController.add`` group ``name`` with ``spec``; an error leaves the object Pending (retried)."""

    name: str
    spec: GroupSpec


@dataclass(frozen=True)
class Remove:
    """``GroupController.remove`` group ``name``: its object was deleted. An error is retried next pass."""

    name: str


@dataclass(frozen=True)
class Mirror:
    """Create a mirror object for group ``name``, added another way."""

    name: str


@dataclass(frozen=True)
class Refuse:
    """Object ``name`` can never be acted on: status Refused with the reason, a Warning Event."""

    name: str
    reason: str
    message: str


@dataclass(frozen=True)
class Delete:
    """Delete object ``name`` after its last status and Event: its group was removed another way."""

    name: str


Action = Add | Remove | Mirror | Refuse | Delete


def _problem(obj: ExpertGroup, fixed: Collection[str]) -> Refuse | None:
    if obj.spec is None:
        return Refuse(obj.name, "InvalidSpec", obj.spec_problem)
    if not NAME.match(obj.name):
        return Refuse(
            obj.name,
            "InvalidName",
            f"{obj.name!r} is no expert group name (the object's name is the group's): use 1-40 lower-case "
            "letters, digits and '-', starting and ending with a letter or digit; delete this object and create "
            "another",
        )
    if obj.name in fixed and not obj.status.acted:
        return Refuse(
            obj.name,
            "ChartGroup",
            f"group {obj.name} is one of the chart's groups (expertGroups.groups): remove it live with `expertmesh "
            f"groups remove {obj.name}`, for good by taking it out of expertGroups.groups (helm upgrade); an "
            "ExpertGroup adds a group beside them under another name",
        )
    return None


def plan(
    objects: Iterable[ExpertGroup],
    records: Iterable[GroupRecord],
    gone: Iterable[ExpertGroup],
    fixed: Collection[str],
) -> list[Action]:
    """One pass's actions, removals first (they free what a pending add may wait for), then the objects oldest
    first (the first add that passes is the pass's one change), then mirrors.

    ``objects``: as listed now. ``records``: ``GroupController.records()``. ``gone``: objects listed before and
    absent now (deleted), with those whose removal was refused last pass. ``fixed``: the chart's groups
    (``KubeRayGroups.fixed_groups``), which no object stands for."""
    objects = sorted(objects, key=lambda o: (o.created, o.name))
    by_name = {r.name: r for r in records}
    live = {n: r for n, r in by_name.items() if r.phase is not GroupPhase.STOPPED}
    actions: list[Action] = []
    named = {o.name for o in objects}
    # an object refused (or never parsed) stood for no group: its deletion removes nothing
    removing = {
        o.name for o in gone if o.name not in named and o.spec is not None and o.status.phase != ObjectPhase.REFUSED
    }
    for name in sorted(removing):
        record = live.get(name)
        if record is not None and record.phase is not GroupPhase.DRAINING and name not in fixed:
            actions.append(Remove(name))
    for obj in objects:
        if obj.status.phase == ObjectPhase.REFUSED:
            continue  # the spec is immutable: refused for good, until deleted
        record = live.get(obj.name)
        if (refusal := _problem(obj, fixed)) is not None:
            actions.append(refusal)
        elif record is None and (obj.status.acted or obj.mirror):
            actions.append(Delete(obj.name))  # removed another way (or before its mirror was first reported)
        elif record is None:
            actions.append(Add(obj.name, obj.spec))
    for name, record in sorted(live.items()):
        if name not in named and name not in removing and name not in fixed and record.phase is not GroupPhase.DRAINING:
            actions.append(Mirror(name))
    return actions


# -- status ------------------------------------------------------------------------------------------------------


def status_of(obj: ExpertGroup, record: GroupRecord | None) -> GroupObjectStatus:
    """The status of an object from its group's record; as it was when refused (for good), or without a record
    (nothing acted on yet)."""
    if obj.status.phase == ObjectPhase.REFUSED:
        return obj.status  # a chart group's name: its record is not this object's
    if record is None or (record.phase is GroupPhase.STOPPED and not obj.status.acted):
        return obj.status
    failed = record.phase is GroupPhase.FAILED
    return GroupObjectStatus(
        phase=camel(record.phase.value),
        reason="ChangeFailed" if failed else "",
        message=record.reason,
        endpoint=record.address,
        moves=f"{record.moves_done}/{record.moves_planned}",
        observed_generation=obj.generation,
    )


def pending(obj: ExpertGroup, reason: str, message: str) -> GroupObjectStatus:
    return GroupObjectStatus(ObjectPhase.PENDING, reason, message, observed_generation=obj.generation)


def refused(obj: ExpertGroup, reason: str, message: str) -> GroupObjectStatus:
    return GroupObjectStatus(ObjectPhase.REFUSED, reason, message, observed_generation=obj.generation)
