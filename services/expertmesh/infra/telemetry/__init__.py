"""OpenTelemetry for every expertmesh process: traces, metrics, structured logs.

``setup(service_name)`` wires the SDK from the standard ``OTEL_*`` environment
(``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_HEADERS``,
``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``, ``OTEL_SDK_DISABLED``)
plus an optional Prometheus scrape port. With no exporter configured nothing is
installed and the API stays the no-op default, so instrumented code costs
next to nothing.

Trace of one Generate call::

    /expertmesh.v1.Inference/Generate          (gRPC server span)
      expertmesh.request                       (request id, prompt/completion tokens)
        expertmesh.step                        (one per forward pass of this sequence)
          expertmesh.moe_layer                 (layer; waits for the step's other sequences)
            expertmesh.group_call              (layer, group, tokens, bytes, experts hit)
              /expertmesh.v1.ExpertGroup/Dispatch  (client, then server span in the group)
                expertmesh.group.compute

Under continuous batching one sequence's thread sends the layer for everyone;
its group calls link to the other sequences' ``moe_layer`` spans.
"""

from expertmesh.infra.telemetry.setup import (
    TelemetryHandle,
    intercept_client,
    meter,
    propagation_env,
    server_interceptors,
    setup,
    tracer,
)

#: Prometheus names of the metrics a router exports (histograms as their ``_bucket`` series); the
#: Grafana dashboard under deploy/ uses exactly these, and the tests check both sides.
PROMETHEUS_METRICS = frozenset(
    {
        "expertmesh_expert_tokens_total",
        "expertmesh_layer_balancedness",
        "expertmesh_layer_routing_entropy_bits",
        "expertmesh_group_call_duration_seconds_bucket",
        "expertmesh_group_queue_depth",
        "expertmesh_request_duration_seconds_bucket",
        "expertmesh_time_to_first_token_seconds_bucket",
        "expertmesh_inter_token_latency_seconds_bucket",
        "expertmesh_active_parameters_per_token",
        "expertmesh_errors_total",
        "expertmesh_group_circuit_open",
        "expertmesh_request_queue_time_seconds_bucket",
        "expertmesh_engine_step_duration_seconds_bucket",
        "expertmesh_engine_step_tokens_bucket",
        "expertmesh_kv_blocks_capacity",
        "expertmesh_kv_blocks_used",
        "expertmesh_kv_usage",
        "expertmesh_kv_fragmentation",
        "expertmesh_kv_preemptions_total",
        "expertmesh_kv_prefix_cache_queries_total",
        "expertmesh_kv_prefix_cache_hits_total",
        "expertmesh_kv_cache_config_info",
        "expertmesh_requests_waiting",
        "expertmesh_requests_running",
        "expertmesh_gate_top1_probability_bucket",
        "expertmesh_gate_top2_margin_bucket",
        "expertmesh_router_weights_changed",
        "expertmesh_gate_duration_seconds_bucket",
        "expertmesh_routing_transitions_total",
        "expertmesh_routing_oscillations_total",
        "expertmesh_routing_experts_per_token_bucket",
        "expertmesh_anomaly_active",
        "expertmesh_anomalies_total",
    }
)

#: Prometheus names of the orchestrator's metrics on the dashboard: the health monitor's gauges
#: (``orchestrator.health.monitor``), exported over OTLP.
ORCHESTRATOR_PROMETHEUS_METRICS = frozenset({"expertmesh_expert_health", "expertmesh_expert_kl"})

__all__ = [
    "ORCHESTRATOR_PROMETHEUS_METRICS",
    "PROMETHEUS_METRICS",
    "TelemetryHandle",
    "intercept_client",
    "meter",
    "propagation_env",
    "server_interceptors",
    "setup",
    "tracer",
]
