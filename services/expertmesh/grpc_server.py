"""The gRPC server every expertmesh process runs: thread pool, OpenTelemetry
interceptors when tracing is on, the standard ``grpc.health.v1`` service, and a
bind that fails loudly (also when another process holds the port)."""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from expertmesh.telemetry.setup import server_interceptors


class GrpcServer:
    def __init__(
        self,
        what: str,
        host: str,
        port: int,
        workers: int = 4,
        options: list[tuple[str, int]] | None = None,
        maximum_concurrent_rpcs: int | None = None,
    ):
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"expertmesh-{what}"),
            # gRPC sets SO_REUSEPORT by default: a second server on a taken port would start "fine"
            # and silently take half the connections. A taken port must be an error instead.
            options=[("grpc.so_reuseport", 0), *(options or [])],
            interceptors=server_interceptors(),
            maximum_concurrent_rpcs=maximum_concurrent_rpcs,
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        try:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as err:  # recent grpcio raises; older ones return 0
            raise OSError(f"cannot bind the {what} gRPC server to {host}:{port}: {err}") from None
        if self.port == 0:
            raise OSError(f"cannot bind the {what} gRPC server to {host}:{port}")

    def start(self, services: tuple[str, ...] = ()) -> "GrpcServer":
        """Start serving and report SERVING for the server ("") and ``services``."""
        self.server.start()
        self.set_serving(True, services)
        return self

    def set_serving(self, serving: bool, services: tuple[str, ...] = ()) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *services):
            self.health.set(name, status)

    def stop(self, grace: float = 2.0) -> None:
        self.server.stop(grace=grace).wait()
