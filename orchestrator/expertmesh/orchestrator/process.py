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
from pathlib import Path

from expertmesh.errors import PlacementError
from expertmesh.grpc_server import GrpcServer

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
    server = GrpcServer("admin", args.admin_host, args.admin_port).start()
    port = server.port
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
    server.set_serving(False)
    server.stop()
    store.close()
    telemetry.shutdown()
    return 0
