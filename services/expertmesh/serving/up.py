"""``expertmesh up``: the whole platform in one command.

With no arguments it serves the embedded tiny model: local Ray, 2 expert
groups, the in-process state store, and the Inference API on 127.0.0.1:50051
(with ``--http-port``, the OpenAI-compatible HTTP API beside it).
It runs until Ctrl-C or SIGTERM, then drains in-flight requests and shuts every
process down.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

from expertmesh.config import ServingConfig, add_data_plane_arguments, data_plane_config
from expertmesh.data_plane import DataPlane, progress
from expertmesh.errors import PlacementError
from expertmesh.serving.engine import Engine, EngineLimits
from expertmesh.serving.http_api import HttpApi
from expertmesh.serving.http_server import HttpServer
from expertmesh.serving.openai_adapter import OpenAIAdapter, ServedModel
from expertmesh.serving.readiness import Readiness
from expertmesh.serving.service import InferenceServer, InferenceServicer
from expertmesh.telemetry import setup as setup_telemetry
from expertmesh.telemetry.router_metrics import register_router_metrics
from expertmesh.v1 import inference_pb2 as pb


def model_info(plane: DataPlane) -> pb.ModelInfo:
    spec = plane.checkpoint.spec
    text = plane.checkpoint.config.get_text_config()
    return pb.ModelInfo(
        name=plane.checkpoint.path.name,
        architecture=spec.model_type,
        num_layers=spec.num_layers,
        moe_layers=list(spec.moe_layers),
        num_experts=spec.num_experts,
        top_k=spec.top_k,
        hidden_size=spec.hidden_size,
        vocab_size=text.vocab_size,
        max_context=spec.max_context or 0,
        groups=sorted(plane.placement.groups),
        dtype=plane.config.dtype,
        total_parameters=plane.checkpoint.total_parameters,
        dense_parameters=plane.checkpoint.total_parameters
        - plane.checkpoint.parameters_per_expert * spec.num_experts * len(spec.moe_layers),
        parameters_per_expert=plane.checkpoint.parameters_per_expert,
    )


@functools.cache
def load_tokenizer(path: Path):
    """The checkpoint's tokenizer, or None: then prompts must come as token ids.
    Loaded once per path: a router's gRPC and HTTP APIs share it."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError):
        progress(f"{path} has no tokenizer: prompts must be sent as token ids")
        return None


def serve_plane(plane: DataPlane, config: ServingConfig) -> InferenceServer:
    """Start the Inference API over a running data plane."""
    plane.dispatcher.refresh()  # load the routing table now: a missing one fails at start, not at the first request
    info = model_info(plane)
    register_router_metrics(plane.dispatcher, info.dense_parameters, info.parameters_per_expert)
    tokenizer = load_tokenizer(plane.checkpoint.path)
    engine = Engine(
        plane.model,
        tokenizer,
        plane.dispatcher,
        EngineLimits(config.max_active_sequences, config.max_queued_requests),
        max_context=info.max_context,
    )
    info.batching = pb.BATCHING_PACKED if engine.batching.packed else pb.BATCHING_PER_SEQUENCE
    info.batching_note = engine.batching.note
    servicer = InferenceServicer(
        engine,
        tokenizer,
        info,
        config,
        lambda: plane.dispatcher.table.version if plane.dispatcher.table else 0,
        plane.dispatcher.load_window,
        plane.dispatcher.transports,
    )
    return InferenceServer(servicer, engine, config).start()


@dataclass
class RouterApis:
    """A router's public APIs over its one engine: gRPC always, the OpenAI-compatible HTTP API with
    ``ServingConfig.http_port``."""

    grpc: InferenceServer
    http: HttpServer | None = None
    readiness: Readiness | None = None

    def drain_and_stop(self) -> bool:
        """Both APIs refuse new requests (and /health turns 503) while in-flight ones, gRPC and HTTP
        streams alike, finish; then both stop. True if all finished within the drain timeout."""
        if self.readiness is not None:
            self.readiness.draining = True
        drained = self.grpc.drain_and_stop()
        if self.http is not None:
            self.http.stop()
        if self.readiness is not None:
            self.readiness.close()
        return drained


def start_apis(plane: DataPlane, config: ServingConfig) -> RouterApis:
    """Start the gRPC Inference API and, when ``config.http_port`` is set, the HTTP API beside it."""
    server = serve_plane(plane, config)
    if config.http_port is None:
        return RouterApis(server)
    info = model_info(plane)
    readiness = Readiness(plane.store, plane.dispatcher, server.engine)
    model = ServedModel(info.name, info.vocab_size, info.max_context)
    adapter = OpenAIAdapter(server.engine, load_tokenizer(plane.checkpoint.path), model, config)
    try:
        http = HttpServer(HttpApi(adapter, readiness, config).app, config.host, config.http_port).start()
    except BaseException:
        server.drain_and_stop()
        readiness.close()
        raise
    return RouterApis(server, http, readiness)


