"""Installing the OpenTelemetry SDK for one process (see the package docstring)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from opentelemetry import metrics, trace

log = logging.getLogger(__name__)

INSTRUMENTATION = "expertmesh"
_tracing = False  # set when this process exports traces: only then are gRPC interceptors worth adding


def tracer():
    return trace.get_tracer(INSTRUMENTATION)


def meter():
    return metrics.get_meter(INSTRUMENTATION)


def tracing_enabled() -> bool:
    return _tracing


def server_interceptors() -> list:
    """gRPC server interceptors: OpenTelemetry's, which continue the caller's trace, when tracing is on."""
    if not _tracing:
        return []
    from opentelemetry.instrumentation.grpc import server_interceptor

    return [server_interceptor()]


def intercept_client(channel):
    """A channel that sends the current trace context in gRPC metadata, when tracing is on."""
    if not _tracing:
        return channel
    from opentelemetry.instrumentation.grpc import client_interceptor
    from opentelemetry.instrumentation.grpc.grpcext import intercept_channel

    return intercept_channel(channel, client_interceptor())


def _otlp_configured() -> bool:
    return any(
        os.environ.get(name)
        for name in (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
        )
    )


def propagation_env() -> dict[str, str]:
    """The OTEL_* settings of this process, for the expert-group replicas it starts."""
    return {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}


@dataclass
class TelemetryHandle:
    """What ``setup`` installed; ``shutdown`` flushes and stops exporters."""

    providers: list = field(default_factory=list)
    prometheus_port: int | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.providers)

    def shutdown(self) -> None:
        for provider in self.providers:
            provider.shutdown()


def setup(service_name: str, prometheus_port: int | None = None, prometheus: bool = False) -> TelemetryHandle:
    """Install tracer and meter providers when an exporter is configured; else leave the no-op API.

    ``prometheus_port`` serves Prometheus metrics on a port of their own; ``prometheus`` only fills
    prometheus_client's registry, for a server that exposes it itself (the HTTP API's ``/metrics``).
    """
    handle = TelemetryHandle()
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return handle
    otlp = _otlp_configured()
    if not otlp and prometheus_port is None and not prometheus:
        return handle

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider

    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", service_name)})
    readers = []
    if otlp:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        # The sampler comes from OTEL_TRACES_SAMPLER(_ARG) through the SDK's own defaults.
        global _tracing
        tracer_provider = TracerProvider(resource=resource)
        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(tracer_provider)
        _tracing = True
        handle.providers.append(tracer_provider)
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    if prometheus_port is not None or prometheus:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader

        if prometheus_port is not None:
            from prometheus_client import start_http_server

            server, _ = start_http_server(prometheus_port, addr="0.0.0.0")
            handle.prometheus_port = server.server_port
        readers.append(PrometheusMetricReader())
    meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    metrics.set_meter_provider(meter_provider)
    handle.providers.append(meter_provider)
    log.info("telemetry for %s: otlp=%s prometheus=%s", service_name, otlp, handle.prometheus_port)
    return handle
