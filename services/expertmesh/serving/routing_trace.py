"""A request's routing trace: for each token it generates, in each MoE layer, the experts the token's
forward chose, the weight each was applied with and the group that served it. Both APIs ask for it
(gRPC ``GenerateRequest.routing_trace``, HTTP ``routing_trace`` / ``X-Expertmesh-Routing-Trace: 1``)
and bound it the same way (``trace_problem``).

Glossary
- *entry*: one (token, MoE layer) pair of a trace.
- The routing of answer token ``t`` is that of the forward whose logits chose it: the position before it
  (the prompt's last position for ``t = 0``), as decay_k counts ``t``.
"""

from __future__ import annotations

from dataclasses import dataclass

from expertmesh.router.dispatch.step_choices import LayerRouting

__all__ = ["DEFAULT_MAX_TRACE_ENTRIES", "LayerRouting", "TokenRouting", "trace_problem"]

#: entries (tokens x MoE layers, over every choice) one traced request may ask for, unless configured
#: (``ServingConfig.max_routing_trace_entries``)
DEFAULT_MAX_TRACE_ENTRIES = 65536


@dataclass(frozen=True)
class TokenRouting:
    """One generated token's routing, layer by layer (empty when the model's experts are not dispatched)."""

    token_id: int
    #: the token's index in its choice's answer (0: the first new token)
    index: int
    layers: tuple[LayerRouting, ...]


def trace_problem(max_new_tokens: int, choices: int, moe_layers: int, cap: int) -> str | None:
    """Why a traced request is refused (None: it is within ``cap`` entries)."""
    entries = max_new_tokens * choices * moe_layers
    if entries <= cap:
        return None
    of = f"{max_new_tokens} new tokens x {choices} choices" if choices > 1 else f"{max_new_tokens} new tokens"
    return (
        f"routing_trace: {of} x {moe_layers} MoE layers is {entries} entries, above this server's cap of "
        f"{cap} (max_routing_trace_entries); ask for fewer tokens"
    )
