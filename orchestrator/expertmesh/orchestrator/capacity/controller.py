"""The capacity controller's I/O shell: one scan (``update``) observes the cluster as drift does (``drift.observe``),
asks the policy (``policy.decide``) and carries out its decisions: a replicate or a retire is a migration handed
to the runner (make-before-break, as every move), a group advice goes to the orchestrator's groups when
``act_on_groups`` is set and they can start groups, and every decision is a log line with its reason, an event on
the ``expertmesh.capacity.scan`` span and a count (``expertmesh.capacity.decisions`` {action, result})."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Callable

from expertmesh.contracts.errors import ExpertMeshError
from expertmesh.infra.telemetry.setup import meter, tracer
from expertmesh.orchestrator.capacity.config import CapacityConfig
from expertmesh.orchestrator.capacity.policy import Action, CapacityDecision, CapacityScan, CapacityState, decide
from expertmesh.orchestrator.drift.observe import Observer
from expertmesh.orchestrator.migration.state import MigrationMode
from expertmesh.store import StateStore

__all__ = ["CapacityController", "CapacityRecord", "Result"]

log = logging.getLogger(__name__)


class Result(StrEnum):
    SUBMITTED = "submitted"  # a migration started, or a group change requested
    ADVISED = "advised"  # a group advice logged only (act_on_groups off, or no way to start groups)
    REFUSED = "refused"  # the runner or the groups refused it (the error says why)
    DRY_RUN = "dry_run"


@dataclass(frozen=True)
class CapacityRecord:
    decision: CapacityDecision
    result: Result
    #: the migration id or group name it started
    started: str = ""
    error: str = ""


class CapacityController:
    """``submit(layer, expert, target, source, mode, initiator=...)``: the migration runner's; ``add_group()`` and
    ``remove_group(name)``: the orchestrator's group changes (None: group advice is logged only)."""

    def __init__(
        self,
        store: StateStore,
        submit: Callable,
        config: CapacityConfig,
        *,
        add_group: Callable[[], str] | None = None,
        remove_group: Callable[[str], str] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.config = config
        self._submit = submit
        self._add_group, self._remove_group = add_group, remove_group
        self._observer = Observer(store, clock)
        self._state = CapacityState()
        self._lock = threading.Lock()
        self._decisions = meter().create_counter(
            "expertmesh.capacity.decisions", description="capacity controller decisions, by action and result"
        )

    def update(self, dry_run: bool = False) -> tuple[CapacityScan, tuple[CapacityRecord, ...]]:
        """One scan. Observation failures (no routing table, the store unreachable) raise."""
        with self._lock, tracer().start_as_current_span("expertmesh.capacity.scan") as span:
            scan, state = decide(self._observer.observe(), self._state, self.config)
            if not dry_run:
                self._state = state
            records = tuple(self._carry_out(d, dry_run) for d in scan.decisions)
            for record in records:
                fields = {"action": record.decision.action.value, "result": record.result.value}
                log.info(
                    "capacity %s (%s): %s%s",
                    record.result.value,
                    record.decision.action.value,
                    record.decision.detail,
                    f" [{record.error}]" if record.error else "",
                    extra={"capacity": {**fields, "detail": record.decision.detail, "started": record.started}},
                )
                attributes = {f"expertmesh.capacity.{k}": v for k, v in fields.items()}
                span.add_event("expertmesh.capacity.decision", attributes)
                self._decisions.add(1, fields)
        return scan, records

    def _carry_out(self, d: CapacityDecision, dry_run: bool) -> CapacityRecord:
        if dry_run:
            return CapacityRecord(d, Result.DRY_RUN)
        try:
            if d.action in (Action.REPLICATE, Action.RETIRE):
                replicate = d.action is Action.REPLICATE
                target, source = (d.group, None) if replicate else (None, d.group)
                mode = MigrationMode.REPLICATE if replicate else MigrationMode.EVICT
                m = self._submit(d.layer, d.expert, target, source, mode, initiator=f"capacity:{d.action.value}")
                return CapacityRecord(d, Result.SUBMITTED, started=m.id)
            act = self._add_group if d.action is Action.ADD_GROUP else self._remove_group
            if not self.config.act_on_groups or act is None:
                return CapacityRecord(d, Result.ADVISED)
            started = act() if d.action is Action.ADD_GROUP else act(d.group)
            return CapacityRecord(d, Result.SUBMITTED, started=started)
        except ExpertMeshError as err:
            return CapacityRecord(d, Result.REFUSED, error=str(err))

    def close(self) -> None:
        self._observer.close()
