"""A migration record -> its object's status. Pure: no I/O, no clock.

Each condition is computed from the record's phase history alone, so writing the
same record twice gives the same status (a restarted controller changes nothing
it already wrote) and ``lastTransitionTime`` is when the executor got there, not
when the controller noticed.

Milestones, by mode (the phase whose work must be done):

====================  =========  =========  ========
condition             move       replicate  evict
====================  =========  =========  ========
Loaded                CHECKING   CHECKING   –
Switched              SWITCHING  SWITCHING  RETIRING
Drained               DRAINING   –          DRAINING
====================  =========  =========  ========

A milestone is True once the record entered the phase after it (the executor
moves on only when a phase's work succeeded; a failure jumps to FAILED or
ROLLED_BACK instead), Unknown while the record has not got there, and False with
the failure as reason when the migration ended first. ``Succeeded`` (True) or
``Failed`` (True, reason: the executor's ``Failure``) is added when it ends.
"""

from __future__ import annotations

from expertmesh.orchestrator.kube.resource import Condition, ConditionType, MigrationStatus, camel, rfc3339
from expertmesh.orchestrator.migration.plan import next_phase
from expertmesh.orchestrator.migration.state import Migration, MigrationMode, Phase

MILESTONES: dict[MigrationMode, tuple[tuple[ConditionType, Phase], ...]] = {
    MigrationMode.MOVE: (
        (ConditionType.LOADED, Phase.CHECKING),
        (ConditionType.SWITCHED, Phase.SWITCHING),
        (ConditionType.DRAINED, Phase.DRAINING),
    ),
    MigrationMode.REPLICATE: (
        (ConditionType.LOADED, Phase.CHECKING),
        (ConditionType.SWITCHED, Phase.SWITCHING),
    ),
    MigrationMode.EVICT: (
        (ConditionType.SWITCHED, Phase.RETIRING),
        (ConditionType.DRAINED, Phase.DRAINING),
    ),
}

#: the Failed condition's reason when the executor refused the spec before anything moved
REFUSED = "Refused"


def status_of(m: Migration, generation: int) -> MigrationStatus:
    """The status an object whose record is ``m`` should show, computed for ``generation``."""
    conditions = [_milestone(m, kind, phase, generation) for kind, phase in MILESTONES[m.mode]]
    if m.phase is Phase.SUCCEEDED:
        conditions.append(Condition(ConditionType.SUCCEEDED, "True", "Completed", m.describe(), _ended(m), generation))
    elif m.phase.terminal:
        reason = camel(m.failure.value) if m.failure else camel(m.phase.value)
        conditions.append(Condition(ConditionType.FAILED, "True", reason, m.reason, _ended(m), generation))
    return MigrationStatus(
        migration_id=m.id,
        phase=camel(m.phase.value),
        source=m.source,
        target=m.target or "",
        routing_table_version=m.table_version,
        bytes_loaded=m.bytes_loaded,
        started_at=rfc3339(m.started_at),
        completed_at=rfc3339(m.completed_at) if m.completed_at is not None else "",
        observed_generation=generation,
        conditions=tuple(conditions),
    )


def refused_status(reason: str, message: str, at: float, generation: int) -> MigrationStatus:
    """The status of an object that ended before any migration ran (nothing was moved)."""
    when = rfc3339(at)
    return MigrationStatus(
        phase=camel(Phase.FAILED.value),
        started_at=when,
        completed_at=when,
        observed_generation=generation,
        conditions=(Condition(ConditionType.FAILED, "True", reason, message, when, generation),),
    )


def _milestone(m: Migration, kind: ConditionType, phase: Phase, generation: int) -> Condition:
    after = next_phase(m.mode, phase)
    passed = next((h for h in m.history if h.phase is after), None)
    if passed is not None:
        return Condition(
            kind,
            "True",
            _DONE_REASONS[kind],
            _done_message(m, kind, passed.table_version),
            rfc3339(passed.at),
            generation,
        )
    if m.phase.terminal:
        reason = camel(m.failure.value) if m.failure else camel(m.phase.value)
        return Condition(
            kind, "False", reason, f"the migration ended {m.phase.value} before this step", _ended(m), generation
        )
    return Condition(kind, "Unknown", "Waiting", f"the migration is {m.phase.value}", rfc3339(m.started_at), generation)


_DONE_REASONS = {
    ConditionType.LOADED: "CanaryPassed",
    ConditionType.SWITCHED: "TablePublished",
    ConditionType.DRAINED: "SourceDrained",
}


def _done_message(m: Migration, kind: ConditionType, version: int) -> str:
    pair = f"layer {m.layer} expert {m.expert}"
    if kind is ConditionType.LOADED:
        return f"{m.target} holds {pair} ({m.bytes_loaded} bytes loaded) and its canary matches {m.source}"
    if kind is ConditionType.SWITCHED and m.mode is MigrationMode.EVICT:
        return f"routing table v{version} no longer lists {m.source} for {pair}"
    if kind is ConditionType.SWITCHED:
        return f"routing table v{version} lists {m.target} for {pair}"
    return f"every live router serves routing table v{version} or newer and {m.source} has no call in flight for {pair}"


def _ended(m: Migration) -> str:
    return rfc3339(m.completed_at if m.completed_at is not None else m.started_at)
