r"""Which tokens the quarantine fallback served, and whose they were: the degraded
mark on a request's trace.

A token is degraded in a layer when the stock gate chose an expert whose every
replica is quarantined (``RoutingView.fallback``), so the fallback served it
instead: the next-best expert in the slot, or the token's other experts
renormalised. Under ``renormalise`` the gate is stock and its top-k says so
directly. Under ``next_best`` the gate never picks a masked expert, so
``StockChoice`` recomputes, for layers with a mask only, what the unmasked gate
would have chosen: the gate's own linear on the same hidden states, scored as the
gate scores (softmax, or sigmoid plus its correction bias) and its top-k. That is
exact for softmax top-k gates; group-limited gates (DeepSeek-V3) also restrict
the choice to their best groups, which this ignores (it may count a token whose
stock choice the group limit would have excluded).

``DegradedTokens`` gathers, over one forward of the serving engine (its
``StepContext.degraded``), which sequence each degraded token belongs to (the
step packs many requests; the dispatch of each layer records into it), and
``DegradedTokens.mark`` puts it on that sequence's spans: attribute
``expertmesh.degraded`` = true and an ``expertmesh.degraded`` event with the
layers, the experts (``"layer/expert"``) and the tokens served by the fallback
(counted once per layer and expert).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from opentelemetry.trace import Span

from expertmesh.router.policy.gate_hook import GateBias
from expertmesh.router.policy.routing_policy import gate_scores


class StockChoice:
    """Forward hooks on every gate: where ``gate_bias`` masks experts of the layer (a [E] bias with -inf),
    the stock top-k [T, K] for the layer's next dispatch (``take``). The router model's forwards run one at a
    time (the engine's thread, or a stock forward outside any step): one pending choice per layer."""

    def __init__(self, gate_bias: GateBias):
        self._gate_bias = gate_bias
        self._choices: dict[int, torch.Tensor] = {}  # layer -> [T, K]
        for layer, gate in gate_bias.gates.items():
            gate.register_forward_hook(lambda _m, args, _out, layer=layer: self._note(layer, args[0]))

    def _note(self, layer: int, hidden: torch.Tensor) -> None:
        mask = self._gate_bias.biases().get(layer)
        choices = self._choices
        choices.pop(layer, None)
        if mask is None or mask.dim() != 1:
            return
        gate = self._gate_bias.gates[layer]
        rows = hidden.detach().reshape(-1, gate.weight.shape[1]).float()  # [T, H]
        bias = getattr(gate, "bias", None)
        logits = F.linear(rows, gate.weight.float(), bias.float() if isinstance(bias, torch.Tensor) else None)  # [T, E]
        correction = getattr(gate, "e_score_correction_bias", None)
        scores = gate_scores(logits, sigmoid=correction is not None)
        if correction is not None:
            scores = scores + correction.float()
        choices[layer] = scores.topk(gate.top_k, dim=-1).indices.cpu()  # [T, K]

    def take(self, layer: int) -> torch.Tensor | None:
        """The stock top-k [T, K] of ``layer``'s last gate forward, if it had a mask."""
        return self._choices.pop(layer, None)


class DegradedTokens:
    """One forward's degraded tokens, by the sequence they belong to (the forward packs
    ``tokens_per_sequence`` tokens of each, in order)."""

    def __init__(self, tokens_per_sequence: Sequence[int]):
        self._tokens_per_sequence = tokens_per_sequence
        #: [T] each token's sequence, built at the first record: every step has one of these, few record anything
        self._owner: torch.Tensor | None = None
        #: sequence -> (layer, expert) -> tokens
        self._found: dict[int, dict[tuple[int, int], int]] = {}

    def record(self, layer: int, chosen: torch.Tensor, fell: torch.Tensor) -> None:
        """chosen [T, K]: the stock gate's experts; fell [T, K]: which of them the fallback served."""
        if self._owner is None:
            counts = torch.tensor(list(self._tokens_per_sequence), dtype=torch.long)
            self._owner = torch.repeat_interleave(torch.arange(len(counts)), counts)  # [T]
        rows, slots = fell.nonzero(as_tuple=True)
        for seq, expert in zip(self._owner[rows].tolist(), chosen[rows, slots].tolist()):
            pairs = self._found.setdefault(seq, {})
            pairs[(layer, expert)] = pairs.get((layer, expert), 0) + 1

    @property
    def sequences(self) -> dict[int, dict[tuple[int, int], int]]:
        return self._found

    def mark(self, spans: Sequence[Iterable[Span | None]]) -> None:
        """``spans[i]``: the spans of sequence i to mark (its step's, its request's; None skipped)."""
        for seq, pairs in sorted(self._found.items()):
            event = {
                "expertmesh.degraded.layers": sorted({layer for layer, _ in pairs}),
                "expertmesh.degraded.experts": [f"{layer}/{expert}" for layer, expert in sorted(pairs)],
                "expertmesh.degraded.tokens": sum(pairs.values()),
            }
            for span in spans[seq]:
                if span is not None:
                    span.set_attribute("expertmesh.degraded", True)
                    span.add_event("expertmesh.degraded", event)
