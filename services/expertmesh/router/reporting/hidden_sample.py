"""A router's sample of the real hidden states reaching each MoE layer, for the
orchestrator's health monitor to probe experts with (off unless
``EXPERTMESH_HIDDEN_SAMPLE_TOKENS`` > 0).

Per layer, a reservoir (Vitter's algorithm R) of at most ``per_layer`` rows:
every row the layer dispatched since the last publication is in it with the
same probability. Offering a batch costs one random draw per row and copies
only the rows kept, which is few once the reservoir is full, and happens after
the layer's group calls are sent, while the groups compute; nothing of the
dispatch's own computation changes (its outputs stay bit-identical).

Published every ``interval_s`` into the state store's ``hidden_samples:<layer>``
hash (field: the router id) in the model's dtype, in ``state.samples``' form
(raw little-endian bytes, no pickle), then the reservoir
starts afresh, so each publication samples its own interval. A layer that saw no
tokens since keeps its last publication. The router removes its samples when it
stops.

Why bounded and off by default: hidden states are users' data (prompts can be
recovered from them) and weigh ``rows x H x itemsize`` per layer in the store.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from expertmesh.store import StateStore
from expertmesh.store.samples import encode

log = logging.getLogger(__name__)


class _Reservoir:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.rows: list[torch.Tensor] = []  # each [H]
        #: rows offered since the reservoir started
        self.seen = 0

    def offer(self, hidden: torch.Tensor, generator: torch.Generator) -> None:
        """hidden [T, H]: row i (the ``seen + i``-th offered) replaces slot j ~ U[0, seen + i] when j < capacity."""
        tokens = hidden.shape[0]
        free = min(max(self.capacity - len(self.rows), 0), tokens)
        self.rows.extend(hidden[:free].clone().unbind(0))
        self.seen += free
        if free == tokens:
            return
        index = torch.arange(self.seen + 1, self.seen + tokens - free + 1, dtype=torch.float64)  # [T - free]
        slots = (torch.rand(tokens - free, generator=generator, dtype=torch.float64) * index).long()
        for i in (slots < self.capacity).nonzero().flatten().tolist():  # in order: later rows win a slot
            self.rows[int(slots[i])] = hidden[free + i].clone()
        self.seen += tokens - free


class HiddenSampler:
    """Reservoirs of ``per_layer`` rows for each of ``moe_layers``; thread-safe."""

    def __init__(self, moe_layers: Sequence[int], per_layer: int, seed: int = 0):
        if per_layer < 1:
            raise ValueError(f"a hidden-state sample needs at least one row per layer, not {per_layer}")
        self.per_layer = per_layer
        self.layers = tuple(moe_layers)
        self._lock = threading.Lock()
        self._generator = torch.Generator().manual_seed(seed)
        self._reservoirs = {layer: _Reservoir(per_layer) for layer in self.layers}

    def offer(self, layer: int, hidden: torch.Tensor) -> None:
        """hidden [T, H] on the CPU, as the layer dispatches it."""
        with self._lock:
            self._reservoirs[layer].offer(hidden.detach(), self._generator)

    def take(self) -> dict[int, torch.Tensor]:
        """layer -> its sample [rows, H] since the last take (layers that saw no tokens left out); restarts them."""
        with self._lock:
            taken = {layer: r.rows for layer, r in self._reservoirs.items() if r.rows}
            for layer in taken:
                self._reservoirs[layer] = _Reservoir(self.per_layer)
        return {layer: torch.stack(rows) for layer, rows in taken.items()}


class SamplePublisher:
    """Publishes ``sampler``'s reservoirs under ``router_id`` every ``interval_s`` in a thread."""

    def __init__(self, store: StateStore, sampler: HiddenSampler, router_id: str, interval_s: float):
        self._store = store
        self._sampler = sampler
        self._id = router_id
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="expertmesh-hidden-sample", daemon=True)

    def start(self) -> "SamplePublisher":
        self._thread.start()
        return self

    def publish(self) -> None:
        for layer, sample in self._sampler.take().items():
            self._store.publish_hidden_sample(layer, self._id, encode(sample))

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.publish()
            except Exception:  # a store hiccup must not kill the router; the next interval samples anew
                log.warning("could not publish the hidden-state sample", exc_info=True)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self._store.remove_hidden_samples(self._id, self._sampler.layers)
        except Exception:
            log.warning("could not remove this router's hidden-state samples", exc_info=True)
