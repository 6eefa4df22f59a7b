"""gRPC credentials from a ``TlsConfig``: how every expertmesh server binds and
every channel is opened, so no code path can quietly stay plaintext when
certificates are configured, and none needs them when they are not."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import grpc

from expertmesh.config.settings import TlsConfig
from expertmesh.contracts.errors import SecurityMisconfigured
from expertmesh.infra.security import from_env

ChannelOptions = Sequence[tuple[str, int | str]]


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise SecurityMisconfigured(f"cannot read the TLS {what} {path}: {err.strerror or err}") from None


def server_credentials(tls: TlsConfig, require_client_cert: bool) -> grpc.ServerCredentials:
    """Credentials of a server presenting ``tls.cert_file``; with ``require_client_cert`` it accepts
    only clients whose certificate chains to ``tls.ca_file`` (mutual TLS)."""
    if tls.cert_file is None or tls.key_file is None:
        raise SecurityMisconfigured("a TLS server needs EXPERTMESH_TLS_CERT_FILE and EXPERTMESH_TLS_KEY_FILE")
    if require_client_cert and tls.ca_file is None:
        raise SecurityMisconfigured(
            "this server requires client certificates (mutual TLS): "
            "set EXPERTMESH_TLS_CA_FILE to the CA that signs them"
        )
    return grpc.ssl_server_credentials(
        [(_read(tls.key_file, "private key"), _read(tls.cert_file, "certificate"))],
        root_certificates=_read(tls.ca_file, "CA bundle") if require_client_cert else None,
        require_client_auth=require_client_cert,
    )


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """Credentials of a client that verifies servers against ``tls.ca_file`` (system roots when unset)
    and presents ``tls.cert_file`` when set."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca_file, "CA bundle") if tls.ca_file else None,
        private_key=_read(tls.key_file, "private key") if tls.key_file else None,
        certificate_chain=_read(tls.cert_file, "certificate") if tls.cert_file else None,
    )


def secure_or_insecure_channel(
    address: str,
    options: ChannelOptions = (),
    *,
    tls: TlsConfig | None = None,
    server_name: str | None = None,
    aio: bool = False,
):
    """A channel to ``address``: TLS when ``tls`` (default: the environment's) has a CA or a client
    certificate, else plaintext. ``server_name`` is the name to verify in the server's certificate
    instead of the host in ``address`` (expert groups are dialled by IP). ``aio``: a grpc.aio channel."""
    tls = tls if tls is not None else from_env(TlsConfig)
    module = grpc.aio if aio else grpc
    if not tls.dials_tls:
        return module.insecure_channel(address, options=list(options))
    if server_name:
        options = [*options, ("grpc.ssl_target_name_override", server_name)]
    return module.secure_channel(address, channel_credentials(tls), options=list(options))
