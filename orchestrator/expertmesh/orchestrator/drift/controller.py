"""The drift controller: one scan (``update``) = observe, decide (``policy``), start
the moves decided through the ``MigrationRunner`` unless it is a dry run, and
record every decision; ``start`` runs a scan every ``scan_interval_s`` in a thread.

Scans run one at a time (the loop and ``ScanDrift`` calls share a lock). A dry run,
asked for (``update(dry_run=True)``) or configured (``dry_run``), starts nothing and
keeps the controller's state as it was, so it never brings a real move closer.
The loop survives a failed scan (the store unreachable, say): it logs it and scans
again at the next interval.

Recording, for each decision: a log line whose ``drift`` field holds the decision
(one JSON object with ``--log-format json``), an event on the
``expertmesh.drift.scan`` span, the counter ``expertmesh.drift.decisions`` by
``result`` (``Result``), ``reason`` (the trigger) and ``hold`` (a ``Hold``, or
``none``), and ``on_decision``, the hook where cluster mode posts a Kubernetes
Event. A move the runner refuses (another migration of the expert began since
the scan looked, say) is recorded as ``refused`` with the runner's message.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from expertmesh.contracts.errors import ExpertMeshError
from expertmesh.infra.telemetry.setup import meter, tracer
from expertmesh.orchestrator.drift.config import DriftConfig
from expertmesh.orchestrator.drift.observe import Observer
from expertmesh.orchestrator.drift.policy import decide
from expertmesh.orchestrator.drift.state import Decision, DriftState, Scan
from expertmesh.orchestrator.migration.state import MigrationMode
from expertmesh.store import StateStore

if TYPE_CHECKING:
    from expertmesh.orchestrator.admin import MigrationRunner

log = logging.getLogger(__name__)


class Result(StrEnum):
    #: a migration started
    SUBMITTED = "submitted"
    #: a dry run: it would have started
    DRY_RUN = "dry_run"
    #: the runner would not start it
    REFUSED = "refused"
    #: nothing moves (``Decision.hold`` says why)
    HELD = "held"


@dataclass(frozen=True)
class DriftRecord:
    decision: Decision
    result: Result
    #: the migration started (SUBMITTED)
    migration_id: str = ""
    #: why the runner refused (REFUSED)
    error: str = ""

    @property
    def detail(self) -> str:
        return self.decision.detail + (f"; refused: {self.error}" if self.error else "")

    def fields(self) -> dict[str, object]:
        """The record as flat fields, for log lines, span events and hooks."""
        d, move = self.decision, self.decision.move
        return {
            "trigger": d.trigger.value,
            "result": self.result.value,
            "hold": d.hold.value if d.hold else "none",
            "detail": self.detail,
            **(
                {"layer": move.layer, "expert": move.expert, "source": move.source, "target": move.target}
                if move
                else {}
            ),
            **({"migration_id": self.migration_id} if self.migration_id else {}),
        }


@dataclass(frozen=True)
class ScanReport:
    scan: Scan
    records: tuple[DriftRecord, ...]
    dry_run: bool


class DriftController:
    def __init__(
        self,
        store: StateStore,
        runner: MigrationRunner,
        config: DriftConfig,
        *,
        clock: Callable[[], float] = time.time,
        on_decision: Callable[[DriftRecord], None] | None = None,
    ):
        self.config = config
        self._runner = runner
        self._observer = Observer(store, clock)
        self._on_decision = on_decision
        self._state = DriftState()
        self._lock = threading.Lock()
        self._decisions = meter().create_counter(
            "expertmesh.drift.decisions", description="drift decisions, by result and reason"
        )

    def update(self, dry_run: bool = False) -> ScanReport:
        """One scan. Observation failures (no routing table, the store unreachable) raise."""
        dry_run = dry_run or self.config.dry_run
        with (
            self._lock,
            tracer().start_as_current_span(
                "expertmesh.drift.scan", attributes={"expertmesh.drift.dry_run": dry_run}
            ) as span,
        ):
            scan, state = decide(self._observer.observe(), self._state, self.config, self._runner.max_concurrent)
            if not dry_run:
                self._state = state
            records = tuple(self._carry_out(decision, dry_run) for decision in scan.decisions)
            span.set_attribute("expertmesh.drift.decisions", len(records))
            for record in records:
                self._record(record, span)
        return ScanReport(scan, records, dry_run)

    def _carry_out(self, decision: Decision, dry_run: bool) -> DriftRecord:
        move = decision.move
        if move is None:
            return DriftRecord(decision, Result.HELD)
        if dry_run:
            return DriftRecord(decision, Result.DRY_RUN)
        try:
            started = self._runner.submit(
                move.layer,
                move.expert,
                move.target,
                move.source,
                MigrationMode.MOVE,
                initiator=f"drift:{decision.trigger}",
            )
        except ExpertMeshError as err:
            return DriftRecord(decision, Result.REFUSED, error=str(err))
        return DriftRecord(decision, Result.SUBMITTED, migration_id=started.id)

    def _record(self, record: DriftRecord, span) -> None:
        fields = record.fields()
        log.info(
            "drift %s (%s): %s",
            record.result.value,
            record.decision.trigger.value,
            fields["detail"],
            extra={"drift": fields},
        )
        span.add_event("expertmesh.drift.decision", {f"expertmesh.drift.{k}": v for k, v in fields.items()})
        self._decisions.add(1, {"result": fields["result"], "reason": fields["trigger"], "hold": fields["hold"]})
        if self._on_decision is not None:
            try:
                self._on_decision(record)
            except Exception:  # a hook (a Kubernetes API hiccup) must not stop the scan
                log.warning("drift: the on_decision hook failed", exc_info=True)

    def close(self) -> None:
        """Close the group channels (the control loop that calls ``update`` stops first)."""
        self._observer.close()
