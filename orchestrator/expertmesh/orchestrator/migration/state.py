"""The migration record: what one migration is asked to do, how far it got, and
why it ended, persisted in the state store after every phase so that another
orchestrator process can pick it up (see the package docstring for the protocol).

The store keeps each record as opaque JSON bytes in its ``migrations`` hash: the
data plane's store module does not import the orchestrator, so (de)serialising
is done here (``save`` / ``load`` / ``load_all``).
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, replace
from enum import StrEnum

from expertmesh.contracts.errors import MigrationNotFound
from expertmesh.store import StateStore

#: ``Migration.initiator`` of a migration a person asked for (``expertmesh migrate``, the admin API)
OPERATOR = "operator"


class MigrationMode(StrEnum):
    #: the target gets the expert, the source gives it up
    MOVE = "move"
    #: the target gets another replica of the expert; the source keeps its own
    REPLICATE = "replicate"
    #: the source gives up one of several replicas; there is no target
    EVICT = "evict"


class Phase(StrEnum):
    """Where a migration is: the work it does next (or did last, when terminal)."""

    PENDING = "pending"
    LOADING = "loading"
    CHECKING = "checking"
    SWITCHING = "switching"
    CONFIRMING = "confirming"
    RETIRING = "retiring"
    DRAINING = "draining"
    UNLOADING = "unloading"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    ROLLED_BACK = "rolled_back"

    @property
    def terminal(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.FAILED, Phase.ROLLED_BACK)


class Failure(StrEnum):
    """Why a migration did not succeed, in few enough words for a metric attribute."""

    OVER_BUDGET = "over_budget"
    CANARY_MISMATCH = "canary_mismatch"
    DRAIN_TIMEOUT = "drain_timeout"
    #: a group did not answer, or refused a call; the reason carries its gRPC status
    GROUP_FAILED = "group_failed"
    #: the table changed under the migration so that its edit no longer applies, or kept changing
    TABLE_CHANGED = "table_changed"


@dataclass(frozen=True)
class PhaseChange:
    phase: Phase
    #: wall-clock seconds when the phase began
    at: float
    #: the routing-table version the migration stood on then
    table_version: int


@dataclass(frozen=True)
class Migration:
    id: str
    layer: int
    expert: int
    mode: MigrationMode
    #: replica moved or evicted; for a replicate, the replica the canary compares with
    source: str
    #: group that gets the expert; None for an evict
    target: str | None
    phase: Phase
    #: the routing-table version this migration stands on: the version at submission, then each it publishes
    table_version: int
    #: the pair's replicas and explicit shares (empty = equal) at submission, for a rollback
    replicas_before: tuple[str, ...]
    shares_before: tuple[float, ...]
    #: the target held the expert before the move began, so a failure must not unload it
    target_preloaded: bool = False
    #: bytes of expert weights the target loaded for this migration
    bytes_loaded: int = 0
    started_at: float = 0.0
    completed_at: float | None = None
    failure: Failure | None = None
    #: one line a person can act on, for FAILED and ROLLED_BACK
    reason: str = ""
    history: tuple[PhaseChange, ...] = ()
    #: who asked for it: OPERATOR, "drift:<trigger>" (``orchestrator.drift``), or what another controller says
    initiator: str = OPERATOR

    @property
    def pair(self) -> tuple[int, int]:
        return (self.layer, self.expert)

    def entering(self, phase: Phase, at: float, **changes) -> Migration:
        """This record moved on to ``phase`` at ``at``, with ``changes`` to other fields."""
        updated = replace(self, phase=phase, **changes)
        done = {"completed_at": at} if phase.terminal else {}
        return replace(updated, history=(*self.history, PhaseChange(phase, at, updated.table_version)), **done)

    def describe(self) -> str:
        """One line for logs and CLIs."""
        move = f"{self.source} -> {self.target}" if self.target else f"off {self.source}"
        return f"migration {self.id} ({self.mode} layer {self.layer} expert {self.expert} {move})"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Migration:
        data = json.loads(text)
        return cls(
            **{
                **data,
                "mode": MigrationMode(data["mode"]),
                "phase": Phase(data["phase"]),
                "failure": Failure(data["failure"]) if data["failure"] else None,
                "replicas_before": tuple(data["replicas_before"]),
                "shares_before": tuple(data["shares_before"]),
                "history": tuple(PhaseChange(Phase(h["phase"]), h["at"], h["table_version"]) for h in data["history"]),
            }
        )


def save(store: StateStore, migration: Migration) -> None:
    store.save_migration(migration.id, migration.to_json().encode())


def load(store: StateStore, migration_id: str) -> Migration:
    raw = store.migration(migration_id)
    if raw is None:
        raise MigrationNotFound(f"no migration {migration_id!r} in the state store")
    return Migration.from_json(raw)


def load_all(store: StateStore) -> list[Migration]:
    """Every stored migration, oldest first."""
    return sorted((_parsed(raw) for raw in store.migrations().values()), key=lambda m: (m.started_at, m.id))


@functools.lru_cache(maxsize=8192)
def _parsed(raw: bytes) -> Migration:
    """A record's bytes decoded once: every submit, scan and listing reads every record, and most of them are
    finished and never change (``Migration`` is frozen, so one object serves every reader)."""
    return Migration.from_json(raw)
