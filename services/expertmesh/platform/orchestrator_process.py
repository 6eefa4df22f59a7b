"""``expertmesh orchestrator``: the control-plane process.

Serves the admin gRPC port (``grpc.health.v1`` and ``expertmesh.v1.Admin``: live
migrations, half-done ones resumed at start; drift scans; expert health) and
runs one control loop (``control_loop``) stepping its managers: applying the
placement file to the routing table when the file changes; with ``--drift`` (or
``EXPERTMESH_DRIFT_ENABLED``) drift scans; with ``--health-monitor`` (or
``EXPERTMESH_HEALTH_ENABLED``) health rounds over every replica. With ``--kube``
(the default in a pod) the ExpertMigration controller runs too
(``orchestrator.kube``), and with ``--ray-service`` expert groups are added and removed live
as applications of that RayService (``orchestrator.kube.groups``), through the admin API or
ExpertGroup objects (``orchestrator.kube.group_objects_controller``). A bad placement at start-up
is refused with one line; a bad edit later is logged and the last good table stays.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from expertmesh.config.settings import DataPlaneConfig, add_config_argument, add_setting_flag
from expertmesh.contracts.errors import InputError
from expertmesh.models.resolve import data_plane_config
from expertmesh.orchestrator.capacity.config import add_capacity_argument, capacity_config
from expertmesh.orchestrator.drift.config import add_drift_argument, drift_config
from expertmesh.orchestrator.health.config import add_health_argument, health_config

log = logging.getLogger(__name__)


def add_command(commands) -> None:
    p = commands.add_parser("orchestrator", help="run the orchestrator: keep the routing table equal to the placement")
    # the data plane's settings (the model for its MoE shape; the placement, re-read every --interval),
    # with their precedence: flags > EXPERTMESH_* > --config file
    add_config_argument(p)
    add_setting_flag(p, DataPlaneConfig, "state_url", default_note="none, required: redis://host:port/db")
    add_setting_flag(p, DataPlaneConfig, "deployment")
    add_setting_flag(p, DataPlaneConfig, "model", default_note="none, required")
    add_setting_flag(p, DataPlaneConfig, "revision")
    add_setting_flag(p, DataPlaneConfig, "placement", default_note="none, required")
    p.add_argument("--admin-port", type=int, default=50052, help="port of the admin gRPC API (0 picks one)")
    p.add_argument("--admin-host", default="0.0.0.0", help="address the admin gRPC API binds")
    p.add_argument(
        "--health-port",
        type=int,
        help="also serve grpc.health.v1 alone in plaintext here (Kubernetes probes under TLS)",
    )
    p.add_argument("--interval", type=float, default=5.0, help="seconds between reconcile rounds")
    add_migration_arguments(p)
    add_drift_argument(p)
    add_capacity_argument(p)
    add_health_argument(p)
    add_kube_arguments(p)
    p.set_defaults(run=run)


def add_migration_arguments(parser) -> None:
    parser.add_argument("--max-concurrent-moves", type=int, default=2, help="migrations run at once (default 2)")
    parser.add_argument(
        "--drain-timeout",
        dest="migration_drain_timeout",
        type=float,
        default=60.0,
        help="seconds a migration waits for every router to take a new table before it fails (default 60)",
    )


def add_kube_arguments(parser) -> None:
    parser.add_argument(
        "--kube",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the ExpertMigration and ExpertQuarantine controllers (default: when running in a Kubernetes pod)",
    )
    parser.add_argument("--kube-namespace", help="namespace whose ExpertMigrations it runs (default: the pod's)")
    parser.add_argument(
        "--ray-service",
        default=os.environ.get("EXPERTMESH_RAY_SERVICE") or None,
        help="the KubeRay RayService of the expert groups (in --kube-namespace): `expertmesh groups add|remove` "
        "then add and remove groups as applications of its serveConfigV2 (env EXPERTMESH_RAY_SERVICE; the chart "
        "passes it; default: none, adds and removes are refused)",
    )


def kube_connection(args):
    """The Kubernetes API connection of the ExpertMigration controller, or None: off with --no-kube,
    and by default outside a pod. Unset --kube and no usable service account: a warning, not an
    exit (the rest still works). Made before anything starts, so an explicit --kube fails early."""
    from expertmesh.orchestrator.kube.api import KubeApiError, connect, in_cluster

    if args.kube is False or (args.kube is None and not in_cluster()):
        return None
    try:
        return connect()
    except KubeApiError as err:
        if args.kube:
            raise
        log.warning("not running the ExpertMigration controller: %s", err)
        return None


def run(args) -> int:
    from expertmesh.infra.console import progress
    from expertmesh.models.checkpoint import Checkpoint
    from expertmesh.orchestrator.admin import start_orchestrator
    from expertmesh.orchestrator.control_loop import Manager
    from expertmesh.orchestrator.health.monitor import HealthMonitor
    from expertmesh.orchestrator.kube.api import ExpertMigrationApi
    from expertmesh.orchestrator.kube.controller import start_controller
    from expertmesh.orchestrator.kube.drift_objects import DriftObjects
    from expertmesh.orchestrator.kube.group_objects_controller import start_group_objects_controller
    from expertmesh.orchestrator.kube.quarantine_controller import start_quarantine_controller
    from expertmesh.orchestrator.reconcile import Reconciler, what_runs
    from expertmesh.store import open_store

    config = data_plane_config(args, embedded_default=False)
    if config.placement is None:
        raise InputError("--placement (or EXPERTMESH_PLACEMENT, or placement in --config) is required")
    if config.state_url.startswith("memory://"):
        raise InputError("the orchestrator needs a shared --state-url (redis://host:port/db) that routers also read")
    from expertmesh.infra.telemetry import setup as setup_telemetry

    telemetry = setup_telemetry("expertmesh-orchestrator")
    checkpoint = Checkpoint(config.model)
    spec = checkpoint.spec
    drift_settings = drift_config(args)  # a bad EXPERTMESH_DRIFT_* setting fails here, before anything starts
    capacity_settings = capacity_config(args)  # likewise EXPERTMESH_CAPACITY_*
    health_settings = health_config(args)  # likewise EXPERTMESH_HEALTH_*
    connection = kube_connection(args)
    store = open_store(config.state_url, config.deployment)
    observe, stop_observing = what_runs(store, spec.fingerprint)
    health = HealthMonitor(store, checkpoint, health_settings)
    # given the monitor, a flushed store gets its quarantines back before its table, which lists none of them
    reconciler = Reconciler(store, spec, config.placement, observe=observe, health=health)
    first = reconciler.reconcile_once()  # a bad placement fails here, before we report healthy
    namespace = (args.kube_namespace or connection.namespace) if connection else None

    def reconcile() -> None:
        try:
            table = reconciler.reconcile_once()
        except InputError as err:
            log.error(
                "placement %s is invalid, keeping routing table version %d: %s",
                config.placement,
                store.routing_table_version(),
                err,
            )
            return
        if table is not None:
            progress(f"orchestrator: published routing table version {table.version}")

    launcher = None
    if args.ray_service and connection is not None:
        from expertmesh.orchestrator.kube.groups import KubeRayGroups

        launcher = KubeRayGroups(connection, args.ray_service, store, namespace)
        launcher.service()  # a RayService that is not there, or not ours to read, fails here with one line
    elif args.ray_service:
        log.warning("--ray-service %s without a Kubernetes connection (--kube): no groups added", args.ray_service)
    orchestrator = start_orchestrator(
        store,
        args.admin_host,
        args.admin_port,
        max_concurrent=args.max_concurrent_moves,
        drain_timeout_s=args.migration_drain_timeout,
        drift=drift_settings,
        health=health,
        capacity=capacity_settings,
        # In cluster mode every move drift starts is also an ExpertMigration object.
        on_drift_decision=DriftObjects(ExpertMigrationApi(connection), namespace) if connection else None,
        managers=[Manager("placement", args.interval, reconcile)],
        model_fingerprint=spec.fingerprint,
        launcher=launcher,
    )
    reconciler.use_migrations(orchestrator.runner.submit)  # file edits from now on: live moves, make before break
    port = orchestrator.server.port
    if args.health_port is not None:
        orchestrator.server.serve_plaintext_health(args.health_port)
    kube = start_controller(connection, orchestrator.runner, store, namespace) if connection else None
    quarantines = start_quarantine_controller(connection, health, namespace) if connection else None
    group_objects = None
    if connection is not None and launcher is not None:  # ExpertGroups act through the launcher only
        group_objects = start_group_objects_controller(
            connection, orchestrator.groups, launcher.fixed_groups, namespace
        )
    version = first.version if first else store.routing_table_version()
    progress(f"orchestrator: routing table version {version}; admin gRPC on {args.admin_host}:{port}")
    if launcher is not None:
        progress(
            f"orchestrator: adds and removes expert groups as applications of RayService {args.ray_service} "
            "(and its ExpertGroups)"
        )
    if kube is not None:
        progress(f"orchestrator: running ExpertMigrations of namespace {kube.namespace} (and its ExpertQuarantines)")

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    if quarantines is not None:  # before the monitor closes its group channels
        quarantines.stop()
    if group_objects is not None:  # before the group controller stops its changes
        group_objects.stop()
    orchestrator.stop()
    stop_observing()
    if kube is not None:  # after the runner: the migrations it finished on the way out are reported
        kube.stop()
    store.close()
    telemetry.shutdown()
    return 0
