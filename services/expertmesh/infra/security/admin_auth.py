"""Admin RPCs need an authorised identity; data-plane RPCs do not.

``AdminAuthInterceptor`` is a gRPC server interceptor (every ``GrpcServer``
installs one) that guards the methods in ``ADMIN_METHODS`` by name prefix, so
an admin service is covered as soon as it is registered, without touching its
handlers. It runs before the request is parsed: an unauthorised caller learns
nothing from how its request bytes are read. A guarded call is checked in this order:

1. a bearer token (``authorization: Bearer <token>`` metadata) equal to the
   configured admin token: allowed;
2. over mutual TLS, a client certificate whose subject CN is allowed: allowed;
3. otherwise refused: PERMISSION_DENIED for an identity that was presented but
   is not an admin's (a wrong token, an unlisted certificate CN),
   UNAUTHENTICATED when none was presented.

With no token and no allowed CN configured (the embedded default, ``make
run``), guarded calls are accepted from loopback peers only: whoever can reach
a loopback port already runs on the machine, and anything further away is
refused with a message saying what to configure.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from typing import Sequence

import grpc

from expertmesh.config.settings import AdminAuthConfig
from expertmesh.contracts.errors import SecurityMisconfigured
from expertmesh.infra.grpc_interceptors import rewrap
from expertmesh.infra.security import from_env

#: Full method names (or service prefixes) of admin RPCs on any expertmesh server.
ADMIN_METHODS = (
    "/expertmesh.v1.ExpertGroup/LoadExperts",
    "/expertmesh.v1.ExpertGroup/UnloadExperts",
    # reads every weight byte the group holds: an orchestrator's check, not a data-plane call
    "/expertmesh.v1.ExpertGroup/Fingerprint",
    # overwrites weights (test-only, and refused anyway unless the group enables it)
    "/expertmesh.v1.ExpertGroup/InjectFault",
    "/expertmesh.v1.Admin/",
    # a router's own: its canary of the default routing policy
    "/expertmesh.v1.RouterAdmin/",
)
_BEARER = "bearer "


@dataclass(frozen=True)
class AdminPolicy:
    """Resolved admin identities: the token (None: tokens are not accepted) and the allowed CNs."""

    token: str | None
    allowed_cns: frozenset[str]

    @classmethod
    def from_config(cls, config: AdminAuthConfig) -> "AdminPolicy":
        return cls(admin_token(config), frozenset(config.allowed_cns))

    @property
    def loopback_only(self) -> bool:
        return self.token is None and not self.allowed_cns


@dataclass(frozen=True)
class Refusal:
    code: grpc.StatusCode
    message: str


def admin_token(config: AdminAuthConfig) -> str | None:
    """The configured admin token (from the variable or the file), or None."""
    if config.token_file is None:
        return config.token or None
    try:
        token = config.token_file.read_text().strip()
    except OSError as err:
        raise SecurityMisconfigured(
            f"cannot read the admin token file {config.token_file}: {err.strerror or err}"
        ) from None
    if not token:
        raise SecurityMisconfigured(f"the admin token file {config.token_file} is empty")
    return token


def admin_metadata(config: AdminAuthConfig | None = None) -> tuple[tuple[str, str], ...]:
    """Call metadata for an admin RPC: the bearer token when one is configured (default: the environment's)."""
    token = admin_token(config if config is not None else from_env(AdminAuthConfig))
    return (("authorization", f"Bearer {token}"),) if token else ()


def is_loopback(peer: str) -> bool:
    """Whether a gRPC peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:...") is this machine."""
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return True
    if kind == "ipv4":
        host = rest.rpartition(":")[0]
    elif kind == "ipv6":
        host = rest.rpartition(":")[0].strip("[]")
    else:
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def authorize(
    method: str,
    metadata: Sequence[tuple[str, str | bytes]],
    peer: str,
    common_names: Sequence[str],
    policy: AdminPolicy,
) -> Refusal | None:
    """None when the caller may make admin call ``method``, else why not. ``common_names``: the
    subject CNs of the verified client certificate (empty without mutual TLS)."""
    if policy.loopback_only:
        if is_loopback(peer):
            return None
        return Refusal(
            grpc.StatusCode.PERMISSION_DENIED,
            f"{method} is an admin call and this server accepts admin calls from loopback only, because it has no "
            "admin identity configured; set EXPERTMESH_ADMIN_TOKEN (or _TOKEN_FILE) or "
            "EXPERTMESH_ADMIN_ALLOWED_CNS on it",
        )
    presented = [v for k, v in metadata if k == "authorization"]
    token = None
    if presented:
        value = presented[0] if isinstance(presented[0], str) else presented[0].decode("utf-8", "replace")
        if not value.lower().startswith(_BEARER) or not value[len(_BEARER) :].strip():
            return Refusal(
                grpc.StatusCode.UNAUTHENTICATED, f"{method}: the authorization metadata must be 'Bearer <admin token>'"
            )
        token = value[len(_BEARER) :].strip()
        if policy.token is not None and hmac.compare_digest(token.encode(), policy.token.encode()):
            return None
    allowed = [cn for cn in common_names if cn in policy.allowed_cns]
    if allowed:
        return None
    if token is not None:
        why = (
            "is not this server's admin token"
            if policy.token is not None
            else "cannot authorise: this server accepts no admin token"
        )
        return Refusal(grpc.StatusCode.PERMISSION_DENIED, f"{method}: the bearer token {why}")
    if common_names and policy.allowed_cns:
        return Refusal(
            grpc.StatusCode.PERMISSION_DENIED,
            f"{method}: client certificate CN {', '.join(common_names)} is not among the admin CNs this server allows "
            "(EXPERTMESH_ADMIN_ALLOWED_CNS)",
        )
    ways = []
    if policy.token is not None:
        ways.append("'authorization: Bearer <token>' metadata with the admin token (EXPERTMESH_ADMIN_TOKEN)")
    if policy.allowed_cns:
        ways.append("a client certificate whose CN is an allowed admin CN (mutual TLS)")
    return Refusal(
        grpc.StatusCode.UNAUTHENTICATED, f"{method} is an admin call and needs an identity: send " + " or ".join(ways)
    )


def _common_names(context: grpc.ServicerContext) -> list[str]:
    return [cn.decode() for cn in context.auth_context().get("x509_common_name", [])]


class AdminAuthInterceptor(grpc.ServerInterceptor):
    """Refuses admin calls without an authorised identity (see the module docstring)."""

    def __init__(self, policy: AdminPolicy, methods: Sequence[str] = ADMIN_METHODS):
        self._policy = policy
        self._methods = tuple(methods)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self._methods):
            return handler
        policy = self._policy

        def check(context: grpc.ServicerContext) -> None:
            refusal = authorize(method, context.invocation_metadata(), context.peer(), _common_names(context), policy)
            if refusal is not None:
                context.abort(refusal.code, refusal.message)

        def wrap(behavior):
            def guarded(request, context):
                check(context)
                return behavior(request, context)

            return guarded

        return rewrap(handler, wrap, handler.request_deserializer)
