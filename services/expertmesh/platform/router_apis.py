"""A router's public APIs over a running data plane: the gRPC Inference API and, with
``ServingConfig.http_port``, the OpenAI-compatible HTTP API beside it, both over one engine.
``expertmesh up`` (``cli.up``) starts them; benchmarks and tests call ``serve_plane``."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from expertmesh.config.settings import ServingConfig
from expertmesh.infra.console import progress
from expertmesh.infra.cpu_threads import router_threads_here
from expertmesh.platform.data_plane import DataPlane
from expertmesh.router.policy.profiles import ProfileFileError, fit_problem, read_profiles_file, save_profiles
from expertmesh.router.reporting.anomaly import BaselineConfig
from expertmesh.router.reporting.anomaly_monitor import AnomalyMonitor
from expertmesh.router.reporting.anomaly_publisher import AnomalyPublisher
from expertmesh.router.reporting.metrics import register_router_metrics
from expertmesh.serving.engine import Engine, EngineLimits
from expertmesh.serving.kv_metrics import register_kv_metrics
from expertmesh.serving.protocol_metrics import register_protocol_metrics
from expertmesh.serving.readiness import Readiness
from expertmesh.serving.request_routing import RequestRouter
from expertmesh.serving.service import InferenceServer, InferenceServicer, guard_default
from expertmesh.v1 import inference_pb2 as pb

if TYPE_CHECKING:
    from expertmesh.serving.http_server import HttpServer


def model_info(plane: DataPlane) -> pb.ModelInfo:
    spec = plane.checkpoint.spec
    text = plane.checkpoint.config.get_text_config()
    return pb.ModelInfo(
        name=plane.config.model_name or plane.checkpoint.path.name,
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
    """Start the Inference API over a running data plane (first loading ``config.profiles`` into its store)."""
    plane.watcher.refresh()  # load the routing table now: a missing one fails at start, not at the first request
    info = model_info(plane)
    if config.profiles is not None:
        _load_profiles_file(plane, config.profiles, tuple(info.moe_layers), info.num_experts)
    register_router_metrics(plane.dispatcher, info.dense_parameters, info.parameters_per_expert)
    tokenizer = load_tokenizer(plane.checkpoint.path)
    # health_round: anomaly records to the store, for the health monitor (a daemon thread that sleeps between them)
    publisher = AnomalyPublisher(plane.store).start() if "health_round" in config.anomaly_action else None
    engine = Engine(
        plane.model,
        tokenizer,
        plane.dispatcher,
        EngineLimits(
            config.max_active_sequences,
            config.max_queued_requests,
            max_step_tokens=config.max_step_tokens,
            kv_cache_bytes=config.kv_cache_bytes or None,
            kv_block_size=config.kv_block_size,
            prefix_caching=config.prefix_caching,
            serial_step_tokens=config.serial_step_tokens,
            wide_threads=router_threads_here(plane.config.router_threads),
        ),
        max_context=info.max_context,
        model_fingerprint=plane.checkpoint.spec.fingerprint,
        warm_up=plane.config.warm_up,
        anomalies=AnomalyMonitor(
            plane.dispatcher.gate_bias,
            BaselineConfig(sigma=config.anomaly_sigma),
            config.anomaly_action,
            load=plane.dispatcher.load_window,
            publish=publisher.submit if publisher is not None else None,
        ),
    )
    register_kv_metrics(engine.kv_usage, info.name)
    register_protocol_metrics(engine.load, engine.kv_usage, info.name)
    info.batching = pb.BATCHING_PACKED if engine.batching.packed else pb.BATCHING_PER_SEQUENCE
    info.batching_note = engine.batching.note
    servicer = InferenceServicer(
        engine,
        tokenizer,
        info,
        config,
        lambda: plane.watcher.version or 0,
        plane.dispatcher.load_window,
        plane.dispatcher.transports,
        RequestRouter(
            info.top_k,
            info.num_experts,
            tuple(info.moe_layers),
            config.routing_policy,
            plane.store,
            config.policy_kl_bound,
            guard_default=guard_default(config, info.top_k),
            domain_policies=config.domain_routing_policies,
        ),
    )
    server = InferenceServer(servicer, engine, config)
    # the router's weights changed since load: NOT_SERVING for the gRPC probes too, as /health says
    plane.weights.on_change.append(
        lambda check: server.set_unfit(f"weights changed: {', '.join(check.changed)}" if check.changed else None)
    )
    return server.start()


def _load_profiles_file(plane: DataPlane, path: Path, moe_layers: tuple[int, ...], num_experts: int) -> None:
    """Put the capability profiles of ``path`` (``expertmesh profile build --out``) into the plane's store,
    where the router's prefer / restrict policies read them: the way to profiles on an in-process store."""
    profiles = read_profiles_file(path)
    problem = fit_problem(profiles, moe_layers, num_experts)
    if problem:
        raise ProfileFileError(f"profiles file {path}: {problem}; rebuild it with `expertmesh profile build --out`")
    save_profiles(plane.store, profiles)
    progress(f"loaded {len(profiles)} capability profiles from {path} ({', '.join(sorted(profiles))})")


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
    # Only a router that serves HTTP loads its packages (starlette, uvicorn): the GPU machine's
    # benchmark runs the gRPC API without them.
    from expertmesh.serving.http_api import HttpApi
    from expertmesh.serving.http_server import HttpServer
    from expertmesh.serving.openai_adapter import OpenAIAdapter, ServedModel

    info = model_info(plane)
    readiness = Readiness(plane.watcher, server.engine, weights=plane.weights)
    model = ServedModel(info.name, info.vocab_size, info.max_context, len(info.moe_layers))
    adapter = OpenAIAdapter(server.engine, load_tokenizer(plane.checkpoint.path), model, config, server.routing)
    try:
        http = HttpServer(HttpApi(adapter, readiness, config).app, config.host, config.http_port).start()
    except BaseException:
        server.drain_and_stop()
        readiness.close()
        raise
    return RouterApis(server, http, readiness)
