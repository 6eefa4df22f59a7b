"""Counters of what the router's dispatch puts on the wire, per MoE layer.

The dispatch benchmark reads them (bytes per token per layer against the
minimum); observability exports them. Cheap: a few integer additions per
layer call under a lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace


@dataclass
class LayerTraffic:
    calls: int = 0  # experts calls of this layer (one per forward step)
    tokens: int = 0  # tokens routed
    group_calls: int = 0  # Dispatch RPCs (groups touched, summed over calls)
    token_group_pairs: int = 0  # hidden states sent: each token once per group it needs
    bytes_sent: int = 0  # serialized DispatchRequest bytes
    bytes_received: int = 0  # serialized DispatchResponse bytes
    seconds: float = 0.0  # wall time inside dispatch


class TrafficCounters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._layers: dict[int, LayerTraffic] = {}
        self._group_tokens: dict[tuple[int, str], int] = {}  # (layer, group) -> hidden states sent

    def record(self, layer: int, **amounts) -> None:
        with self._lock:
            traffic = self._layers.setdefault(layer, LayerTraffic())
            for name, amount in amounts.items():
                setattr(traffic, name, getattr(traffic, name) + amount)

    def record_groups(self, layer: int, tokens_by_group: dict[str, int]) -> None:
        with self._lock:
            for group, tokens in tokens_by_group.items():
                self._group_tokens[(layer, group)] = self._group_tokens.get((layer, group), 0) + tokens

    def layer_group_tokens(self) -> dict[tuple[int, str], int]:
        """Hidden states sent to each group in each layer, since start."""
        with self._lock:
            return dict(sorted(self._group_tokens.items()))

    def group_tokens(self) -> dict[str, int]:
        """Hidden states sent to each group, all layers together."""
        out: dict[str, int] = {}
        for (_, group), tokens in self.layer_group_tokens().items():
            out[group] = out.get(group, 0) + tokens
        return out

    def snapshot(self) -> dict[int, LayerTraffic]:
        with self._lock:
            return {layer: replace(t) for layer, t in sorted(self._layers.items())}

    def reset(self) -> None:
        with self._lock:
            self._layers.clear()
            self._group_tokens.clear()
