"""A minimal OTLP/gRPC receiver (the collector's trace and metrics services from
opentelemetry-proto) on loopback: it keeps what it receives. The dispatch
benchmark exports to it to measure tracing on against off with the real
exporters; the tests read the spans and metrics back from it."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class OtlpSink(trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer):
    #: (service.name, Span) in arrival order
    spans: list = field(default_factory=list)
    #: ExportMetricsServiceRequest in arrival order
    metrics: list = field(default_factory=list)
    port: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: grpc.Server | None = None

    def Export(self, request, context):
        with self._lock:
            if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
                for rs in request.resource_spans:
                    service = next(
                        (a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), ""
                    )
                    self.spans.extend((service, s) for ss in rs.scope_spans for s in ss.spans)
                return trace_service_pb2.ExportTraceServiceResponse()
            self.metrics.append(request)
            return metrics_service_pb2.ExportMetricsServiceResponse()

    def start(self, host: str = "127.0.0.1") -> "OtlpSink":
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port(f"{host}:0")
        self._server.start()
        return self

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0)
