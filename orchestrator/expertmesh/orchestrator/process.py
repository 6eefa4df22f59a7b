"""``expertmesh orchestrator``: the control-plane process.

Reconciles the routing table with the placement file every few seconds and
serves the admin gRPC port (``grpc.health.v1`` now; the admin API of later
issues lands on the same server). A bad placement at start-up is refused with
one line; a bad edit later is logged and the last good table stays.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from expertmesh.errors import PlacementError

log = logging.getLogger(__name__)


def add_command(commands) -> None:
    p = commands.add_parser("orchestrator", help="run the orchestrator: keep the routing table equal to the placement")
    p.add_argument("--state-url", default=os.environ.get("EXPERTMESH_STATE_URL"), help="redis://host:port/db")
    p.add_argument("--model", required=True, type=Path, help="checkpoint directory (for its MoE shape)")
    p.add_argument("--placement", required=True, type=Path, help="placement YAML (re-read every --interval)")
    p.add_argument("--admin-port", type=int, default=50052)
    p.add_argument("--admin-host", default="0.0.0.0")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between reconcile rounds")
    p.set_defaults(run=run)


def start_admin_server(host: str, port: int):
    """Returns (server, bound port, health servicer)."""
    from expertmesh.telemetry import server_interceptors

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=server_interceptors())
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the admin gRPC server to {host}:{port}")
    server.start()
    return server, bound, health_servicer


def run(args) -> int:
    from expertmesh.checkpoint import Checkpoint
    from expertmesh.data_plane import progress
    from expertmesh.orchestrator.reconcile import Reconciler
    from expertmesh.state import open_store

    if not args.state_url or args.state_url.startswith("memory://"):
        raise PlacementError("the orchestrator needs a shared --state-url (redis://host:port/db) that routers also read")
    from expertmesh.telemetry import setup as setup_telemetry

    telemetry = setup_telemetry("expertmesh-orchestrator")
    spec = Checkpoint(args.model).spec
    store = open_store(args.state_url)
    reconciler = Reconciler(store, spec, args.placement)
    first = reconciler.reconcile_once()  # a bad placement fails here, before we report healthy
    server, port, health_servicer = start_admin_server(args.admin_host, args.admin_port)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    version = first.version if first else store.routing_table_version()
    progress(f"orchestrator: routing table version {version}; admin gRPC on {args.admin_host}:{port}")

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(args.interval):
        try:
            table = reconciler.reconcile_once()
        except PlacementError as err:
            log.error("placement %s is invalid, keeping routing table version %d: %s", args.placement, store.routing_table_version(), err)
            continue
        if table is not None:
            progress(f"orchestrator: published routing table version {table.version}")
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    server.stop(grace=2).wait()
    store.close()
    telemetry.shutdown()
    return 0
