"""Transport security and admin authorisation of expertmesh's gRPC APIs.

- ``tls``: gRPC credentials from a ``TlsConfig`` (``EXPERTMESH_TLS_*``); every
  server binds and every channel is opened through it, so TLS is on everywhere
  or nowhere.
- ``admin_auth``: the server interceptor that guards admin RPCs, and the call
  metadata clients send with them.

Glossary: an *admin RPC* changes what a server holds or does (LoadExperts,
UnloadExperts, the orchestrator's ``expertmesh.v1.Admin``); a *data-plane RPC*
(Dispatch, Describe, Generate, health) only reads or computes and is open to any
peer that passed TLS. An *identity* is what makes an admin call authorised: the
admin token, or a client certificate whose subject CN is allowed.
"""

from __future__ import annotations

import os
from typing import TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from expertmesh.contracts.errors import SecurityMisconfigured

T = TypeVar("T", bound=BaseSettings)

#: Variables a process passes on to the expert-group replicas it starts, so they serve as it dials
#: (and, in a chaos run, accept the fault hook as it was enabled: ``FaultInjectionConfig``).
_PROPAGATED_PREFIXES = ("EXPERTMESH_TLS_", "EXPERTMESH_ADMIN_", "EXPERTMESH_ENABLE_FAULT_INJECTION")


def from_env(config_class: type[T]) -> T:
    """``config_class()`` read from the environment; a bad setting is a one-line SecurityMisconfigured."""
    try:
        return config_class()
    except ValidationError as err:
        raise SecurityMisconfigured("; ".join(e["msg"].removeprefix("Value error, ") for e in err.errors())) from None


def propagation_env() -> dict[str, str]:
    """The EXPERTMESH_TLS_*, EXPERTMESH_ADMIN_* and fault-hook settings of this process, for the replicas it starts."""
    return {k: v for k, v in os.environ.items() if k.startswith(_PROPAGATED_PREFIXES)}
