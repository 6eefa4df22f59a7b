"""The gRPC server every expertmesh process runs: thread pool, OpenTelemetry
interceptors when tracing is on, the admin-authorisation and request-parsing
interceptors, the standard ``grpc.health.v1`` service, TLS when
``EXPERTMESH_TLS_*`` says so (``expertmesh.infra.security``), and a bind that fails
loudly (also when another process holds the port)."""

from __future__ import annotations

import functools
import logging
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from expertmesh.config.settings import AdminAuthConfig, TlsConfig
from expertmesh.contracts.errors import ExpertMeshError
from expertmesh.infra.grpc_interceptors import ParseErrorsAsInvalidArgument
from expertmesh.infra.security import from_env
from expertmesh.infra.security.admin_auth import AdminAuthInterceptor, AdminPolicy
from expertmesh.infra.security.tls import server_credentials
from expertmesh.infra.telemetry.setup import server_interceptors

log = logging.getLogger(__name__)


def guarded(handler):
    """A unary servicer method whose ExpertMeshError becomes the matching gRPC status; anything
    else is INTERNAL, logged: a bad request or a bug must not take the server down."""

    @functools.wraps(handler)
    def wrapped(self, request, context):
        try:
            return handler(self, request, context)
        except ExpertMeshError as err:
            context.abort(err.code, str(err))
        except Exception as err:
            log.exception("%s failed", handler.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")

    return wrapped


def _bind(server: grpc.Server, what: str, address: str, credentials: grpc.ServerCredentials | None) -> int:
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as err:  # recent grpcio raises; older ones return 0
        raise OSError(f"cannot bind the {what} gRPC server to {address}: {err}") from None
    if port == 0:
        raise OSError(f"cannot bind the {what} gRPC server to {address}")
    return port


class GrpcServer:
    """``tls`` and ``admin`` default to the environment's settings; ``require_client_cert`` makes
    this server demand a client certificate whenever it serves TLS (expert groups: mutual TLS)."""

    def __init__(
        self,
        what: str,
        host: str,
        port: int,
        workers: int = 4,
        options: list[tuple[str, int]] | None = None,
        maximum_concurrent_rpcs: int | None = None,
        *,
        tls: TlsConfig | None = None,
        admin: AdminAuthConfig | None = None,
        require_client_cert: bool = False,
    ):
        tls = tls if tls is not None else from_env(TlsConfig)
        admin = admin if admin is not None else from_env(AdminAuthConfig)
        self.what = what
        self.host = host
        credentials = (
            server_credentials(tls, require_client_cert or tls.require_client_cert) if tls.serves_tls else None
        )
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"expertmesh-{what}"),
            # gRPC sets SO_REUSEPORT by default: a second server on a taken port would start "fine"
            # and silently take half the connections. A taken port must be an error instead.
            options=[("grpc.so_reuseport", 0), *(options or [])],
            # Outermost first: tracing, then the admin guard, then request parsing.
            interceptors=[
                *server_interceptors(),
                AdminAuthInterceptor(AdminPolicy.from_config(admin)),
                ParseErrorsAsInvalidArgument(),
            ],
            maximum_concurrent_rpcs=maximum_concurrent_rpcs,
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = _bind(self.server, what, f"{host}:{port}", credentials)
        self._credentials = credentials
        self._health_server: grpc.Server | None = None

    def add_unix_port(self, path: str) -> str:
        """Also listen on the unix socket ``path``, with the same credentials (TLS stays on where it is
        on); returns the "unix:" address to dial. Before ``start``."""
        address = f"unix:{path}"
        _bind(self.server, self.what, address, self._credentials)
        return address

    def serve_plaintext_health(self, port: int) -> int:
        """Also serve this server's ``grpc.health.v1`` status, and nothing else, in plaintext on
        ``port`` (0 picks one); returns the bound port. Kubernetes' gRPC probes cannot speak TLS."""
        self._health_server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"expertmesh-{self.what}-health"),
            options=[("grpc.so_reuseport", 0)],
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
        bound = _bind(self._health_server, f"{self.what} health", f"{self.host}:{port}", None)
        self._health_server.start()
        return bound

    def start(self, services: tuple[str, ...] = (), serving: bool = True) -> "GrpcServer":
        """Start serving and report SERVING for the server ("") and ``services`` (NOT_SERVING with ``serving``
        False, until ``set_serving``: a router warming up)."""
        self.server.start()
        self.set_serving(serving, services)
        return self

    def set_serving(self, serving: bool, services: tuple[str, ...] = ()) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *services):
            self.health.set(name, status)

    def stop(self, grace: float = 2.0) -> None:
        if self._health_server is not None:
            self._health_server.stop(grace=0)
        self.server.stop(grace=grace).wait()
