"""The orchestrator's admin gRPC service (``expertmesh.v1.Admin``): migrations on demand,
drift scans (``orchestrator.drift``), expert health (``orchestrator.health``: the
listing, quarantine and release, answered by the ``HealthMonitor`` the caller passes in),
and expert groups added and removed live (``orchestrator.elastic``, through the platform's launcher).

``MigrationRunner`` runs submitted migrations in the background, at most
``max_concurrent`` at once, through the one ``MigrationExecutor`` every caller
shares (CLI, drift controller, Kubernetes controller); at start it resumes what a
previous orchestrator left half done. ``AdminServicer`` is the gRPC face of it:
a bad request is refused with the executor's error (INVALID_ARGUMENT /
FAILED_PRECONDITION / NOT_FOUND) before anything moves. ``start_orchestrator`` starts
all of it with the control loop (``control_loop``) stepping the enabled managers.

A ``WatchMigrations`` stream holds one of the server's ``ADMIN_WORKERS`` threads for its whole life
(``migrate --wait``, ``migrations --watch``). At most ``MAX_WATCH_STREAMS`` are served at once, so the
other threads are always there for the unary calls (an emergency ``Quarantine`` above all); one more is
refused RESOURCE_EXHAUSTED, and the CLI then polls ``GetMigration`` / ``ListMigrations`` instead
(``admin_client.follow``).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import grpc

from expertmesh.contracts.errors import QuarantineRefused
from expertmesh.infra.grpc_server import GrpcServer, guarded
from expertmesh.orchestrator.capacity.config import CapacityConfig
from expertmesh.orchestrator.capacity.controller import CapacityController
from expertmesh.orchestrator.control_loop import ControlLoop, Manager
from expertmesh.orchestrator.drift import api as drift_api
from expertmesh.orchestrator.drift.config import DriftConfig
from expertmesh.orchestrator.drift.controller import DriftController, DriftRecord
from expertmesh.orchestrator.elastic.controller import GroupController, GroupLauncher, GroupRequest
from expertmesh.orchestrator.elastic.state import GroupRecord
from expertmesh.orchestrator.health import api as health_api
from expertmesh.orchestrator.health.anomalies import AnomalyRounds
from expertmesh.orchestrator.health.monitor import HealthMonitor
from expertmesh.orchestrator.migration.executor import MigrationExecutor
from expertmesh.orchestrator.migration.state import OPERATOR, Migration, MigrationMode, Phase, load, load_all
from expertmesh.orchestrator.retention import RecordRetention, RetentionConfig
from expertmesh.store import StateStore
from expertmesh.v1 import admin_pb2 as pb
from expertmesh.v1 import admin_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "expertmesh.v1.Admin"
#: threads of the admin gRPC server
ADMIN_WORKERS = 16
#: WatchMigrations streams served at once (each holds a thread): the other threads stay free for unary calls
MAX_WATCH_STREAMS = 8
#: a migration that lost the store waits this long before resuming, doubling up to STORE_RETRY_MAX_S
STORE_RETRY_S = 0.5
STORE_RETRY_MAX_S = 10.0
_MODE_TO_PROTO = {
    MigrationMode.MOVE: pb.MIGRATION_MODE_MOVE,
    MigrationMode.REPLICATE: pb.MIGRATION_MODE_REPLICATE,
    MigrationMode.EVICT: pb.MIGRATION_MODE_EVICT,
}
_MODE_FROM_PROTO = {v: k for k, v in _MODE_TO_PROTO.items()} | {pb.MIGRATION_MODE_UNSPECIFIED: MigrationMode.MOVE}


def phase_to_proto(phase: Phase) -> int:
    return pb.MigrationPhase.Value(f"MIGRATION_PHASE_{phase.name}")


def phase_from_proto(value: int) -> Phase:
    return Phase[pb.MigrationPhase.Name(value).removeprefix("MIGRATION_PHASE_")]


def mode_from_proto(value: int) -> MigrationMode:
    return _MODE_FROM_PROTO[value]


def to_proto(m: Migration) -> pb.Migration:
    return pb.Migration(
        id=m.id,
        layer=m.layer,
        expert=m.expert,
        mode=_MODE_TO_PROTO[m.mode],
        source=m.source,
        target=m.target or "",
        phase=phase_to_proto(m.phase),
        routing_table_version=m.table_version,
        failure=m.failure.value if m.failure else "",
        reason=m.reason,
        bytes_loaded=m.bytes_loaded,
        started_at=m.started_at,
        completed_at=m.completed_at or 0.0,
        history=[
            pb.PhaseChange(phase=phase_to_proto(h.phase), at=h.at, routing_table_version=h.table_version)
            for h in m.history
        ],
        initiator=m.initiator,
    )


def group_to_proto(record: GroupRecord, experts: int = 0) -> pb.ExpertGroupStatus:
    return pb.ExpertGroupStatus(
        name=record.name,
        phase=pb.GroupPhase.Value(f"GROUP_PHASE_{record.phase.name}"),
        address=record.address,
        pid=record.pid,
        reason=record.reason,
        experts=experts,
        requested_at=record.requested_at,
        registered_at=record.registered_at,
        first_listed_at=record.first_listed_at,
        finished_at=record.finished_at,
        moves_planned=record.moves_planned,
        moves_done=record.moves_done,
        bytes_moved=record.bytes_moved,
        exit_code=record.exit_code,
    )


class MigrationRunner:
    """Runs migrations in the background through one executor, ``max_concurrent`` at a time."""

    def __init__(self, store: StateStore, executor: MigrationExecutor, max_concurrent: int = 2):
        self._store = store
        self.executor = executor
        self.max_concurrent = max_concurrent
        self._pool = ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix="expertmesh-migration")
        self._running: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()

    def resume(self) -> None:
        """Finish or roll back, in the background, every migration a previous orchestrator left half done."""
        for migration in load_all(self._store):
            if not migration.phase.terminal:
                log.info("resuming %s at %s", migration.describe(), migration.phase)
                self._start(migration.id)

    def submit(
        self,
        layer: int,
        expert: int,
        target: str | None,
        source: str | None,
        mode: MigrationMode,
        initiator: str = OPERATOR,
        migration_id: str | None = None,
    ) -> Migration:
        """Validate and start one migration; returns its PENDING record (``migration_id``: see the executor)."""
        migration = self.executor.submit(
            layer, expert, target=target, source=source, mode=mode, initiator=initiator, migration_id=migration_id
        )
        self._start(migration.id)
        return migration

    def _start(self, migration_id: str) -> None:
        with self._lock:
            self._running[migration_id] = self._pool.submit(self._run, migration_id)

    def _run(self, migration_id: str) -> None:
        try:
            ended = self._run_through_store_outages(migration_id)
            if ended is not None:
                log.info("%s ended %s %s", ended.describe(), ended.phase, ended.reason)
        except Exception:  # one migration's bug must not stop the others; its record shows where it stood
            log.exception("migration %s stopped with an error", migration_id)
        finally:
            with self._lock:
                self._running.pop(migration_id, None)

    def _run_through_store_outages(self, migration_id: str) -> Migration | None:
        """Run the migration to its end; while the store cannot be reached (its host cut off, this
        one cut off) wait and resume from the record it holds, as a restarted orchestrator would:
        each phase is persisted after its work and safe to do again. None: stopped by ``close``
        (the record stays resumable)."""
        delay = STORE_RETRY_S
        while True:
            try:
                return self.executor.run(migration_id)
            except ConnectionError as err:
                log.warning("migration %s: %s; resuming in %.1f s", migration_id, err, delay)
            if self._closing.wait(delay):
                return None
            delay = min(2 * delay, STORE_RETRY_MAX_S)

    def wait_idle(self, timeout_s: float) -> bool:
        """True once no migration runs (for a graceful stop), False at ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._running:
                    return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        """Stop taking migrations; those running finish their current run (records stay resumable)."""
        self._closing.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.executor.close()


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(
        self,
        runner: MigrationRunner,
        store: StateStore,
        watch_poll_s: float = 0.2,
        *,
        drift: DriftController,
        health: HealthMonitor | None = None,
        max_watch_streams: int = MAX_WATCH_STREAMS,
        groups: GroupController | None = None,
    ):
        self._runner = runner
        self._groups = groups if groups is not None else GroupController(store, runner.submit, None)
        self._store = store
        self._poll = watch_poll_s
        self._drift = drift
        self._health = health
        self._max_watch_streams = max_watch_streams
        self._watch_slots = threading.BoundedSemaphore(max_watch_streams)

    @guarded
    def Migrate(self, request: pb.MigrateRequest, context) -> pb.Migration:
        if request.mode not in _MODE_FROM_PROTO:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown migration mode {request.mode}")
        migration = self._runner.submit(
            request.layer,
            request.expert,
            target=request.target or None,
            source=request.source or None,
            mode=mode_from_proto(request.mode),
            initiator=request.initiator or OPERATOR,
        )
        return to_proto(migration)

    @guarded
    def GetMigration(self, request: pb.GetMigrationRequest, context) -> pb.Migration:
        return to_proto(load(self._store, request.id))

    @guarded
    def ListMigrations(self, request: pb.ListMigrationsRequest, context) -> pb.ListMigrationsResponse:
        return pb.ListMigrationsResponse(migrations=[to_proto(m) for m in load_all(self._store)])

    def WatchMigrations(self, request: pb.WatchMigrationsRequest, context) -> Iterator[pb.Migration]:
        """Every record as it is now, then each change; with an id, until that migration ends. Refused
        RESOURCE_EXHAUSTED beyond ``max_watch_streams`` open at once."""
        if not self._watch_slots.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._max_watch_streams} migration watch streams are open, the most this orchestrator serves at "
                "once (each holds a server thread); poll GetMigration or ListMigrations instead, or retry later",
            )
        try:
            yield from self._watch(request, context)
        finally:
            self._watch_slots.release()

    def _watch(self, request: pb.WatchMigrationsRequest, context) -> Iterator[pb.Migration]:
        seen: dict[str, Migration] = {}
        if request.id:
            try:
                load(self._store, request.id)
            except Exception as err:  # MigrationNotFound, or the store is down
                context.abort(getattr(err, "code", grpc.StatusCode.UNAVAILABLE), str(err))
        while context.is_active():
            try:
                current = [load(self._store, request.id)] if request.id else load_all(self._store)
            except ConnectionError as err:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"the state store is unreachable: {err}")
            for migration in current:
                if seen.get(migration.id) != migration:
                    seen[migration.id] = migration
                    yield to_proto(migration)
            if request.id and current[0].phase.terminal:
                return
            time.sleep(self._poll)

    @guarded
    def ScanDrift(self, request: pb.ScanDriftRequest, context) -> pb.ScanDriftResponse:
        return drift_api.to_proto(self._drift.update(dry_run=request.dry_run))

    def _monitor(self) -> HealthMonitor:
        if self._health is None:
            raise QuarantineRefused("this orchestrator runs no health monitor (it was started without a checkpoint)")
        return self._health

    @guarded
    def ListExperts(self, request: pb.ListExpertsRequest, context) -> pb.ReplicaHealthList:
        layer = request.layer if request.HasField("layer") else None
        return health_api.to_proto(self._monitor().listing(layer))

    @guarded
    def Quarantine(self, request: pb.QuarantineRequest, context) -> pb.ReplicaHealthList:
        statuses = self._monitor().quarantine(request.layer, request.expert, request.group or None, request.reason)
        return health_api.to_proto(statuses)

    @guarded
    def Release(self, request: pb.ReleaseRequest, context) -> pb.ReplicaHealthList:
        return health_api.to_proto(self._monitor().release(request.layer, request.expert, request.group or None))

    def _group_status(self, record: GroupRecord) -> pb.ExpertGroupStatus:
        table = self._store.routing_table()
        experts = len(table.placement().groups.get(record.name, ())) if table is not None else 0
        return group_to_proto(record, experts)

    @guarded
    def AddGroup(self, request: pb.AddGroupRequest, context) -> pb.ExpertGroupStatus:
        record = self._groups.add(GroupRequest(request.name or None, request.gpus, request.island, request.node))
        return self._group_status(record)

    @guarded
    def RemoveGroup(self, request: pb.RemoveGroupRequest, context) -> pb.ExpertGroupStatus:
        return self._group_status(self._groups.remove(request.name))

    @guarded
    def GetGroup(self, request: pb.GetGroupRequest, context) -> pb.ExpertGroupStatus:
        return self._group_status(self._groups.get(request.name))

    @guarded
    def ListGroups(self, request: pb.ListGroupsRequest, context) -> pb.ListGroupsResponse:
        table = self._store.routing_table()
        held = table.placement().groups if table is not None else {}
        return pb.ListGroupsResponse(
            groups=[group_to_proto(r, len(held.get(r.name, ()))) for r in self._groups.records()]
        )


