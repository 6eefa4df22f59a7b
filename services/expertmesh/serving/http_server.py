"""The HTTP API's server: uvicorn on its own thread and event loop, in the router process.

The socket is bound in the caller's thread, so a taken port fails ``expertmesh up``
at start and port 0 is known at once. TLS follows ``EXPERTMESH_TLS_*`` as the gRPC
server does: HTTPS with the same certificate, and client certificates required when
``require_client_cert`` is set. Uvicorn's signal handling and logging set-up stay
off: ``expertmesh up`` owns SIGTERM and drains both APIs together (``stop`` lets
open responses finish for up to ``graceful_s``).
"""

from __future__ import annotations

import socket
import ssl
import threading
import time

import uvicorn
from starlette.types import ASGIApp

from expertmesh.config.settings import TlsConfig
from expertmesh.infra.security import from_env


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as err:
        raise OSError(f"cannot bind the HTTP API to {host}:{port}: {err}") from None


def _tls_options(tls: TlsConfig) -> dict:
    if not tls.serves_tls:
        return {}
    return {
        "ssl_certfile": str(tls.cert_file),
        "ssl_keyfile": str(tls.key_file),
        "ssl_ca_certs": str(tls.ca_file) if tls.ca_file else None,
        "ssl_cert_reqs": ssl.CERT_REQUIRED if tls.require_client_cert else ssl.CERT_NONE,
    }


class HttpServer:
    def __init__(self, app: ASGIApp, host: str, port: int, *, tls: TlsConfig | None = None, graceful_s: int = 5):
        tls = tls if tls is not None else from_env(TlsConfig)
        self._socket = _bind(host, port)
        self.port: int = self._socket.getsockname()[1]
        self.url = f"{'https' if tls.serves_tls else 'http'}://{host}:{self.port}"
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=graceful_s,
            **_tls_options(tls),
        )
        try:
            config.load()  # unreadable certificate files fail here, in the caller's thread
        except (OSError, ssl.SSLError):
            self._socket.close()
            raise
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="expertmesh-http", daemon=True
        )

    def start(self, timeout_s: float = 30.0) -> HttpServer:
        self._thread.start()
        end = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                raise OSError(f"the HTTP API did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop accepting connections, let open responses finish (up to ``graceful_s``), then stop."""
        self._server.should_exit = True
        self._thread.join()
        self._socket.close()