def add_command(commands) -> None:
    parser = commands.add_parser("up", help="run the platform: expert groups, router and the Inference gRPC API")
    add_data_plane_arguments(parser)
    parser.add_argument(
        "--router-only",
        action="store_true",
        help="serve only the router: groups and routing table come from --state-url (as in Kubernetes)",
    )
    parser.add_argument("--wait-for-table", type=float, default=300.0, help="--router-only: seconds to wait for a routing table")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--max-active", type=int, default=32, help="sequences decoded together")
    parser.add_argument("--max-queued", type=int, default=128, help="requests that may wait for a slot")
    parser.add_argument("--max-new-tokens-cap", type=int, default=1024)
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    parser.add_argument(
        "--health-port", type=int, help="also serve grpc.health.v1 alone in plaintext here (Kubernetes probes under TLS)"
    )
    parser.add_argument(
        "--http-port",
        type=int,
        help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models), "
        "/health and /metrics on this port (0 picks one; default off, or EXPERTMESH_HTTP_PORT)",
    )
    parser.add_argument(
        "--orchestrator",
        action="store_true",
        help="also run the orchestrator's admin API in this process (live migrations: `expertmesh migrate`)",
    )
    parser.add_argument("--admin-port", type=int, default=50052, help="--orchestrator: admin gRPC port (0 picks one)")
    try:
        from expertmesh.orchestrator.drift.config import add_drift_argument
        from expertmesh.orchestrator.health.config import add_health_argument
    except ImportError:  # a data-plane-only install has no orchestrator
        pass
    else:
        add_drift_argument(parser)
        add_health_argument(parser)
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ["EXPERTMESH_METRICS_PORT"]) if os.environ.get("EXPERTMESH_METRICS_PORT") else None,
        help="serve Prometheus metrics on this port (default off; OTLP follows the OTEL_* environment)",
    )
    parser.set_defaults(run=_main)


def _main(args) -> int:
    data_config = data_plane_config(args)
    if args.orchestrator:
        from expertmesh.orchestrator.drift.config import drift_config

        from expertmesh.orchestrator.health.config import health_config

        drift = drift_config(args)  # a bad EXPERTMESH_DRIFT_* setting fails here, before anything starts
        health_settings = health_config(args)  # likewise EXPERTMESH_HEALTH_*
    elif getattr(args, "drift", None):
        raise PlacementError("--drift runs in the orchestrator: add --orchestrator")
    elif getattr(args, "health_monitor", None):
        raise PlacementError("--health-monitor runs in the orchestrator: add --orchestrator")
    serving_config = ServingConfig(
        host=args.host,
        port=args.port,
        max_active_sequences=args.max_active,
        max_queued_requests=args.max_queued,
        max_new_tokens_cap=args.max_new_tokens_cap,
        drain_timeout_s=args.drain_timeout,
        health_port=args.health_port,
        **({} if args.http_port is None else {"http_port": args.http_port}),
    )
    telemetry = setup_telemetry(
        "expertmesh-router", prometheus_port=args.metrics_port, prometheus=serving_config.http_port is not None
    )
    if telemetry.prometheus_port is not None:
        progress(f"Prometheus metrics on :{telemetry.prometheus_port}/metrics")
    if args.router_only:
        if data_config.state_url.startswith("memory://"):
            raise PlacementError("--router-only needs a shared --state-url (redis://host:port/db) with a routing table")
        plane = DataPlane.attach(data_config, wait_s=args.wait_for_table)
    else:
        plane = DataPlane.start(data_config)
    # After Ray's start: its core worker installs a SIGTERM handler of its own that would exit without draining.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    orchestrator = None
    try:
        if args.orchestrator:
            from expertmesh.orchestrator.admin import start_orchestrator
            from expertmesh.orchestrator.health.monitor import HealthMonitor

            monitor = HealthMonitor(plane.store, plane.checkpoint, health_settings)
            orchestrator = start_orchestrator(plane.store, serving_config.host, args.admin_port, drift=drift, health=monitor)
            progress(f"orchestrator admin gRPC on {serving_config.host}:{orchestrator.server.port}")
        apis = start_apis(plane, serving_config)
        if apis.http is not None:
            progress(f"OpenAI-compatible HTTP API on {apis.http.url}/v1 (also /health, /metrics)")
        target = f"{serving_config.host}:{apis.grpc.port}"
        print(
            f"expertmesh is serving {plane.checkpoint.path.name} on {target} — try: "
            f"expertmesh generate 'Hello' --target {target}   (Ctrl-C to stop)",
            flush=True,
        )
        while not stop.wait(0.5):
            pass
        progress("draining in-flight requests")
        drained = apis.drain_and_stop()
        progress("drained" if drained else "drain timeout: remaining requests were cut off")
    finally:
        if orchestrator is not None:
            orchestrator.stop()
        progress("stopping expert groups and Ray")
        plane.close()
        telemetry.shutdown()
    return 0
