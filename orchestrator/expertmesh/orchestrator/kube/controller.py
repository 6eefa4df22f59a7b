"""The ExpertMigration controller: runs inside ``expertmesh orchestrator`` (``--kube``, or
by default in a pod) and turns objects into migrations and migrations into status.

Two threads. The *watch* thread lists the namespace's objects and watches from the
listing's resourceVersion, re-watching from the last version it saw whenever the
server ends a watch and listing again on 410 Gone; it only hands objects over.
The *follow* thread does everything else, every ``poll_s``:

- admits each object it was handed that is not finished: its record id is
  ``status.migrationId``, the ``expertmesh.io/migration-id`` annotation (a record
  its creator submitted itself, e.g. the drift controller) or, for a new object,
  ``migration_id_for(uid)``; when the store holds that record (a restart, a lost
  status write, a record submitted first) the object just follows it, otherwise
  the spec is submitted to the ``MigrationRunner`` under that id. A spec the
  executor refuses ends the object at once: ``Failed`` with
  reason ``Refused`` and the executor's message, and a Warning Event.
- follows every admitted record: when it changed, writes the object's status
  (``conditions.status_of``; a resourceVersion conflict is re-read and retried),
  then records one Event per phase the record entered since the status last
  written (Warning for Failed / RolledBack). A finished object is left alone from
  then on, across restarts too: its conditions say so.

The runner, not this controller, drives records (and resumes half-done ones at
start), so a record is never stepped by two threads. Deleting an object does not
stop its migration: a make-before-break move cannot be cut short safely; its
record runs to the end and ``expertmesh migrations`` still lists it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from expertmesh.contracts.errors import ExpertMeshError, MigrationNotFound
from expertmesh.orchestrator.admin import MigrationRunner
from expertmesh.orchestrator.kube.api import (
    EventType,
    ExpertMigrationApi,
    KubeApiError,
    KubeConnection,
    WatchExpired,
)
from expertmesh.orchestrator.kube.conditions import REFUSED, refused_status, status_of
from expertmesh.orchestrator.kube.resource import ExpertMigration, MigrationStatus, camel
from expertmesh.orchestrator.migration.state import Migration, Phase, PhaseChange, load
from expertmesh.store import StateStore

log = logging.getLogger(__name__)

#: the Failed reason of an object whose status names a record the state store no longer has
RECORD_LOST = "RecordLost"


def migration_id_for(uid: str) -> str:
    """The record id of the object with ``uid``: the same after any restart, so an object whose
    first status write was lost finds its record instead of starting the move a second time."""
    return uid.replace("-", "")[:12]


@dataclass(frozen=True)
class ControllerSettings:
    namespace: str
    #: seconds between two looks at the followed records (and at newly handed objects)
    poll_s: float = 0.5
    #: how long the API server keeps one watch open; the loop then re-watches from where it was
    watch_timeout_s: int = 60
    #: pause after an API error before listing again
    retry_s: float = 5.0


@dataclass
class _Followed:
    obj: ExpertMigration
    migration_id: str
    #: the record as last written to the object's status
    last: Migration | None = None


class MigrationController:
    def __init__(
        self, api: ExpertMigrationApi, runner: MigrationRunner, store: StateStore, settings: ControllerSettings
    ):
        self.api = api
        self.namespace = settings.namespace
        self._runner = runner
        self._store = store
        self._settings = settings
        self._handed: dict[tuple[str, str], ExpertMigration] = {}
        self._handed_lock = threading.Lock()
        self._followed: dict[tuple[str, str], _Followed] = {}
        #: uids of objects this process saw finish: stale watch events about them are ignored
        self._done: set[str] = set()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._watch_loop, name="expertmesh-kube-watch", daemon=True),
            threading.Thread(target=self._follow_loop, name="expertmesh-kube-follow", daemon=True),
        ]

    def start(self) -> MigrationController:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop both threads. A watch blocked on a quiet server ends with its timeout or the process
        (the thread is a daemon); records keep running in the runner and are followed again at start."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)

    # -- the watch thread ------------------------------------------------------------------------------

    def _watch_loop(self) -> None:
        while not self._stop.is_set():
            try:
                listing = self.api.list(self.namespace)
                for obj in listing.items:
                    self._hand(obj)
                version = listing.resource_version
                while not self._stop.is_set():
                    for event in self.api.watch(self.namespace, version, self._settings.watch_timeout_s):
                        version = event.resource_version
                        if event.object is not None and event.type in ("ADDED", "MODIFIED"):
                            self._hand(event.object)
                        if self._stop.is_set():
                            return
            except WatchExpired as err:
                log.info("watch of ExpertMigrations expired (%s); listing again", err)
            except KubeApiError as err:
                log.warning(
                    "ExpertMigrations in %s: %s; listing again in %g s", self.namespace, err, self._settings.retry_s
                )
                self._stop.wait(self._settings.retry_s)
            except Exception:  # a bug must not end the thread: the controller would go quiet for good
                log.exception(
                    "watching ExpertMigrations in %s failed; listing again in %g s",
                    self.namespace,
                    self._settings.retry_s,
                )
                self._stop.wait(self._settings.retry_s)

    def _hand(self, obj: ExpertMigration) -> None:
        if obj.status.finished:
            return
        with self._handed_lock:
            self._handed[obj.key] = obj

    # -- the follow thread ---------------------------------------------------------------------------

    def _follow_loop(self) -> None:
        while not self._stop.wait(self._settings.poll_s):
            with self._handed_lock:
                handed, self._handed = list(self._handed.values()), {}
            for obj in handed:
                try:
                    self._admit(obj)
                except (KubeApiError, ConnectionError) as err:  # the API or the store: try again next round
                    log.warning("cannot start %s/%s yet: %s", obj.namespace, obj.name, err)
                    self._hand_back(obj)
                except Exception:  # one object's bug must not stop the others
                    log.exception("cannot start %s/%s", obj.namespace, obj.name)
            for followed in list(self._followed.values()):
                try:
                    self._sync(followed)
                except (KubeApiError, ConnectionError) as err:
                    log.warning("cannot report %s/%s yet: %s", followed.obj.namespace, followed.obj.name, err)
                except Exception:
                    log.exception("cannot report %s/%s", followed.obj.namespace, followed.obj.name)

    def _hand_back(self, obj: ExpertMigration) -> None:
        with self._handed_lock:
            self._handed.setdefault(obj.key, obj)  # a newer version handed meanwhile wins

    def _admit(self, obj: ExpertMigration) -> None:
        if obj.key in self._followed or obj.uid in self._done or obj.status.finished:
            return
        migration_id = obj.status.migration_id or obj.submitted_as or migration_id_for(obj.uid)
        if self._store.migration(migration_id) is None:
            if obj.status.migration_id or obj.submitted_as:
                self._refuse(
                    obj, RECORD_LOST, f"the state store has no migration {migration_id}; create a new ExpertMigration"
                )
                return
            if obj.spec is None:
                self._refuse(obj, REFUSED, obj.spec_problem)
                return
            spec = obj.spec
            try:
                self._runner.submit(
                    spec.layer,
                    spec.expert,
                    spec.target,
                    spec.source,
                    spec.mode,
                    initiator=obj.initiator or f"kubernetes:{obj.namespace}/{obj.name}",
                    migration_id=migration_id,
                )
            except ExpertMeshError as err:
                self._refuse(obj, REFUSED, str(err))
                return
            log.info("%s/%s: started migration %s", obj.namespace, obj.name, migration_id)
        followed = _Followed(obj, migration_id)
        self._followed[obj.key] = followed
        self._sync(followed)

    def _refuse(self, obj: ExpertMigration, reason: str, message: str) -> None:
        log.warning("%s/%s: %s: %s", obj.namespace, obj.name, reason, message)
        written = self.api.write_status(
            obj, lambda current: refused_status(reason, message, time.time(), current.generation)
        )
        if written is not None:
            self.api.record_event(written, EventType.WARNING, reason, message)
        self._done.add(obj.uid)

    def _sync(self, followed: _Followed) -> None:
        """Write the record's progress to the object, if the record moved since the last write."""
        try:
            record = load(self._store, followed.migration_id)
        except MigrationNotFound:  # the store was wiped under a running migration
            del self._followed[followed.obj.key]
            self._refuse(followed.obj, RECORD_LOST, f"the state store no longer has migration {followed.migration_id}")
            return
        if record == followed.last:
            return
        obj = self.api.get(*followed.obj.key)
        seen: list[str] = []

        def compute(current: ExpertMigration) -> MigrationStatus:
            seen.append(current.status.phase)
            return status_of(record, current.generation)

        written = self.api.write_status(obj, compute) if obj is not None else None
        if written is None:
            log.info("%s/%s was deleted; migration %s goes on", *followed.obj.key, followed.migration_id)
            del self._followed[followed.obj.key]
            return
        for change in _entered_since(record, seen[-1]):
            failed = change.phase in (Phase.FAILED, Phase.ROLLED_BACK)
            message = f"{record.describe()}: {change.phase.value} at routing table v{change.table_version}"
            self.api.record_event(
                written,
                EventType.WARNING if failed else EventType.NORMAL,
                camel(change.phase.value),
                f"{message}: {record.reason}" if failed else message,
            )
        followed.obj, followed.last = written, record
        if record.phase.terminal:
            del self._followed[followed.obj.key]
            self._done.add(written.uid)


def _entered_since(record: Migration, reported: str) -> tuple[PhaseChange, ...]:
    """The record's phase changes after the phase an object's status last showed (all, for none)."""
    phases = [camel(h.phase.value) for h in record.history]
    start = phases.index(reported) + 1 if reported in phases else 0
    return record.history[start:]


def start_controller(
    connection: KubeConnection,
    runner: MigrationRunner,
    store: StateStore,
    namespace: str | None = None,
) -> MigrationController:
    """Start watching ``namespace`` (default: the connection's: the pod's, or the kubeconfig context's)."""
    settings = ControllerSettings(namespace or connection.namespace)
    return MigrationController(ExpertMigrationApi(connection), runner, store, settings).start()
