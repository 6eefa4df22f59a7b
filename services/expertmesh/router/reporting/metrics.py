"""The router's per-expert and per-layer metrics, read when an exporter collects.

Observable instruments: nothing is computed on the data path; each collection
reads the load window's since-start counts and the traffic counters.

- ``expertmesh.expert.tokens`` {layer, expert}: tokens routed to the expert (counter)
- ``expertmesh.layer.balancedness`` {layer}: mean / max hidden states sent per group
- ``expertmesh.layer.routing_entropy`` {layer}: entropy of the expert load, bits
- ``expertmesh.group.queue_depth`` {group, transport}: Dispatch calls in flight from this router,
  and what carries them ("shm", "cuda-ipc", "grpc-stream", "grpc-unary"; the dispatcher's
  ``expertmesh.group.call.duration`` histogram has the same labels)
- ``expertmesh.active_parameters_per_token``: dense parameters plus the routed
  experts each token actually used, summed over MoE layers
- ``expertmesh.group.circuit_open`` {group}: 1 while the router's circuit breaker keeps the group out of
  its plans (open or half-open), else 0
- ``expertmesh.gate.top1_probability``, ``expertmesh.gate.top2_margin`` {layer}: histograms recorded on the
  data path, by the gates' hooks (``gate_confidence``)
"""

from __future__ import annotations

import numpy as np
from opentelemetry.metrics import CallbackOptions, Observation

from expertmesh.infra.telemetry.setup import meter
from expertmesh.observability.sparsity import balancedness, entropy_bits
from expertmesh.router.dispatch.circuit import BreakerState
from expertmesh.router.dispatch.dispatcher import LayerDispatcher
from expertmesh.router.reporting.gate_confidence import record_gate_confidence


def register_router_metrics(dispatcher: LayerDispatcher, dense_parameters: int, parameters_per_expert: int) -> None:
    window = dispatcher.load_window
    layers = window.moe_layers
    if dispatcher.gate_bias is not None:
        record_gate_confidence(dispatcher.gate_bias)

    def expert_tokens(options: CallbackOptions):
        load = window.since_start()  # [L, E]
        return [
            Observation(float(load[row, e]), {"layer": layer, "expert": e})
            for row, layer in enumerate(layers)
            for e in range(load.shape[1])
        ]

    def layer_balancedness(options: CallbackOptions):
        by_layer: dict[int, list[int]] = {}
        for (layer, _), tokens in dispatcher.traffic.layer_group_tokens().items():
            by_layer.setdefault(layer, []).append(tokens)
        out = []
        for layer, tokens in sorted(by_layer.items()):
            value = balancedness(np.array(tokens, dtype=float))
            if value is not None:
                out.append(Observation(value, {"layer": layer}))
        return out

    def routing_entropy(options: CallbackOptions):
        load = window.since_start()
        return [Observation(entropy_bits(load[row]), {"layer": layer}) for row, layer in enumerate(layers)]

    def queue_depth(options: CallbackOptions):
        transports = dispatcher.transports()
        return [
            Observation(depth, {"group": group, "transport": transports.get(group, "")})
            for group, depth in dispatcher.queue_depths().items()
        ]

    def active_parameters(options: CallbackOptions):
        load = window.since_start()  # [L, E]
        tokens = load.sum(axis=1) / window.top_k  # [L]
        if not tokens.any():
            return []
        experts_per_token = np.divide(load.sum(axis=1), tokens, out=np.zeros_like(tokens), where=tokens > 0)
        return [Observation(float(dense_parameters + parameters_per_expert * experts_per_token.sum()))]

    def circuit_open(options: CallbackOptions):
        return [
            Observation(0 if dispatcher.breakers.state(group) is BreakerState.CLOSED else 1, {"group": group})
            for group in dispatcher.queue_depths()
        ]

    m = meter()
    m.create_observable_counter("expertmesh.expert.tokens", [expert_tokens], description="tokens routed to each expert")
    m.create_observable_gauge(
        "expertmesh.layer.balancedness", [layer_balancedness], description="mean/max load over groups"
    )
    m.create_observable_gauge(
        "expertmesh.layer.routing_entropy", [routing_entropy], unit="bits", description="entropy of the expert load"
    )
    m.create_observable_gauge("expertmesh.group.queue_depth", [queue_depth], description="Dispatch calls in flight")
    m.create_observable_gauge(
        "expertmesh.active_parameters_per_token", [active_parameters], description="parameters each token used"
    )
    m.create_observable_gauge(
        "expertmesh.group.circuit_open", [circuit_open], description="1 while the circuit breaker keeps the group out"
    )