@dataclass
class Orchestrator:
    """The orchestrator's parts as ``start_orchestrator`` started them."""

    server: GrpcServer
    runner: MigrationRunner
    drift: DriftController
    health: HealthMonitor | None
    loop: ControlLoop
    groups: GroupController
    capacity: CapacityController | None = None

    def stop(self) -> None:
        """Stop the loop, then the admin API, then group changes and the migrations (those running finish first)."""
        self.loop.stop()
        self.server.set_serving(False)
        self.server.stop()
        self.groups.close()
        self.drift.close()
        if self.capacity is not None:
            self.capacity.close()
        if self.health is not None:
            self.health.close()
        self.runner.close()


def start_orchestrator(
    store: StateStore,
    host: str,
    port: int,
    *,
    max_concurrent: int = 2,
    drain_timeout_s: float = 60.0,
    drift: DriftConfig | None = None,
    health: HealthMonitor | None = None,
    capacity: CapacityConfig | None = None,
    on_drift_decision: Callable[[DriftRecord], None] | None = None,
    managers: Sequence[Manager] = (),
    model_fingerprint: str = "",
    max_watch_streams: int = MAX_WATCH_STREAMS,
    launcher: GroupLauncher | None = None,
    retention: RetentionConfig | None = None,
) -> Orchestrator:
    """The admin gRPC server with the Admin service, its runner resuming half-done migrations, and
    the control loop stepping ``managers`` plus the drift controller (``drift``, default the
    environment's ``EXPERTMESH_DRIFT_*``) and the health monitor when they are enabled. ``health``
    also answers the health RPCs (without it they are FAILED_PRECONDITION).
    ``on_drift_decision``: called with each drift decision (cluster mode: ``kube.drift_objects``).
    ``model_fingerprint``: the deployment's checkpoint's; migrations place no expert on a group of another.
    ``launcher``: starts and stops groups for AddGroup / RemoveGroup (None: they are refused).
    ``capacity``: the capacity controller's settings (default the environment's ``EXPERTMESH_CAPACITY_*``; off
    unless enabled); its group advice goes to the groups above where a launcher can start them.
    ``retention``: how long finished migration and group records stay in the store (default the environment's
    ``EXPERTMESH_RETENTION_*``)."""
    executor = MigrationExecutor(store, drain_timeout_s=drain_timeout_s, model_fingerprint=model_fingerprint)
    runner = MigrationRunner(store, executor, max_concurrent)
    controller = DriftController(
        store, runner, drift if drift is not None else DriftConfig(), on_decision=on_drift_decision
    )
    if not 0 < max_watch_streams < ADMIN_WORKERS:
        raise ValueError(f"max_watch_streams must be between 1 and {ADMIN_WORKERS - 1}, got {max_watch_streams}")
    server = GrpcServer("admin", host, port, workers=ADMIN_WORKERS)
    groups = GroupController(store, runner.submit, launcher, max_active=runner.max_concurrent)
    servicer = AdminServicer(
        runner, store, drift=controller, health=health, max_watch_streams=max_watch_streams, groups=groups
    )
    pb_grpc.add_AdminServicer_to_server(servicer, server.server)
    server.start((SERVICE_NAME,))
    runner.resume()
    groups.resume()  # after the runner: a half-done group change waits for its migrations to end first
    steps = list(managers)
    if controller.config.enabled:
        steps.append(Manager("drift", controller.config.scan_interval_s, controller.update))
    if health is not None and health.config.enabled:
        steps.append(Manager("health", health.config.interval_s, health.update))
        if health.config.anomaly_rounds:  # early rounds on routers' anomaly records (health.anomalies)
            steps.append(Manager("health-anomalies", health.config.anomaly_poll_s, AnomalyRounds(health, store).update))
    capacity = capacity if capacity is not None else CapacityConfig()
    records = RecordRetention(
        store,
        retention if retention is not None else RetentionConfig(),
        protect_s=max(controller.config.cooldown_s, capacity.cooldown_s),  # the scans read moves this recent
        forget_group=groups.forget,
    )
    steps.append(Manager("retention", records.config.interval_s, records.update))
    sizer = None
    if capacity.enabled:
        sizer = CapacityController(
            store,
            runner.submit,
            capacity,
            add_group=(lambda: groups.add(GroupRequest()).name) if launcher is not None else None,
            remove_group=(lambda name: groups.remove(name).name) if launcher is not None else None,
        )
        steps.append(Manager("capacity", capacity.scan_interval_s, sizer.update))
    return Orchestrator(server, runner, controller, health, ControlLoop(steps).start(), groups, sizer)
