"""Drives migration records through their phases: the I/O around ``plan``.

``submit`` validates a request and stores a PENDING record; ``step`` does the
work of a record's current phase and persists the next one; ``run`` steps until
the record is terminal, inside one OpenTelemetry span; ``resume_all`` runs every
record a previous orchestrator left half done (each phase's work is safe to
repeat, see below). The protocol, the order of its table edits and what a
failure leaves behind are in the package docstring.

Repeating a phase after a crash: LoadExperts and UnloadExperts skip what is
already (not) held; the canary is re-run; a table edit already in the store is
not published again, and the migration then stands on the store's current
version, which is at least the one it published, so draining waits no less.

One process must drive a given record at a time: ``submit`` refuses a second
migration of the same pair, but nothing here stops two orchestrators from
stepping one record (electing the one that runs ``resume_all`` is the caller's).

Timing: ``clock`` (wall-clock seconds) stamps records and judges router
heartbeats, which carry wall-clock times; drain deadlines use the monotonic
clock. Metric ``expertmesh.migrations`` (counter) counts migrations that ended,
by ``result`` (the terminal phase), ``reason`` (a ``Failure``, or ``none``) and ``mode``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

import grpc
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from expertmesh.contracts.errors import MigrationRefused
from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.infra.telemetry.setup import meter, tracer
from expertmesh.orchestrator.migration import plan
from expertmesh.orchestrator.migration.group_calls import GroupCallFailed, GroupChannels
from expertmesh.orchestrator.migration.state import (
    OPERATOR,
    Failure,
    Migration,
    MigrationMode,
    Phase,
    PhaseChange,
    load,
    load_all,
    save,
)
from expertmesh.store import StateStore

log = logging.getLogger(__name__)


class _Failed(Exception):
    """The current phase cannot succeed; the migration ends (see ``_fail``)."""

    def __init__(self, failure: Failure, reason: str):
        super().__init__(reason)
        self.failure = failure


class MigrationExecutor:
    def __init__(
        self,
        store: StateStore,
        *,
        clock: Callable[[], float] = time.time,
        poll_s: float = 0.2,
        drain_timeout_s: float = 60.0,
        router_liveness_s: float = 15.0,
        publish_attempts: int = 5,
        groups: GroupChannels | None = None,
        model_fingerprint: str = "",
    ):
        self._store = store
        self._clock = clock
        self._poll_s = poll_s
        self._drain_timeout_s = drain_timeout_s
        self._liveness_s = router_liveness_s
        self._publish_attempts = publish_attempts
        # ``groups``: anything with GroupChannels' methods (the scale simulation's simulated groups). With the
        # checkpoint's ``model_fingerprint``, a group of another checkpoint is never a migration's target or source
        self._groups = groups if groups is not None else GroupChannels(store.endpoints, model_fingerprint)
        self._ended = meter().create_counter(
            "expertmesh.migrations", description="migrations ended, by result and reason"
        )
        self._work: dict[Phase, Callable[[Migration], Migration]] = {
            Phase.PENDING: self._pending,
            Phase.LOADING: self._loading,
            Phase.CHECKING: self._checking,
            Phase.SWITCHING: self._switching,
            Phase.CONFIRMING: self._confirming,
            Phase.RETIRING: self._retiring,
            Phase.DRAINING: self._draining,
            Phase.UNLOADING: self._unloading,
        }

    def close(self) -> None:
        self._groups.close()

    # -- requests --------------------------------------------------------------------------

    def submit(
        self,
        layer: int,
        expert: int,
        target: str | None = None,
        source: str | None = None,
        mode: MigrationMode | str = MigrationMode.MOVE,
        initiator: str = OPERATOR,
        migration_id: str | None = None,
    ) -> Migration:
        """Validate a migration against the stored routing table and endpoints and store it PENDING.

        Without ``source``: the pair's only replica (a move or an evict), or its first (a replicate).
        ``initiator`` says who asked, on the record. ``migration_id`` names the record (default: a
        random id); a caller that must find its record again after a crash (the Kubernetes
        controller) derives it from its own request.
        """
        pair = (layer, expert)
        table = self._store.routing_table()
        mode, source = plan.checked_request(
            layer,
            expert,
            target,
            source,
            mode,
            table,
            endpoints=self._store.endpoints(),
            quarantined=self._store.quarantined(),
            busy=[m for m in load_all(self._store) if m.pair == pair and not m.phase.terminal],
            id_taken=migration_id is not None and self._store.migration(migration_id) is not None,
            migration_id=migration_id,
        )
        replicas = table.replicas[pair]

        now = self._clock()
        migration = Migration(
            id=migration_id or uuid.uuid4().hex[:12],
            layer=layer,
            expert=expert,
            mode=mode,
            source=source,
            target=target,
            phase=Phase.PENDING,
            table_version=table.version,
            replicas_before=replicas,
            shares_before=table.shares.get(pair, ()),
            started_at=now,
            history=(PhaseChange(Phase.PENDING, now, table.version),),
            initiator=initiator,
        )
        save(self._store, migration)
        log.info("%s submitted at routing table v%d", migration.describe(), table.version)
        return migration

    def run(self, migration_id: str) -> Migration:
        """Step the migration until it ends; returns the final record."""
        migration = load(self._store, migration_id)
        attributes = {
            "expertmesh.migration.id": migration.id,
            "expertmesh.migration.mode": migration.mode.value,
            "expertmesh.layer": migration.layer,
            "expertmesh.expert": migration.expert,
            "expertmesh.migration.source": migration.source,
            "expertmesh.migration.target": migration.target or "",
        }
        with tracer().start_as_current_span("expertmesh.migration", attributes=attributes) as span:
            while not migration.phase.terminal:
                migration = self.step(migration.id)
            span.set_attribute("expertmesh.migration.result", migration.phase.value)
            if migration.phase is not Phase.SUCCEEDED:
                span.set_status(Status(StatusCode.ERROR, migration.reason))
        return migration

    def resume_all(self) -> list[Migration]:
        """Finish or roll back every migration the store holds half done (an orchestrator restarted)."""
        unfinished = [m for m in load_all(self._store) if not m.phase.terminal]
        for migration in unfinished:
            log.info("resuming %s at %s", migration.describe(), migration.phase)
        return [self.run(m.id) for m in unfinished]

    def step(self, migration_id: str) -> Migration:
        """Do the work of the migration's current phase; persist and return the record after it."""
        migration = load(self._store, migration_id)
        if migration.phase.terminal:
            return migration
        try:
            return self._work[migration.phase](migration)
        except _Failed as err:
            return self._fail(migration, err.failure, str(err))
        except GroupCallFailed as err:
            return self._fail(migration, Failure.GROUP_FAILED, str(err))
        except MigrationRefused as err:  # the table changed so that the edit no longer applies
            return self._fail(migration, Failure.TABLE_CHANGED, str(err))

    # -- the phases ------------------------------------------------------------------------

    def _advance(self, migration: Migration, phase: Phase, **changes) -> Migration:
        migration = migration.entering(phase, self._clock(), **changes)
        save(self._store, migration)
        trace.get_current_span().add_event(
            f"expertmesh.migration.{phase.value}", {"expertmesh.routing_table.version": migration.table_version}
        )
        if phase.terminal:
            reason = migration.failure.value if migration.failure else "none"
            self._ended.add(1, {"result": phase.value, "reason": reason, "mode": migration.mode.value})
            log.log(
                logging.INFO if phase is Phase.SUCCEEDED else logging.WARNING,
                "%s %s at routing table v%d%s",
                migration.describe(),
                phase.value,
                migration.table_version,
                f": {migration.reason}" if migration.reason else "",
            )
        else:
            log.info("%s: %s (routing table v%d)", migration.describe(), phase.value, migration.table_version)
        return migration

    def _next(self, migration: Migration, **changes) -> Migration:
        return self._advance(migration, plan.next_phase(migration.mode, migration.phase), **changes)

    def _pending(self, m: Migration) -> Migration:
        if m.target is None:
            return self._next(m)
        # Recorded before anything is loaded, so a failure never unloads what the target held already.
        return self._next(m, target_preloaded=self._groups.describe(m.target).holds(m.pair))

    def _loading(self, m: Migration) -> Migration:
        before = self._groups.describe(m.target)
        try:
            loaded = self._groups.load(m.target, m.pair)
        except GroupCallFailed as err:
            if err.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                budget = f" (holds {before.weight_bytes} of {before.budget_bytes} bytes)" if before.budget_bytes else ""
                raise _Failed(
                    Failure.OVER_BUDGET, f"group {m.target!r} is over its memory budget{budget}: {err.details}"
                )
            raise
        return self._next(m, bytes_loaded=loaded.weight_bytes - before.weight_bytes if loaded.added else 0)

    def _checking(self, m: Migration) -> Migration:
        source, target = self._groups.describe(m.source), self._groups.describe(m.target)
        if source.hidden_size != target.hidden_size:
            raise _Failed(
                Failure.CANARY_MISMATCH,
                f"groups {m.source!r} and {m.target!r} serve different models "
                f"(hidden size {source.hidden_size} vs {target.hidden_size})",
            )
        probe = plan.canary(target.hidden_size, target.dtype, m.expert)
        reference = self._groups.dispatch(m.source, m.layer, probe)  # [16, H]
        candidate = self._groups.dispatch(m.target, m.layer, probe)  # [16, H]
        tolerance = plan.canary_tolerance(source.dtype, target.dtype)
        difference = plan.canary_difference(reference, candidate, tolerance)
        if difference is not None:
            allowed = "bit-equal" if tolerance.exact else f"atol {tolerance.atol:g} rtol {tolerance.rtol:g}"
            raise _Failed(
                Failure.CANARY_MISMATCH,
                f"canary mismatch: {m.target!r} differs from {m.source!r} by max |Δ| {difference:.3g} "
                f"({allowed} required)",
            )
        return self._next(m)

    def _switching(self, m: Migration) -> Migration:
        version = self._publish(lambda table: plan.add_replica(table, m.pair, m.target))
        return self._next(m, table_version=version)

    def _confirming(self, m: Migration) -> Migration:
        self._drain(m, draining=None)
        return self._next(m)

    def _retiring(self, m: Migration) -> Migration:
        self._require_other_replica(m)
        version = self._publish(lambda table: plan.remove_replica(table, m.pair, m.source))
        return self._next(m, table_version=version)

    def _draining(self, m: Migration) -> Migration:
        self._drain(m, draining=m.source)
        return self._next(m)

    def _unloading(self, m: Migration) -> Migration:
        self._groups.unload(m.source, m.pair)
        return self._next(m)

    # -- helpers ------------------------------------------------------------------------------

    def _publish(self, edit: Callable[[RoutingTable], RoutingTable | None]) -> int:
        """Apply ``edit`` to the stored table and publish the result (compare-and-set), re-reading and
        re-applying on conflict; returns the version that holds the edit."""
        for _ in range(self._publish_attempts):
            current = self._store.routing_table()
            if current is None:
                raise MigrationRefused("the routing table is gone from the state store")
            table = edit(current)
            if table is None:
                return current.version  # already there: a repeated phase
            plan.check_all_hosted(current, table)
            if self._store.publish_routing_table(table):
                log.info("published routing table v%d", table.version)
                return table.version
            log.info("routing table v%d changed under us; re-applying the edit", current.version)
        raise _Failed(
            Failure.TABLE_CHANGED, f"the routing table kept changing; gave up after {self._publish_attempts} tries"
        )

    def _drain(self, m: Migration, draining: str | None) -> None:
        """Wait until ``m.table_version`` is acknowledged and, with ``draining``, drained from that group."""
        deadline = time.monotonic() + self._drain_timeout_s
        reported = ""
        while True:
            try:
                in_flight = self._groups.describe(draining).in_flight_for(m.pair) if draining else ()
            except GroupCallFailed as err:  # a hiccup must not end the move; a group that stays away does
                ready, why = False, f"cannot see the calls in flight on {draining!r} ({err})"
            else:
                heartbeats = self._store.router_heartbeats().values()
                ready, why = plan.drain_ready(heartbeats, self._clock(), m.table_version, in_flight, self._liveness_s)
            if ready:
                return
            if time.monotonic() >= deadline:
                raise _Failed(Failure.DRAIN_TIMEOUT, f"{why} after {self._drain_timeout_s:g} s")
            if why != reported:
                log.info("%s: waiting: %s", m.describe(), why)
                reported = why
            time.sleep(self._poll_s)

    def _require_other_replica(self, m: Migration) -> None:
        """Before the break: some replica other than the source answers and holds the expert."""
        table = self._store.routing_table()
        others = [g for g in (table.replicas.get(m.pair, ()) if table else ()) if g != m.source]
        if not any(self._holds(g, m.pair) for g in others):
            raise _Failed(
                Failure.GROUP_FAILED,
                f"no other replica of layer {m.layer} expert {m.expert} ({others}) answers holding it; "
                f"{m.source!r} keeps serving",
            )

    def _holds(self, group: str, pair: plan.Pair) -> bool:
        try:
            return self._groups.describe(group).holds(pair)
        except GroupCallFailed:
            return False

    # -- failure --------------------------------------------------------------------------------

    def _fail(self, m: Migration, failure: Failure, reason: str) -> Migration:
        table = self._store.routing_table()
        replicas = table.replicas.get(m.pair, ()) if table else ()
        if plan.table_touched(m.mode, m.phase, replicas, m.source, m.target):
            return self._repair(m, failure, reason)
        return self._advance(m, Phase.FAILED, failure=failure, reason=reason + self._unload_target(m))

    def _unload_target(self, m: Migration) -> str:
        """Before the switch: take back what this migration loaded; a note for the reason if it could not."""
        if m.target is None or m.target_preloaded or m.phase is Phase.PENDING:
            return ""
        try:
            self._groups.unload(m.target, m.pair)
        except GroupCallFailed as err:
            return f"; the target may still hold the weights ({err})"
        return ""

    def _repair(self, m: Migration, failure: Failure, reason: str) -> Migration:
        """After the switch: list exactly the replicas that hold the expert; unload nothing."""
        source_holds = self._holds(m.source, m.pair)
        target_holds = m.target is not None and self._holds(m.target, m.pair)

        def edit(table: RoutingTable) -> RoutingTable | None:
            current = table.replicas.get(m.pair, ())
            wanted = plan.repaired_replicas(current, m.replicas_before, m.source, source_holds, m.target, target_holds)
            return plan.with_replicas(table, m.pair, wanted, m.shares_before if wanted == m.replicas_before else ())

        try:
            version = self._publish(edit)
        except (_Failed, MigrationRefused) as err:
            reason += f"; the routing table could not be repaired ({err})"
            version = self._store.routing_table_version()
        table = self._store.routing_table()
        serving = table.replicas.get(m.pair, ()) if table else ()
        rolled_back = serving == m.replicas_before
        reason += f"; routing table v{version} serves it from {list(serving)}" + (" as before" if rolled_back else "")
        phase = Phase.ROLLED_BACK if rolled_back else Phase.FAILED
        return self._advance(m, phase, failure=failure, reason=reason, table_version=version)
