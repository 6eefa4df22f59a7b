"""How a finished sequence's routing moved along it: the field report's routing-oscillation rate (experts changing
between consecutive tokens, per MoE layer) and the experts (so active parameters) a token used by where it sat in
its sequence. Pure functions on one sequence's choices, and the recorder that turns them into metrics.

Shapes: ``experts`` [L, T, K] global expert ids of one sequence's T tokens in L MoE layers, in slot order; an id
>= ``num_experts`` is an empty slot (a k rule left it, or a fallback dropped it).

Metrics (OpenTelemetry; Prometheus names with ``_total`` on counters):
- ``expertmesh.routing.transitions`` {layer}: pairs of consecutive tokens of finished sequences;
- ``expertmesh.routing.oscillations`` {layer}: of those, the pairs whose expert sets differ. The oscillation rate
  is their ratio (``rate(..oscillations) / rate(..transitions)``): 0 when every token of a sequence keeps its
  predecessor's experts, near 1 when each changes them;
- ``expertmesh.routing.experts_per_token`` {position}: the experts a token used over all MoE layers, by its
  place in its sequence: ``first``, ``middle`` or ``last`` third (``position_bucket``). Active parameters of a
  token are the model's dense parameters plus this times the parameters of one expert (``ListModels``:
  ``dense_parameters``, ``parameters_per_expert``).

Example: one layer, top-1, tokens routed to experts 3, 3, 5 -> transitions 2, oscillations 1 (rate 0.5).
"""

from __future__ import annotations

import numpy as np

from expertmesh.infra.telemetry.setup import meter

__all__ = ["POSITIONS", "RoutingDynamics", "experts_per_token", "oscillations", "position_bucket"]

POSITIONS = ("first", "middle", "last")


def oscillations(experts: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """experts [L, T, K] -> (changes [L], pairs [L]): per layer, how many consecutive token pairs chose different
    sets of experts (empty slots ignored), of the T - 1 pairs."""
    L, T = experts.shape[0], experts.shape[1]
    if T < 2:
        return np.zeros(L, dtype=np.int64), np.zeros(L, dtype=np.int64)
    ids = np.where(experts >= num_experts, num_experts, experts)  # [L, T, K]
    chosen = np.zeros((L, T, num_experts + 1), dtype=bool)  # [L, T, E + 1] each token's set, column E: empty
    np.put_along_axis(chosen, ids, True, axis=2)
    chosen = chosen[:, :, :num_experts]
    changed = (chosen[:, 1:] != chosen[:, :-1]).any(axis=2)  # [L, T - 1]
    return changed.sum(axis=1).astype(np.int64), np.full(L, T - 1, dtype=np.int64)


def experts_per_token(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """experts [L, T, K] -> [T] the experts each token used over the L layers (empty slots not counted)."""
    return (experts < num_experts).sum(axis=(0, 2)).astype(np.int64)


def position_bucket(positions: np.ndarray, length: int) -> np.ndarray:
    """positions [T] (0-based) in a sequence of ``length`` tokens -> [T] 0, 1, 2: its first, middle or last third.

    Example: length 6 -> positions 0-1: 0, 2-3: 1, 4-5: 2."""
    return np.minimum(3 * np.asarray(positions, dtype=np.int64) // max(length, 1), 2)


class RoutingDynamics:
    """The metrics above, recorded from each finished sequence (``record``)."""

    def __init__(self, num_experts: int, metrics_meter=None):
        m = metrics_meter or meter()
        self.num_experts = num_experts
        self._transitions = m.create_counter(
            "expertmesh.routing.transitions", description="consecutive token pairs of finished sequences, by layer"
        )
        self._oscillations = m.create_counter(
            "expertmesh.routing.oscillations",
            description="consecutive token pairs whose experts differ, by layer (over transitions: oscillation rate)",
        )
        self._per_token = m.create_histogram(
            "expertmesh.routing.experts_per_token",
            description="experts a token used over all MoE layers, by its third of the sequence (first, middle, last)",
            explicit_bucket_boundaries_advisory=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
        )

    def record(self, layers: tuple[int, ...], experts: np.ndarray, first_position: int, length: int) -> None:
        """A finished sequence's choices: experts [L, T, K] in MoE layers ``layers``, its tokens at positions
        ``first_position`` .. + T - 1 of its ``length``."""
        experts = np.asarray(experts)
        if experts.ndim != 3 or experts.shape[1] == 0:
            return
        changes, pairs = oscillations(experts, self.num_experts)
        for layer, changed, total in zip(layers, changes.tolist(), pairs.tolist()):
            if total:
                self._transitions.add(total, {"layer": layer})
                self._oscillations.add(changed, {"layer": layer})
        used = experts_per_token(experts, self.num_experts)  # [T]
        buckets = position_bucket(first_position + np.arange(experts.shape[1]), length)  # [T]
        for bucket in range(len(POSITIONS)):
            picked = used[buckets == bucket]
            if picked.size:  # a few values a sequence: a long one records its thirds' means, not every token
                self._per_token.record(float(picked.mean()), {"position": POSITIONS[bucket]})
