"""The rules that read more than a token's own top-2 scores: ``confidence_k`` (the gate's entropy),
``noisy_topk`` (a request's seed), ``sticky`` (the sequence's earlier tokens) and ``adaptive_k`` (the server's
queue). Pure functions, tensors or numbers in and out; ``routing_policy.step_routing`` lays them out per token
and ``gate_hook`` applies them.

Glossary
- *confidence* of a token's gate: ``1 - H(p) / log E``, p its scores normalised to sum 1 (softmax gates: the
  probabilities), H the entropy in nats, E the experts: 0 for a flat gate, 1 for a one-hot one.
- *alpha* (the field report's): ``min(1, max(0.1, 0.5 + 0.3 * log2(1 + confidence)))``, in [0.5, 0.8] for a
  confidence in [0, 1].
- *t*: a token's place relative to the answer, ``position + 1 - prompt length`` (0: the last prompt position,
  which predicts the first answer token; negative before it). Fixed per (request, position).
- *trace* (sticky): per MoE layer, ``m [E]`` in [0, 1]: after each token, ``m = decay * m + (1 - decay) *
  onehot(the top-k experts by biased logit)``; zeros before a sequence's first token. The top-k by biased
  logit is the gate's own choice for softmax gates; a group-limited sigmoid gate (DeepSeek-V3) may choose
  otherwise, and the trace follows the logits, so a sequence's bias never depends on how its steps were cut.
  A position the consistency guard computes again with the stock gate (``recompute: exact``) keeps the trace
  of its first computation.
- *queue signal*: the scheduler's waiting requests and the longest any of them has waited, at the step's start.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = [
    "QueueSignal",
    "RoutingState",
    "StickySequence",
    "adaptive_narrow",
    "confidence_alpha",
    "confidence_k",
    "gate_confidence",
    "gumbel_noise",
    "request_seed",
    "sticky_scan",
]


# -- confidence_k -------------------------------------------------------------------------------


def gate_confidence(scores: torch.Tensor) -> torch.Tensor:
    """scores [T, E] (softmax probabilities or sigmoid scores; masked experts 0) -> confidence [T] float64 in
    [0, 1]: ``1 - H / log E`` of the scores normalised to sum 1 (a row of zeros: 0; E = 1: 1)."""
    p = scores.double().clamp(min=0)
    total = p.sum(dim=-1, keepdim=True)  # [T, 1]
    p = torch.where(total > 0, p / total.clamp(min=1e-300), torch.full_like(p, 1.0 / p.shape[-1]))
    E = p.shape[-1]
    if E <= 1:
        return torch.ones(p.shape[0], dtype=torch.float64)
    entropy = -torch.special.xlogy(p, p).sum(dim=-1)  # [T] nats, 0 log 0 = 0
    return (1 - entropy / math.log(E)).clamp(0, 1)


def confidence_alpha(confidence: torch.Tensor) -> torch.Tensor:
    """confidence [T] -> the report's alpha [T] float64: ``min(1, max(0.1, 0.5 + 0.3 * log2(1 + c)))``.

    Example: c 0 -> 0.5; c 0.5 -> 0.675; c 1 -> 0.8."""
    return (0.5 + 0.3 * torch.log2(1 + confidence.double())).clamp(0.1, 1.0)


def confidence_k(confidence: torch.Tensor, k_min: torch.Tensor, k_max: torch.Tensor) -> torch.Tensor:
    """confidence_k: confidence, k_min, k_max [T] -> experts per token [T] int64,
    ``min(k_max, max(k_min, round(k_max / (2 * alpha))))`` with halves rounded up (float64).

    A flat gate (alpha 0.5) keeps k_max; a sure one (alpha 0.8) about 5/8 of it. Example, k_max 2: c <= 0.47
    -> 2, above -> 1; k_max 8: c 0 -> 8, c 1 -> 5."""
    k = torch.floor(k_max.double() / (2 * confidence_alpha(confidence)) + 0.5)  # [T]
    return torch.minimum(k_max.double(), torch.maximum(k_min.double(), k)).long()


# -- adaptive_k --------------------------------------------------------------------------------


@dataclass(frozen=True)
class QueueSignal:
    """The scheduler's queue at a step's start: requests waiting for a sequence slot or blocks, and the longest
    any of them has waited since it arrived (seconds; 0 when none waits)."""

    queued: int = 0
    oldest_wait_s: float = 0.0


def adaptive_narrow(signal: QueueSignal, slo_ms: float) -> float:
    """adaptive_k: experts fewer than the gate's top-k (``routing_policy.token_k`` keeps at least k_min). None
    while the oldest queued request has waited at most ``slo_ms``; one more per further SLO it has waited past
    it (``ceil(wait / slo) - 1``); ``slo_ms`` 0: inf, always the floor (what ``policy eval`` measures).

    Example, slo 100 ms: wait 0.1 s -> 0, 0.15 s -> 1, 0.25 s -> 2, 2 s -> 19 (with top-k 4 and k_min 1: 4, 3,
    2, 1 experts)."""
    if slo_ms <= 0:
        return math.inf
    over = signal.oldest_wait_s * 1e3 / slo_ms
    if over <= 1:
        return 0.0
    return float(math.ceil(round(over, 9)) - 1)


# -- noisy_topk --------------------------------------------------------------------------------

_MASK64 = (1 << 64) - 1


def request_seed(seed: int | None, request_id: str) -> int:
    """noisy_topk's seed of a request, in [0, 2**63): its sampling seed when it has one, else a hash of its id
    (a client that sets neither gets the server's random id, hence other noise each time)."""
    if seed is not None:
        return int(seed) & (_MASK64 >> 1)
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (_MASK64 >> 1)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def gumbel_noise(seed: torch.Tensor, t: torch.Tensor, layer: int, num_experts: int) -> torch.Tensor:
    """seed, t [T] int64 -> standard Gumbel noise [T, E] float32, ``-log(-log u)``, u uniform in (0, 1) from a
    counter hash of (seed, t, layer, expert): the same numbers for the same token anywhere (any batch, device,
    process), independent across experts, layers, positions and seeds."""
    with np.errstate(over="ignore"):
        s = seed.cpu().numpy().astype(np.uint64)
        pos = t.cpu().numpy().astype(np.int64).astype(np.uint64)  # negative t wraps: still one value per t
        key = _mix(_mix(_mix(s) ^ pos) ^ np.uint64(layer & _MASK64))  # [T]
        experts = (np.arange(1, num_experts + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))[None, :]
        bits = _mix(key[:, None] + experts)  # [T, E]
    u = ((bits >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)  # (0, 1)
    return torch.from_numpy(-np.log(-np.log(u))).float()


# -- sticky ------------------------------------------------------------------------------------


@dataclass(eq=False)
class RoutingState:
    """One sequence's routing across its steps, held by the engine's request and read and written by each
    step through ``StepRouting``: sticky's trace per MoE layer after the position each step starts from and the
    last two it computed (t), so a position computed again (the consistency guard's rollback) starts from the
    one before it."""

    traces: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)  # t -> layer -> [E] float32

    def before(self, t: int, layer: int, num_experts: int) -> torch.Tensor:
        """The trace [E] a token at ``t`` starts from: the one after ``t - 1``, zeros where none is kept (a
        sequence's first position, or after a restart)."""
        trace = self.traces.get(t - 1, {}).get(layer)
        return trace if trace is not None else torch.zeros(num_experts)

    def record(self, t: int, layer: int, trace: torch.Tensor, since: int) -> None:
        """The trace after ``t`` at ``layer``; those before ``since`` (what the step started from) are dropped."""
        for old in [k for k in self.traces if k < since]:
            del self.traces[old]
        self.traces.setdefault(t, {})[layer] = trace.detach().float().cpu().clone()


@dataclass(frozen=True)
class StickySequence:
    """One sticky sequence of a step: its rows ``start`` .. ``end - 1`` of the forward, the ``t`` of its first
    one, its parameters and its state (None: none kept, each step starts from zeros)."""

    start: int
    end: int
    first_t: int
    strength: float
    decay: float
    state: RoutingState | None = None


def sticky_scan(logits: torch.Tensor, sequences: Sequence[StickySequence], layer: int, top_k: int) -> torch.Tensor:
    """sticky at one layer: logits [T, E] (the gate's, any bias and noise added) -> the bias [T, E] to add
    (0 on rows of no sticky sequence). Token by token within each sequence (sequences side by side): its bias
    is ``strength * m`` (m its trace so far), then m takes its top-k experts by biased logit (see the module's
    glossary); each sequence's state records the traces after its last two tokens.

    Example, decay 0, strength 1: a token's bias is 1 on exactly the previous token's top-k experts."""
    T, E = logits.shape
    bias = torch.zeros(T, E, dtype=torch.float32, device=logits.device)
    if not sequences:
        return bias
    k = max(1, min(top_k, E))
    x = logits.detach().float()
    traces = torch.stack(
        [s.state.before(s.first_t, layer, E) if s.state is not None else torch.zeros(E) for s in sequences]
    ).to(x.device)  # [S, E]
    strength = torch.tensor([s.strength for s in sequences], device=x.device)[:, None]  # [S, 1]
    decay = torch.tensor([s.decay for s in sequences], device=x.device)[:, None]
    lengths = [s.end - s.start for s in sequences]
    for i in range(max(lengths)):
        live = [j for j, n in enumerate(lengths) if n > i]
        rows = torch.tensor([sequences[j].start + i for j in live], device=x.device)
        at = torch.tensor(live, device=x.device)
        b = strength[at] * traces[at]  # [S', E]
        bias[rows] = b
        chosen = (x[rows] + b).topk(k, dim=-1).indices  # [S', k]
        onehot = torch.zeros_like(b).scatter_(1, chosen, 1.0)
        traces[at] = decay[at] * traces[at] + (1 - decay[at]) * onehot
        for j in live:
            s = sequences[j]
            if s.state is not None and i >= lengths[j] - 2:
                s.state.record(s.first_t + i, layer, traces[j], since=s.first_t - 1)
    return bias
