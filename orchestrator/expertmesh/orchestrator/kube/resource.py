"""The ``ExpertMigration`` custom resource as typed Python, and its JSON forms.

The OpenAPI schema in ``helm/expertmesh/crds/`` is the API server's half of the
same contract (types, ``layer``/``expert`` >= 0, the ``mode`` enum); parsing here
still checks what it reads, because an object can reach the controller from a
cluster whose CRD is older or was edited by hand, and one bad object must not
stop the others.

Status follows the Kubernetes API conventions: ``conditions`` keyed by ``type``,
each with ``status`` "True"/"False"/"Unknown", a CamelCase ``reason``, a
``message`` for people, ``lastTransitionTime`` (RFC 3339) and the
``observedGeneration`` it was computed for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from expertmesh.orchestrator.migration.state import MigrationMode

GROUP = "expertmesh.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ExpertMigration"
PLURAL = "expertmigrations"
#: label saying who asked for the move (``Origin``), for ``kubectl get expertmigrations -l``
ORIGIN_LABEL = "expertmesh.io/origin"
#: annotation carried to the record's ``initiator`` (e.g. the drift trigger), free text
INITIATOR_ANNOTATION = "expertmesh.io/initiator"
#: annotation naming a record that was submitted already: the object then only reports on it
MIGRATION_ID_ANNOTATION = "expertmesh.io/migration-id"
#: label of the objects a controller made for what was done another way (a quarantine, a group added by the
#: CLI), so that ``kubectl get`` lists everything; deleting one undoes what it mirrors
MIRROR_LABEL = "expertmesh.io/mirror"


class Origin(StrEnum):
    MANUAL = "manual"
    DRIFT = "drift"


class ConditionType(StrEnum):
    #: the target holds the expert and its canary matched the source
    LOADED = "Loaded"
    #: the routing table was edited: the target listed (move, replicate) or the source dropped (evict)
    SWITCHED = "Switched"
    #: no router sends the source this expert any more
    DRAINED = "Drained"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


TERMINAL_CONDITIONS = (ConditionType.SUCCEEDED, ConditionType.FAILED)


def camel(word: str) -> str:
    """``rolled_back`` -> ``RolledBack``: executor enums as Kubernetes reasons and phases."""
    return "".join(part.capitalize() for part in word.split("_"))


def rfc3339(at: float) -> str:
    """Wall-clock seconds as a Kubernetes timestamp (whole seconds, UTC)."""
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where} must be an integer >= 0, got {value!r}")
    return value


def _optional_str(value: Any, where: str) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a group name, got {value!r}")
    return value


@dataclass(frozen=True)
class MigrationSpec:
    """What is asked: ``spec.from`` / ``spec.to`` are ``source`` / ``target`` here."""

    layer: int
    expert: int
    mode: MigrationMode = MigrationMode.MOVE
    #: None: the pair's only replica (or its first, for a replicate)
    source: str | None = None
    #: None only for an evict
    target: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layer": self.layer, "expert": self.expert, "mode": self.mode.value}
        if self.source:
            out["from"] = self.source
        if self.target:
            out["to"] = self.target
        return out

    @classmethod
    def from_dict(cls, spec: Any) -> MigrationSpec:
        """Raises ValueError naming the field when ``spec`` is not a valid spec."""
        if not isinstance(spec, dict):
            raise ValueError("spec is missing")
        try:
            mode = MigrationMode(spec.get("mode") or MigrationMode.MOVE)
        except ValueError:
            raise ValueError(
                f"spec.mode must be one of {[m.value for m in MigrationMode]}, got {spec.get('mode')!r}"
            ) from None
        return cls(
            layer=_int(spec.get("layer"), "spec.layer"),
            expert=_int(spec.get("expert"), "spec.expert"),
            mode=mode,
            source=_optional_str(spec.get("from"), "spec.from"),
            target=_optional_str(spec.get("to"), "spec.to"),
        )


@dataclass(frozen=True)
class Condition:
    type: ConditionType
    #: "True", "False" or "Unknown" (strings, as the API conventions have them)
    status: str
    reason: str
    message: str
    last_transition_time: str
    observed_generation: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.type.value,
            "status": self.status,
            "reason": self.reason,
            "message": self.message,
            "lastTransitionTime": self.last_transition_time,
            "observedGeneration": self.observed_generation,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Condition:
        return cls(
            type=ConditionType(data["type"]),
            status=str(data.get("status", "Unknown")),
            reason=str(data.get("reason", "")),
            message=str(data.get("message", "")),
            last_transition_time=str(data.get("lastTransitionTime", "")),
            observed_generation=int(data.get("observedGeneration", 0)),
        )


@dataclass(frozen=True)
class MigrationStatus:
    """What the orchestrator reports; empty (``MigrationStatus()``) before it has seen the object."""

    #: the executor record's id (see ``migration_id_for``)
    migration_id: str = ""
    #: the record's phase in CamelCase (``Loading`` … ``Succeeded``, ``Failed``, ``RolledBack``)
    phase: str = ""
    #: the replica moved or evicted, as the executor resolved it; the group that gets the expert
    source: str = ""
    target: str = ""
    routing_table_version: int = 0
    bytes_loaded: int = 0
    started_at: str = ""
    completed_at: str = ""
    observed_generation: int = 0
    conditions: tuple[Condition, ...] = ()

    def condition(self, kind: ConditionType) -> Condition | None:
        return next((c for c in self.conditions if c.type is kind), None)

    @property
    def finished(self) -> bool:
        """Succeeded or Failed: nothing more will happen to this object."""
        return any((c := self.condition(kind)) is not None and c.status == "True" for kind in TERMINAL_CONDITIONS)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "migrationId": self.migration_id,
            "phase": self.phase,
            "source": self.source,
            "target": self.target,
            "routingTableVersion": self.routing_table_version,
            "bytesLoaded": self.bytes_loaded,
            "startedAt": self.started_at,
            "completedAt": self.completed_at,
            "observedGeneration": self.observed_generation,
            "conditions": [c.to_dict() for c in self.conditions],
        }
        # Unset strings are left out: the schema types timestamps as date-time, which "" is not.
        return {k: v for k, v in out.items() if v != ""}

    @classmethod
    def from_dict(cls, data: Any) -> MigrationStatus:
        if not isinstance(data, dict):
            return cls()
        return cls(
            migration_id=str(data.get("migrationId", "")),
            phase=str(data.get("phase", "")),
            source=str(data.get("source", "")),
            target=str(data.get("target", "")),
            routing_table_version=int(data.get("routingTableVersion", 0)),
            bytes_loaded=int(data.get("bytesLoaded", 0)),
            started_at=str(data.get("startedAt", "")),
            completed_at=str(data.get("completedAt", "")),
            observed_generation=int(data.get("observedGeneration", 0)),
            conditions=tuple(
                Condition.from_dict(c)
                for c in data.get("conditions") or ()
                if isinstance(c, dict) and c.get("type") in ConditionType.__members__.values()
            ),
        )


@dataclass(frozen=True)
class ExpertMigration:
    """One object as read from the API server."""

    namespace: str
    name: str
    uid: str
    generation: int
    resource_version: str
    #: None when the stored spec does not parse; ``spec_problem`` then says why
    spec: MigrationSpec | None
    spec_problem: str = ""
    status: MigrationStatus = field(default_factory=MigrationStatus)
    labels: dict[str, str] = field(default_factory=dict)
    #: the ``expertmesh.io/initiator`` and ``expertmesh.io/migration-id`` annotations, "" when absent
    initiator: str = ""
    submitted_as: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> ExpertMigration:
        meta = doc.get("metadata") or {}
        try:
            spec, problem = MigrationSpec.from_dict(doc.get("spec")), ""
        except ValueError as err:
            spec, problem = None, str(err)
        return cls(
            namespace=str(meta.get("namespace", "")),
            name=str(meta.get("name", "")),
            uid=str(meta.get("uid", "")),
            generation=int(meta.get("generation", 0) or 0),
            resource_version=str(meta.get("resourceVersion", "")),
            spec=spec,
            spec_problem=problem,
            status=MigrationStatus.from_dict(doc.get("status")),
            labels=dict(meta.get("labels") or {}),
            initiator=str((meta.get("annotations") or {}).get(INITIATOR_ANNOTATION, "")),
            submitted_as=str((meta.get("annotations") or {}).get(MIGRATION_ID_ANNOTATION, "")),
        )


def manifest(
    spec: MigrationSpec, *, origin: Origin, name: str | None = None, initiator: str = "", migration_id: str = ""
) -> dict[str, Any]:
    """A new object: ``name``, or one the API server generates (``l<layer>-e<expert>-xxxxx``)."""
    metadata: dict[str, Any] = {"labels": {ORIGIN_LABEL: origin.value}}
    annotations = {INITIATOR_ANNOTATION: initiator, MIGRATION_ID_ANNOTATION: migration_id}
    if any(annotations.values()):
        metadata["annotations"] = {k: v for k, v in annotations.items() if v}
    if name:
        metadata["name"] = name
    else:
        metadata["generateName"] = f"l{spec.layer}-e{spec.expert}-"
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": spec.to_dict()}
