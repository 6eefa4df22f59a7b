"""Adds and removes expert groups: the I/O around ``state`` and ``plan``.

``GroupController.add`` checks the request, starts the group through the platform's
``GroupLauncher`` (empty; it registers), plans the moves that fill it and runs them through
the ``MigrationRunner`` every other mover uses (each one make before break). ``remove``
checks that its experts fit elsewhere, runs the moves that drain it, makes sure no routing
table names it any more, then has the launcher stop its process. One change at a time; each
runs in a thread of its own and its record (``GroupRecord``) says where it stands.

Records are kept in the state store (``groups``) at every change of one, so a restarted orchestrator
(``resume``) finishes a change the last one left half done: a drain is planned again from the table as it
is and run to the group's stop; a fill, once the group runs, is planned again and run; a start that never
got a running group fails with a line saying so. The migrations a change had in flight are resumed by the
runner as usual, and waited for first. Groups the store lists that no record names are SERVING, and so is a
group STOPPED whose endpoint the store lists again (its platform started it again: a `helm upgrade`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from expertmesh.contracts.errors import ExpertMeshError, GroupChangeRefused, GroupNotFound, MigrationNotFound
from expertmesh.orchestrator.drift.observe import Observer
from expertmesh.orchestrator.elastic import plan as plan_mod
from expertmesh.orchestrator.elastic.state import GroupPhase, GroupRecord, checked_add, checked_remove
from expertmesh.orchestrator.migration.state import Migration, MigrationMode, Phase, load, load_all
from expertmesh.store import StateStore

__all__ = ["GroupController", "GroupLauncher", "GroupRequest"]

log = logging.getLogger(__name__)

#: migration phases at which a router may already send the target tokens (its make edit is published)
_LISTED = (Phase.CONFIRMING, Phase.RETIRING, Phase.DRAINING, Phase.UNLOADING, Phase.SUCCEEDED)


@dataclass(frozen=True)
class GroupRequest:
    name: str | None = None
    gpus: int = 0
    island: str = ""
    node: str = ""


class GroupLauncher(Protocol):
    """Starts and stops expert groups on one platform: Ray Serve deployments (``platform.ray_groups``, the
    default ``up``), group processes (``platform.group_processes``, ``up --groups-as process``) or the
    applications of a KubeRay RayService (``orchestrator.kube.groups``, ``expertmesh orchestrator
    --ray-service``)."""

    def running(self) -> dict[str, tuple[str, int]]:
        """name -> (address, pid) of every group it runs now."""
        ...

    def check(self, gpus: int, island: str, node: str) -> None:
        """Raise GroupChangeRefused for a placement this platform cannot make (before anything starts)."""
        ...

    def check_stop(self, name: str) -> None:
        """Raise GroupChangeRefused when group ``name`` cannot be stopped live here (before it is drained)."""
        ...

    def start(self, name: str, gpus: int, island: str, node: str) -> tuple[str, int]:
        """Start an empty group ``name``; returns (address, pid) once it serves. Raises an ExpertMeshError
        with a line a person can act on."""
        ...

    def stop(self, name: str) -> int:
        """Stop group ``name`` gracefully; its exit status (0 for a Serve deployment Serve has stopped)."""
        ...


def _ended(store: StateStore, migration_id: str) -> bool:
    """The migration's record is terminal, or gone (retention deletes only finished ones)."""
    try:
        return load(store, migration_id).phase.terminal
    except MigrationNotFound:
        return True


class _Failed(Exception):
    """A change's moves cannot all finish; the message says which and why."""


