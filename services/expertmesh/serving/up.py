"""``expertmesh up``: the whole platform in one command.

With no arguments it serves the embedded tiny model: local Ray, 2 expert
groups, the in-process state store, and the Inference API on 127.0.0.1:50051.
It runs until Ctrl-C or SIGTERM, then drains in-flight requests and shuts every
process down.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from expertmesh.config import ServingConfig, add_data_plane_arguments, data_plane_config
from expertmesh.data_plane import DataPlane, progress
from expertmesh.errors import PlacementError
from expertmesh.serving.engine import Engine, EngineLimits
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


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer, or None: then prompts must come as token ids."""
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
    servicer = InferenceServicer(
        engine,
        tokenizer,
        info,
        config,
        lambda: plane.dispatcher.table.version if plane.dispatcher.table else 0,
        plane.dispatcher.load_window,
    )
    return InferenceServer(servicer, engine, config).start()


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
        "--metrics-port",
        type=int,
        default=int(os.environ["EXPERTMESH_METRICS_PORT"]) if os.environ.get("EXPERTMESH_METRICS_PORT") else None,
        help="serve Prometheus metrics on this port (default off; OTLP follows the OTEL_* environment)",
    )
    parser.set_defaults(run=_main)


def _main(args) -> int:
    data_config = data_plane_config(args)
    serving_config = ServingConfig(
        host=args.host,
        port=args.port,
        max_active_sequences=args.max_active,
        max_queued_requests=args.max_queued,
        max_new_tokens_cap=args.max_new_tokens_cap,
        drain_timeout_s=args.drain_timeout,
    )
    telemetry = setup_telemetry("expertmesh-router", prometheus_port=args.metrics_port)
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
    try:
        server = serve_plane(plane, serving_config)
        target = f"{serving_config.host}:{server.port}"
        print(
            f"expertmesh is serving {plane.checkpoint.path.name} on {target} — try: "
            f"expertmesh generate 'Hello' --target {target}   (Ctrl-C to stop)",
            flush=True,
        )
        while not stop.wait(0.5):
            pass
        progress("draining in-flight requests")
        drained = server.drain_and_stop()
        progress("drained" if drained else "drain timeout: remaining requests were cut off")
    finally:
        progress("stopping expert groups and Ray")
        plane.close()
        telemetry.shutdown()
    return 0
