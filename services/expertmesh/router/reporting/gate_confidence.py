"""How sure each MoE layer's gate is: per-token histograms of the top-1 gate score and the top-1/top-2 margin.

Read from the scores the gate computed anyway (its logits, bias and temperature included, as the token was
routed), in a forward hook on every gate; labelled by layer only.

- ``expertmesh.gate.top1_probability`` {layer}: the top-1 score: a softmax probability, or the sigmoid
  score of sigmoid gates (DeepSeek-V3), in [0, 1]
- ``expertmesh.gate.top2_margin`` {layer}: top-1 minus top-2 score, in [0, 1]
- ``expertmesh.gate.duration`` {layer}: seconds of one forward of the gate (its logits and selection, a
  routing policy's rules included, these histograms' own work not): the field report's gate time apart from
  the step's. On a GPU the time the host took to launch it (kernels run asynchronously), on CPU the
  computation itself.

Each gate's first forward and every ``RECORD_EVERY``-th after it records all three; a forward of more than
``MAX_TOKENS_RECORDED`` tokens (a prefill, a step of many sequences) records an evenly spaced ``MAX_TOKENS_RECORDED``
of them. So a step costs a bounded number of observations per layer, and the histograms stay a fair sample.
"""

from __future__ import annotations

import time
import weakref

import torch
from torch import nn

from expertmesh.infra.telemetry.setup import meter
from expertmesh.router.policy.gate_hook import GateBias
from expertmesh.router.policy.routing_policy import gate_scores

__all__ = ["BOUNDARIES", "MAX_TOKENS_RECORDED", "RECORD_EVERY", "confidence", "record_gate_confidence"]

#: histogram bucket boundaries of both metrics (scores and margins lie in [0, 1])
BOUNDARIES = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)
#: tokens of one gate forward recorded, at most: each is two histogram observations, ~2.7 us each with the
#: OpenTelemetry SDK alone and ~30 us each in a serving router at load (its lock, its attributes' hashing, with
#: the server's threads about), so at 16 a 64-sequence decode step of the 8-layer Mixtral spent ~8.7 of its
#: ~150 ms on them; at 4, ~2 ms.
MAX_TOKENS_RECORDED = 4
#: a gate's forwards per one recorded: with every one recorded, a one-sequence decode step of that Mixtral spent
#: ~1.4 of its ~40 ms in these hooks (24 observations and 8 small score computations a step)
RECORD_EVERY = 4

_recording: weakref.WeakSet = weakref.WeakSet()  # the GateBias objects whose gates are hooked already


def confidence(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [T, E] (``routing_policy.gate_scores``) -> (top-1 score [T], top-1 minus top-2 score [T]).

    Example: [[0.7, 0.2, 0.1]] -> ([0.7], [0.5])."""
    top = scores.float().topk(2, dim=-1).values  # [T, 2]
    return top[:, 0], top[:, 0] - top[:, 1]


def _evenly(values: torch.Tensor, most: int) -> torch.Tensor:
    """values [T, ...] -> at most ``most`` of its rows, evenly spaced, first and last included."""
    if values.shape[0] <= most:
        return values
    return values[torch.linspace(0, values.shape[0] - 1, most).round().long()]


def record_gate_confidence(gate_bias: GateBias, metrics_meter=None) -> None:
    """Hooks every gate of ``gate_bias``'s model to record both histograms (once per model)."""
    if gate_bias in _recording:
        return
    _recording.add(gate_bias)
    m = metrics_meter or meter()
    top1 = m.create_histogram(
        "expertmesh.gate.top1_probability",
        description="top-1 gate score of routed tokens (a sample of each layer's forwards and tokens)",
        explicit_bucket_boundaries_advisory=BOUNDARIES,
    )
    margin = m.create_histogram(
        "expertmesh.gate.top2_margin",
        description="top-1 minus top-2 gate score of routed tokens (a sample of each layer's forwards and tokens)",
        explicit_bucket_boundaries_advisory=BOUNDARIES,
    )

    duration = m.create_histogram(
        "expertmesh.gate.duration",
        unit="s",
        description="seconds of one forward of a MoE layer's gate",
        explicit_bucket_boundaries_advisory=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1),
    )
    # the engine's thread is these hooks' only caller
    forwards: dict[int, int] = {}  # layer -> its gate's forwards so far
    started: dict[int, float] = {}  # layer -> when its gate's forward began, for a forward that records

    def before(layer: int) -> None:
        count = forwards.get(layer, 0)
        forwards[layer] = count + 1
        if count % RECORD_EVERY == 0:
            started[layer] = time.perf_counter()

    def observe(gate: nn.Module, layer: int, out) -> None:
        if layer not in started:  # a forward the sample leaves out
            return
        duration.record(time.perf_counter() - started.pop(layer), {"layer": layer})
        logits = out[0] if isinstance(out, tuple) else out
        if not isinstance(logits, torch.Tensor) or logits.shape[-1] < 2:
            return
        # scores are per token: only the recorded tokens' are computed (a 64-sequence step's other 60 no one reads)
        rows = _evenly(logits.detach().reshape(-1, logits.shape[-1]), MAX_TOKENS_RECORDED)  # [<= 4, E]
        firsts, gaps = torch.stack(confidence(gate_scores(rows, hasattr(gate, "e_score_correction_bias")))).tolist()
        attributes = {"layer": layer}
        for value in firsts:
            top1.record(value, attributes)
        for value in gaps:
            margin.record(value, attributes)

    for layer, gate in gate_bias.gates.items():
        gate.register_forward_pre_hook(lambda _module, _args, layer=layer: before(layer))
        gate.register_forward_hook(lambda module, _args, out, layer=layer: observe(module, layer, out))