class GroupController:
    def __init__(
        self,
        store: StateStore,
        submit: Callable[..., Migration],
        launcher: GroupLauncher | None,
        *,
        clock: Callable[[], float] = time.time,
        poll_s: float = 0.1,
        max_active: int = 2,
    ):
        """``submit``: ``MigrationRunner.submit``. ``launcher``: None where this orchestrator cannot start groups
        (it then lists them, and refuses adds and removes). ``max_active``: a change's migrations submitted and not
        ended at once (the runner's ``max_concurrent``): the rest wait here, not as PENDING records."""
        if max_active < 1:
            raise ValueError(f"max_active must be at least 1, got {max_active}")
        self._store = store
        self._submit = submit
        self._launcher = launcher
        self._clock = clock
        self._poll_s = poll_s
        self._max_active = max_active
        self._lock = threading.Lock()
        self._records: dict[str, GroupRecord] = {}
        self._threads: list[threading.Thread] = []
        self._closing = threading.Event()
        self._observer = Observer(store)
        running = launcher.running() if launcher else {}
        for name, (address, pid) in running.items():
            self._records[name] = GroupRecord(name, GroupPhase.SERVING, address=address, pid=pid)
        for name, raw in store.group_records().items():
            try:
                record = GroupRecord.from_json(raw)
            except ValueError as err:  # another version's record: the group is known from the store anyway
                log.warning("expert group %s: its stored record cannot be read (%s); left out", name, err)
                continue
            if name in running:  # the platform says where it runs now
                record = replace(record, address=running[name][0], pid=running[name][1])
            self._records[name] = record

    # -- reading ------------------------------------------------------------------------------

    def records(self) -> list[GroupRecord]:
        """Every group known: those this controller tracks, and any other the store lists (as SERVING), a
        stopped one that registered again included."""
        endpoints = self._store.endpoints()
        with self._lock:
            for name, address in endpoints.items():
                record = self._records.get(name)
                if record is None:
                    self._records[name] = GroupRecord(name, GroupPhase.SERVING, address=address)
                elif record.phase is GroupPhase.STOPPED and self._store.endpoints().get(name) == address:
                    # Its endpoint is removed after its stop, so its platform started it again: on Kubernetes a
                    # `helm upgrade` renders a chart group removed live back. No routing table lists it; SERVING
                    # again, so it can be removed again (or given experts by the next change's plan). Read again
                    # under the lock: the snapshot above may predate the stop's removal of the endpoint (a remove
                    # then marks the record STOPPED after it), and would bring a group just stopped back to life.
                    log.info("expert group %s: registered again at %s after it was stopped", name, address)
                    self._keep(
                        GroupRecord(
                            name,
                            GroupPhase.SERVING,
                            address=address,
                            reason="started again after it was stopped (e.g. helm upgrade rendered it back); "
                            "no routing table lists it",
                        )
                    )
            return sorted(self._records.values(), key=lambda r: r.name)

    def get(self, name: str) -> GroupRecord:
        for record in self.records():
            if record.name == name:
                return record
        raise GroupNotFound(f"no expert group {name!r}; the groups: {', '.join(r.name for r in self.records())}")

    # -- changes ------------------------------------------------------------------------------

    def _need_launcher(self) -> GroupLauncher:
        if self._launcher is None:
            raise GroupChangeRefused(
                "this orchestrator cannot start or stop expert groups: run the platform with "
                "`expertmesh up --orchestrator` (groups on Ray Serve, or --groups-as process), or on Kubernetes "
                "`expertmesh orchestrator --ray-service NAME` (the chart passes it)"
            )
        return self._launcher

    def add(self, request: GroupRequest) -> GroupRecord:
        """Check, record STARTING and start the change in the background; its record now."""
        self._need_launcher().check(request.gpus, request.island, request.node)
        self.records()  # the store's groups known first: a name it lists is taken
        with self._lock:
            name = checked_add(request.name, self._records, self._store.endpoints())
            record = GroupRecord(name, GroupPhase.STARTING, requested_at=self._clock())
            self._keep(record)
        self._spawn(f"add-{name}", lambda: self._run_add(name, request))
        return record

    def remove(self, name: str) -> GroupRecord:
        """Check (the platform can stop it, the experts must fit elsewhere), plan, record DRAINING and drain in
        the background."""
        self._need_launcher().check_stop(name)
        self.records()
        with self._lock:
            record = checked_remove(name, self._records, self._store.routing_table())
            # planned inside the lock: a second change cannot start between the check and DRAINING
            change = self._planned(groups_after=lambda groups: sorted(groups - {name}))
            record = record.entering(
                GroupPhase.DRAINING,
                requested_at=self._clock(),
                reason="",
                moves_planned=change.moves,
                moves_done=0,
                bytes_moved=0,
                registered_at=0.0,
                first_listed_at=0.0,
                finished_at=0.0,
            )
            self._keep(record)
        self._spawn(f"remove-{name}", lambda: self._run_remove(name, change))
        return record

    def _planned(self, groups_after: Callable[[set[str]], list[str]]) -> plan_mod.GroupPlan:
        """The plan over the groups ``groups_after`` makes of the table's (and every registered one's),
        refused when it does not fit the groups' memory budgets."""
        seen = self._observer.observe()
        groups = set(seen.table.groups()) | {
            r.name for r in self._records.values() if r.phase in (GroupPhase.SERVING, GroupPhase.FILLING)
        }
        expert_bytes = max((g.expert_bytes for g in seen.groups), default=0)
        top_k = seen.top_k or 1
        change = plan_mod.plan_change(seen.table, seen.loads, groups_after(groups), top_k, expert_bytes)
        free = {g.group: (g.budget_bytes - g.weight_bytes if g.budget_bytes else None) for g in seen.groups}
        why = plan_mod.fits(change, free, expert_bytes)
        if why is not None:
            raise GroupChangeRefused(f"the experts cannot be placed: {why}; add a group or raise its budget first")
        return change

    def _spawn(self, what: str, work: Callable[[], None]) -> None:
        thread = threading.Thread(target=work, name=f"expertmesh-group-{what}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _update(self, name: str, phase: GroupPhase | None = None, **changes) -> GroupRecord:
        with self._lock:
            record = self._records[name]
            record = record.entering(phase, **changes) if phase is not None else replace(record, **changes)
            self._keep(record)
            return record

    def _keep(self, record: GroupRecord) -> None:
        """(Under ``_lock``) ``record`` is the group's, here and in the store: a restarted orchestrator
        resumes from it. A store that cannot be written is logged; the change goes on."""
        self._records[record.name] = record
        try:
            self._store.save_group_record(record.name, record.to_json().encode())
        except ConnectionError as err:
            log.warning("expert group %s: could not keep its record in the state store: %s", record.name, err)

    def _run_add(self, name: str, request: GroupRequest) -> None:
        try:
            address, pid = self._need_launcher().start(name, request.gpus, request.island, request.node)
        except Exception as err:  # ExpertMeshError: the launcher's words; anything else: a bug, still reported
            log.warning("expert group %s did not start: %s", name, err)
            self._update(name, GroupPhase.FAILED, reason=f"did not start: {err}", finished_at=self._clock())
            return
        self._store.set_endpoint(name, address)  # it registers itself with a shared store too; same write
        self._update(name, GroupPhase.FILLING, address=address, pid=pid, registered_at=self._clock())
        self._fill(name)

    def _fill(self, name: str) -> None:
        """Plan the moves onto group ``name`` (FILLING) and run them; SERVING, or FAILED with the reason."""
        try:
            self._await_own_migrations(name)
            with self._lock:
                change = self._planned(groups_after=lambda groups: sorted(groups | {name}))
            self._update(name, moves_planned=self._records[name].moves_done + change.moves)
            copied = self._records[name].bytes_moved + self._run_steps(name, change)
        except Exception as err:  # a bug too must not leave the group FILLING, which would block every change
            if not isinstance(err, (_Failed, ExpertMeshError, ConnectionError)):
                log.exception("filling expert group %s", name)
            record = self._update(name, GroupPhase.FAILED, reason=f"filling stopped: {err}", finished_at=self._clock())
            log.warning("expert group %s: %s (it keeps serving what it holds)", name, record.reason)
            return
        record = self._records[name]
        self._update(
            name,
            GroupPhase.SERVING,
            bytes_moved=copied,
            finished_at=self._clock(),
            reason=f"filled by {record.moves_done} moves ({plan_mod.size(copied)} copied) in "
            f"{self._clock() - record.requested_at:.1f} s",
        )
        log.info("expert group %s: %s", name, self._records[name].reason)

    def _run_remove(self, name: str, change: plan_mod.GroupPlan) -> None:
        try:
            copied = self._records[name].bytes_moved + self._run_steps(name, change)
            table = self._store.routing_table()
            if table is not None and name in table.groups():
                raise _Failed(f"routing table v{table.version} still lists it (another mover put experts there)")
        except Exception as err:  # as in _run_add
            if not isinstance(err, (_Failed, ExpertMeshError, ConnectionError)):
                log.exception("draining expert group %s", name)
            record = self._update(name, GroupPhase.FAILED, reason=f"draining stopped: {err}", finished_at=self._clock())
            log.warning("expert group %s: %s (it keeps running; remove it again to retry)", name, record.reason)
            return
        self._update(name, registered_at=self._clock(), bytes_moved=copied)
        launcher = self._need_launcher()
        try:
            code = launcher.stop(name) if name in launcher.running() else None  # None: it never started
        except Exception as err:
            self._update(name, GroupPhase.FAILED, reason=f"drained, but its process did not stop: {err}")
            return
        self._store.remove_endpoint(name)  # after the stop: a group registering itself again would undo it
        record = self._records[name]
        self._update(
            name,
            GroupPhase.STOPPED,
            exit_code=code,
            finished_at=self._clock(),
            reason=f"drained by {record.moves_done} moves ({plan_mod.size(copied)} copied) and stopped "
            f"(exit status {code}) {self._clock() - record.requested_at:.1f} s after the request"
            if code is not None
            else "removed (its process had not started)",
        )
        log.info("expert group %s: %s", name, self._records[name].reason)

    # -- after a restart -----------------------------------------------------------------------

    def resume(self) -> list[str]:
        """Finish, in the background, the changes a previous orchestrator left half done (records in the store
        still STARTING, FILLING or DRAINING); returns their groups' names. Without a launcher they are left as
        they are (nothing here could stop a drained group)."""
        with self._lock:
            pending = sorted((r for r in self._records.values() if r.phase.in_flight), key=lambda r: r.name)
        if pending and self._launcher is None:
            log.warning("expert groups %s were being changed, but this orchestrator cannot start or stop groups: "
                        "left as they are", [r.name for r in pending])  # fmt: skip
            return []
        running = self._launcher.running() if pending else {}
        for record in pending:
            name = record.name
            log.info("expert group %s: resuming the change a previous orchestrator left %s", name, record.phase)
            if record.phase is GroupPhase.DRAINING:
                self._spawn(f"remove-{name}", lambda n=name: self._resume_remove(n))
            elif name in running:  # STARTING or FILLING, and it runs: fill it
                if record.phase is GroupPhase.STARTING:
                    address, pid = running[name]
                    self._update(name, GroupPhase.FILLING, address=address, pid=pid, registered_at=self._clock())
                self._spawn(f"add-{name}", lambda n=name: self._fill(n))
            else:
                self._update(
                    name,
                    GroupPhase.FAILED,
                    finished_at=self._clock(),
                    reason="the orchestrator restarted while it started, and it does not run: add it again",
                )
        return [r.name for r in pending]

    def _resume_remove(self, name: str) -> None:
        """The drain of ``name`` planned again from the table as it is now, then run to its stop."""
        try:
            self._await_own_migrations(name)
            with self._lock:
                change = self._planned(groups_after=lambda groups: sorted(groups - {name}))
            done = self._records[name].moves_done
            self._update(name, moves_planned=done + change.moves)
        except Exception as err:  # as in _run_remove
            if not isinstance(err, (_Failed, ExpertMeshError, ConnectionError)):
                log.exception("draining expert group %s again", name)
            self._update(name, GroupPhase.FAILED, reason=f"draining stopped: {err}", finished_at=self._clock())
            return
        self._run_remove(name, change)

    def _await_own_migrations(self, name: str) -> None:
        """Until no migration of this group's change (``initiator`` ``group:<name>``) is under way: after a
        restart the runner resumes them, and a pair in flight cannot be moved again."""
        # One scan of every record for the change's own, then only those polled (a record read by id).
        waiting = [m.id for m in load_all(self._store) if m.initiator == f"group:{name}" and not m.phase.terminal]
        while waiting:
            if self._closing.wait(self._poll_s):
                raise _Failed("the orchestrator is stopping")
            waiting = [mid for mid in waiting if not _ended(self._store, mid)]

    def _run_steps(self, name: str, change: plan_mod.GroupPlan) -> int:
        """Run the plan's migrations, each pair's in order, the pairs side by side, ``max_active`` at once; stop
        submitting at the first that does not succeed. Returns the bytes copied."""
        queues = [list(steps) for steps in change.steps]
        active: dict[str, int] = {}  # migration id -> its pair's queue
        failure: str | None = None
        copied = 0
        while True:
            if failure is None:
                for q, steps in enumerate(queues):
                    # As many as the runner runs: submitting the whole plan at once wrote every record and
                    # checked every pair in one burst on the process that serves (the embedded orchestrator's
                    # router), a step stall at the start of each change.
                    if len(active) >= self._max_active:
                        break
                    if not steps or q in active.values():
                        continue
                    step = steps.pop(0)
                    try:
                        migration = self._submit(
                            step.layer,
                            step.expert,
                            target=step.target,
                            source=step.source,
                            mode=step.mode,
                            initiator=f"group:{name}",
                        )
                    except ExpertMeshError as err:
                        failure = f"layer {step.layer} expert {step.expert}: {err}"
                        break
                    active[migration.id] = q
            if not active and (failure is not None or not any(queues)):
                break
            if self._closing.wait(self._poll_s):
                raise _Failed("the orchestrator is stopping")
            for migration_id in list(active):
                migration = load(self._store, migration_id)
                self._note_listed(name, migration)
                if not migration.phase.terminal:
                    continue
                del active[migration_id]
                copied += migration.bytes_loaded
                if migration.phase is Phase.SUCCEEDED:
                    self._update(name, moves_done=self._records[name].moves_done + 1)
                elif failure is None:
                    failure = f"{migration.describe()} ended {migration.phase}: {migration.reason}"
        if failure is not None:
            raise _Failed(failure)
        return copied

    def _note_listed(self, name: str, migration: Migration) -> None:
        record = self._records[name]
        if (
            not record.first_listed_at
            and migration.target == name
            and migration.mode is not MigrationMode.EVICT
            and migration.phase in _LISTED
        ):
            self._update(name, first_listed_at=self._clock())

    def forget(self, name: str) -> None:
        """Drop a STOPPED group's record from memory (retention deleted it from the store); any other stays."""
        with self._lock:
            record = self._records.get(name)
            if record is not None and record.phase is GroupPhase.STOPPED:
                del self._records[name]

    def close(self) -> None:
        """Stop the changes under way at their next poll (their migrations finish in the runner)."""
        self._closing.set()
        for thread in self._threads:
            thread.join(timeout=30)
        self._observer.close()
