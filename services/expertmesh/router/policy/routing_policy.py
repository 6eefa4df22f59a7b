"""Per-request routing policies: pure functions on the stock gate's scores. Tensors in, tensors out.

A policy is ``exact`` (the stock gate, untouched: the default) or a ``+``-joined set of rules:

- *bias rules* (need the request's domain and its capability profile, ``router.profiles``), at most one:
  ``prefer`` adds a bias bounded by ``alpha`` to the gate's logits, toward the domain's strong experts and
  away from its weak ones; ``restrict`` lets each layer choose only among the domain's ``top_n`` experts
  (``-inf`` elsewhere, so the architecture's own normalisation spreads the weight over the allowed ones).
- *k rules*, on the gate's scores (softmax probabilities; sigmoid scores for sigmoid gates) after any bias:
  ``delta_gap`` keeps only the top-1 expert, its weight times ``weight_boost``, when the top-1 score leads
  the top-2 by more than ``delta``; ``dynamic_k`` chooses ``k + 1`` experts when the top-2 scores are
  within ``threshold``. Both together are the confidence rules of the field report (narrow when sure,
  widen when torn); a token that widens is never narrowed. ``decay_k`` instead sets each token's k from
  its place in the answer: ``round(max(k_min, k_start * decay**t))`` (halves round up), t the index of the
  answer token the position predicts (0 for every prompt position, so a prompt is read with ``k_start``).
  ``confidence_k`` sets it from the gate's confidence (``token_rules``: ``1 - H / log E``, the report's
  ``alpha = min(1, max(0.1, 0.5 + 0.3 log2(1 + confidence)))``): ``min(k_max, max(k_min, round(k_max /
  (2 alpha))))`` (halves round up): k_max for a flat gate, about 5/8 of it for a sure one. ``adaptive_k``
  narrows under load: the gate's top-k less one expert per ``queue_slo_ms`` the oldest queued request has
  waited past the first (the scheduler's queue signal at the step's start), never below ``k_min``, back to
  top-k as soon as the queue waits less; ``queue_slo_ms`` 0 holds it at ``k_min``, which is what ``policy
  eval`` measures and the quality guard's record is filed under (its key leaves ``queue_slo_ms`` out), so the
  guard bounds its narrowest. decay_k, confidence_k and adaptive_k each set k: at most one, with neither
  confidence rule. A k rule that asks for more experts than the architecture's top-k gets the architecture's
  own top-(k), its normalisation included; fewer likewise, at most the experts the gate can choose.
- *gate modifiers*, with any of the above: ``gate_temperature`` divides the gate's logits by ``tau`` before
  the architecture's score function (then any bias is added); ``capacity`` lets an expert take at most
  ``ceil(capacity_factor * slots / E)`` of one step's slots at a layer (slots: the valid choices of the
  step's tokens that have the rule; tokens of one factor share a cap), moving overflow to the token's
  next-best expert with room (tokens in order, then each token's choices by gate score); ``noisy_topk`` adds
  ``noise_scale`` times Gumbel noise to the logits, from a counter hash of (the request's seed, t, layer,
  expert) (``token_rules.gumbel_noise``; the seed is the request's sampling seed, else a hash of its id), so
  the same request is routed the same way in any batch; ``sticky`` adds ``sticky_strength`` times the
  sequence's trace of the experts its earlier tokens chose at that layer (the previous token's weigh
  ``1 - sticky_decay``, each older one ``sticky_decay`` times less), token by token (``token_rules.sticky_scan``)
  from the request's ``RoutingState``.

Bias, temperature, noise and sticky act on logits before the architecture's own selection (``gate_hook``); k rules
transform its top-k afterwards, so a token's choice may have a varying number of valid slots: the rest
carry the skip sentinel ``num_experts`` with weight 0, which the dispatch plan and the load window skip.

In a serving step every token carries its own request's rules (``StepRouting``); tokens of ``exact``
requests get a zero bias, temperature 1, no noise, no trace and no k or capacity rule, so their routing is
bit-identical to the stock gate's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import torch

from expertmesh.models.hosted_experts import TOP_K_ALLOWANCE
from expertmesh.router.policy.token_rules import (
    QueueSignal,
    RoutingState,
    StickySequence,
    adaptive_narrow,
    confidence_k,
    request_seed,
)

EXACT = "exact"
BIAS_RULES = ("prefer", "restrict")
#: confidence rules (combine with each other), and the rules that set k (at most one, with neither confidence rule)
K_RULES = ("delta_gap", "dynamic_k", "decay_k", "confidence_k", "adaptive_k")
CONFIDENCE_RULES = ("delta_gap", "dynamic_k")
SET_K_RULES = ("decay_k", "confidence_k", "adaptive_k")
MODIFIERS = ("gate_temperature", "capacity", "noisy_topk", "sticky")
RULES = BIAS_RULES + K_RULES + MODIFIERS


class PolicyError(ValueError):
    """A policy or one of its parameters is not acceptable; ``field`` names it as the request spells it."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class Parameter:
    """One tunable of a rule, with its range (inclusive) as ListModels reports it."""

    name: str
    rule: str
    default: float
    low: float
    high: float
    description: str
    integer: bool = False
    #: other rules that read it (k_min: the floor of every rule that sets k)
    also: tuple[str, ...] = ()
    #: part of the policy's key (what a quality record is filed under); False: it changes only when a rule acts
    in_key: bool = True

    @property
    def rules(self) -> tuple[str, ...]:
        return (self.rule, *self.also)

    def rule_in(self, rules) -> str | None:
        """The rule of ``rules`` that reads it, or None."""
        return next((r for r in self.rules if r in rules), None)


def parameters(top_k: int, num_experts: int) -> tuple[Parameter, ...]:
    """Every rule's parameters for a model with ``num_experts`` experts chosen ``top_k`` at a time."""
    widest = max(1, min(num_experts, top_k + TOP_K_ALLOWANCE))  # experts per token an expert group takes
    return (
        Parameter(
            "alpha", "prefer", 1.0, 0.0, 4.0, "largest bias (logit units) toward strong / away from weak experts"
        ),
        Parameter(
            "top_n",
            "restrict",
            float(max(top_k, num_experts // 2)),
            float(top_k),
            float(num_experts),
            "experts per layer a restricted request may choose among",
            integer=True,
        ),
        Parameter("delta", "delta_gap", 0.18, 0.0, 1.0, "top-1 minus top-2 score above which only the top-1 is used"),
        Parameter("weight_boost", "delta_gap", 1.2, 1.0, 2.0, "factor on the lone top-1 expert's weight"),
        Parameter("threshold", "dynamic_k", 0.15, 0.0, 1.0, "top-1 minus top-2 score below which k+1 experts are used"),
        Parameter(
            "k_start",
            "decay_k",
            float(min(4, widest)),
            1.0,
            float(widest),  # an expert group refuses a Dispatch wider than this: the whole step would fail
            "experts per token at t = 0",
            integer=True,
        ),
        Parameter("decay", "decay_k", 0.92, 0.01, 1.0, "factor on k per answer token"),
        Parameter(
            "k_min",
            "decay_k",
            1.0,
            1.0,
            float(num_experts),
            "fewest experts per token",
            integer=True,
            also=("confidence_k", "adaptive_k"),
        ),
        Parameter("tau", "gate_temperature", 0.85, 0.05, 4.0, "divides the gate's logits (below 1: sharper)"),
        Parameter("capacity_factor", "capacity", 1.25, 1.0, 8.0, "an expert's most slots per step, in fair shares"),
        Parameter(
            "k_max",
            "confidence_k",
            float(max(1, min(top_k, num_experts))),
            1.0,
            float(widest),  # what an expert group takes per token
            "experts per token of a flat gate (confidence 0); fewer as the gate is surer",
            integer=True,
        ),
        Parameter("noise_scale", "noisy_topk", 0.1, 0.0, 4.0, "factor on the Gumbel noise added to the gate's logits"),
        Parameter(
            "sticky_strength", "sticky", 0.5, 0.0, 4.0, "largest bias (logit units) toward earlier tokens' experts"
        ),
        Parameter(
            "sticky_decay", "sticky", 0.5, 0.0, 0.99, "share of the trace an older token keeps (0: the previous only)"
        ),
        Parameter(
            "queue_slo_ms",
            "adaptive_k",
            500.0,
            0.0,
            600_000.0,
            "queue wait past which k narrows, one expert per further SLO (0: always at k_min)",
            in_key=False,
        ),
    )


#: every parameter's name, as the gRPC RoutingPolicy message and the HTTP body spell it
PARAMETER_NAMES = tuple(p.name for p in parameters(2, 8))
#: the parameters left out of a policy's key
_UNKEYED = frozenset(p.name for p in parameters(2, 8) if not p.in_key)


DESCRIPTIONS = {
    EXACT: "the stock gate, bit-identical (default)",
    "prefer": "bias the gate toward the domain's strong experts, away from its weak ones",
    "restrict": "choose only among the domain's top-N experts of each layer",
    "delta_gap": "top-1 when the gate is sure (top-1/top-2 gap above delta)",
    "dynamic_k": "top-(k+1) when the top-2 scores are within threshold",
    "decay_k": "k_start experts per token, times decay per answer token, at least k_min",
    "gate_temperature": "the gate's logits divided by tau before its own selection",
    "capacity": "an expert takes at most capacity_factor fair shares of a step; overflow to the next best",
    "confidence_k": "k from the gate's confidence: round(k_max / (2 alpha)), at least k_min",
    "adaptive_k": "top-k less one expert per queue_slo_ms the queue waits past it, at least k_min",
    "noisy_topk": "Gumbel noise (times noise_scale) on the gate's logits, seeded per request",
    "sticky": "a bias toward the experts earlier tokens chose at the layer, decaying with age",
}


@dataclass(frozen=True)
class RoutingPolicy:
    """A validated policy: its rules and every parameter (defaults filled in)."""

    rules: frozenset[str] = frozenset()
    alpha: float = 1.0
    top_n: int = 0
    delta: float = 0.18
    weight_boost: float = 1.2
    threshold: float = 0.15
    k_start: int = 4
    decay: float = 0.92
    k_min: int = 1
    tau: float = 0.85
    capacity_factor: float = 1.25
    k_max: int = 2
    noise_scale: float = 0.1
    sticky_strength: float = 0.5
    sticky_decay: float = 0.5
    queue_slo_ms: float = 500.0

    @property
    def name(self) -> str:
        return "+".join(r for r in RULES if r in self.rules) or EXACT

    @property
    def needs_domain(self) -> bool:
        return bool(self.rules & set(BIAS_RULES))

    @property
    def is_exact(self) -> bool:
        return not self.rules

    def active(self) -> dict[str, float]:
        """The parameters its rules use: name -> value."""
        return {p: getattr(self, p) for p in PARAMETER_NAMES if _RULES_OF[p] & self.rules}

    @property
    def spec(self) -> str:
        """Name and every active parameter, e.g. ``adaptive_k(k_min=1,queue_slo_ms=500)``: what
        ``parse_policy_spec`` reads back (a server's configured defaults are written so)."""
        params = ",".join(f"{k}={v:g}" for k, v in self.active().items())
        return f"{self.name}({params})" if params else self.name

    @property
    def key(self) -> str:
        """Name and active parameters, e.g. ``prefer+delta_gap(alpha=1,delta=0.18,weight_boost=1.2)``: what
        a quality record is filed under (adaptive_k's ``queue_slo_ms`` left out: the record is of its floor)."""
        params = ",".join(f"{k}={v:g}" for k, v in self.active().items() if k not in _UNKEYED)
        return f"{self.name}({params})" if params else self.name


_RULES_OF = {p.name: frozenset(p.rules) for p in parameters(2, 8)}


def policy_names() -> tuple[str, ...]:
    """Every accepted name: exact, then each combination of at most one bias rule, the confidence rules
    (either or both) or one rule that sets k, and any of the gate modifiers; rules in ``RULES`` order."""
    k_sets = [(), ("delta_gap",), ("dynamic_k",), CONFIDENCE_RULES, *((r,) for r in SET_K_RULES)]
    modifier_sets = [tuple(m for i, m in enumerate(MODIFIERS) if bits >> i & 1) for bits in range(2 ** len(MODIFIERS))]
    names = [EXACT]
    for bias in ((), *((b,) for b in BIAS_RULES)):
        names += ["+".join(bias + ks + ms) for ks in k_sets for ms in modifier_sets if bias or ks or ms]
    return tuple(names)


def parse_policy(
    name: str, given: Mapping[str, float], top_k: int, num_experts: int, field_prefix: str = "routing_policy"
) -> RoutingPolicy:
    """``name`` ('' means exact) and the parameters the caller set -> a RoutingPolicy, or PolicyError
    naming the field. A parameter of a rule the policy does not use is refused rather than ignored."""
    name = name.strip() or EXACT
    rules = [] if name == EXACT else name.split("+")
    if any(r not in RULES for r in rules) or len(set(rules)) != len(rules):
        shown = repr(name[:64]) + ("..." if len(name) > 64 else "")
        raise PolicyError(
            f"{field_prefix}.name", f"unknown policy {shown}; exact, or rules joined with '+': {', '.join(RULES)}"
        )
    if len(set(rules) & set(BIAS_RULES)) > 1:
        raise PolicyError(f"{field_prefix}.name", "prefer and restrict do not combine: choose one bias rule")
    setting = [r for r in SET_K_RULES if r in rules]
    if len(setting) > 1 or (setting and set(rules) & set(CONFIDENCE_RULES)):
        raise PolicyError(
            f"{field_prefix}.name",
            f"{' and '.join(setting)} {'each set' if len(setting) > 1 else 'sets'} k: it does not combine with "
            "decay_k, confidence_k, adaptive_k, delta_gap or dynamic_k",
        )
    values = {}
    for p in parameters(top_k, num_experts):
        if p.name not in given:
            values[p.name] = int(p.default) if p.integer else p.default
            continue
        value = given[p.name]
        where = f"{field_prefix}.{p.name}"
        if p.rule_in(rules) is None:
            owners = " or ".join(p.rules)
            raise PolicyError(where, f"is a parameter of {owners}, which policy {name!r} does not use")
        if not math.isfinite(value) or not p.low <= value <= p.high or (p.integer and value != int(value)):
            kind = "an integer" if p.integer else "a number"
            raise PolicyError(where, f"must be {kind} in [{p.low:g}, {p.high:g}], got {value:g}")
        values[p.name] = int(value) if p.integer else float(value)
    for rule, bound, limit in (
        ("decay_k", "k_start", values["k_start"]),
        ("confidence_k", "k_max", values["k_max"]),
        ("adaptive_k", "the architecture's top-k", top_k),
    ):
        if rule in rules and values["k_min"] > limit:
            where = f"{field_prefix}.{'k_min' if 'k_min' in given or rule == 'adaptive_k' else bound}"
            raise PolicyError(where, f"k_min ({values['k_min']}) must not exceed {bound} ({limit})")
    return RoutingPolicy(rules=frozenset(rules), **values)


#: ``name`` or ``name(param=value, ...)``
_SPEC = re.compile(r"\s*([A-Za-z_+]*)\s*(?:\((.*)\))?\s*", re.DOTALL)


def parse_policy_spec(spec: str, top_k: int, num_experts: int, field_prefix: str = "routing_policy") -> RoutingPolicy:
    """A policy written with its parameters, ``name`` or ``name(param=value, ...)`` as ``RoutingPolicy.spec``
    writes it (a server's configured defaults: ``restrict+delta_gap(top_n=4,delta=0.2)``; '' means exact) ->
    a RoutingPolicy, or PolicyError naming the field (``routing_policy.delta``), as ``parse_policy``."""
    shown = repr(spec[:64]) + ("..." if len(spec) > 64 else "")
    match = _SPEC.fullmatch(spec)
    if match is None:
        raise PolicyError(field_prefix, f"expected a policy name or name(param=value, ...), got {shown}")
    name, inner = match.groups()
    given: dict[str, float] = {}
    for part in (inner or "").split(","):
        if not part.strip():
            continue
        key, sep, value = (s.strip() for s in part.partition("="))
        if key not in PARAMETER_NAMES:
            raise PolicyError(
                f"{field_prefix}.{key[:32] or '?'}",
                f"unknown parameter in {shown}; parameters: {', '.join(PARAMETER_NAMES)}",
            )
        if key in given:
            raise PolicyError(f"{field_prefix}.{key}", f"given twice in {shown}")
        try:
            given[key] = float(value) if sep else math.nan
        except ValueError:
            given[key] = math.nan
        if math.isnan(given[key]):
            raise PolicyError(f"{field_prefix}.{key}", f"expected {key}=NUMBER in {shown}")
    return parse_policy(name, given, top_k, num_experts, field_prefix)


# -- bias rules ------------------------------------------------------------------------------


def prefer_bias(lift: torch.Tensor, alpha: float) -> torch.Tensor:
    """lift [E] (the domain's share of an expert over its overall share) -> bias [E] in (-alpha, alpha).

    tanh(log lift): an expert twice as used in the domain as overall gets +0.6 alpha, half as used -0.6
    alpha, never used -alpha; an expert with no tokens overall (lift 0 and no evidence) gets 0 ... -alpha
    as well, which only makes the gate's existing preference for it weaker."""
    return alpha * torch.tanh(torch.log(lift.double().clamp(min=1e-12))).float()


def restrict_bias(share: torch.Tensor, top_n: int) -> torch.Tensor:
    """share [E] (the domain's tokens per expert at one layer) -> bias [E]: 0 on its ``top_n`` most used
    experts, -inf elsewhere. Ties go to the lower id (a stable sort), so the set is deterministic."""
    keep = torch.argsort(share.double(), descending=True, stable=True)[:top_n]
    bias = torch.full(share.shape, float("-inf"))
    bias[keep] = 0.0
    return bias


# -- k rules ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class KRules:
    """Per token of a forward: which k rules apply. Off is delta = inf, threshold = 0, k = 0, k_max = 0,
    narrow = 0."""

    delta: torch.Tensor  # [T] float32
    weight_boost: torch.Tensor  # [T] float32
    threshold: torch.Tensor  # [T] float32
    k: torch.Tensor | None = None  # [T] int64: decay_k's experts per token (unclamped); 0: the gate's top-k
    k_min: torch.Tensor | None = None  # [T] int64: confidence_k's and adaptive_k's floor
    k_max: torch.Tensor | None = None  # [T] int64: confidence_k's k_max; 0: not confidence_k
    narrow: torch.Tensor | None = None  # [T] float64: adaptive_k's experts fewer than top-k (inf: to k_min); 0: none

    @property
    def needs_confidence(self) -> bool:
        return self.k_max is not None and bool((self.k_max > 0).any())

    @property
    def any_widen(self) -> bool:
        return bool((self.threshold > 0).any())


def gate_scores(router_logits: torch.Tensor, sigmoid: bool) -> torch.Tensor:
    """router_logits [T, E] (bias included) -> the gate's scores [T, E] float32 the k rules compare."""
    logits = router_logits.float()
    return logits.sigmoid() if sigmoid else logits.softmax(dim=-1)


def top2_gap(scores: torch.Tensor) -> torch.Tensor:
    """scores [T, E] -> top-1 minus top-2 score [T]."""
    top = scores.topk(2, dim=-1).values  # [T, 2]
    return top[:, 0] - top[:, 1]


def widen_rows(gap: torch.Tensor, rules: KRules) -> torch.Tensor:
    """gap [T] -> bool [T]: the tokens that choose k + 1 experts."""
    return gap < rules.threshold


def decayed_k(t: torch.Tensor, k_start: torch.Tensor, decay: torch.Tensor, k_min: torch.Tensor) -> torch.Tensor:
    """decay_k: t [T] int64 (answer index, >= 0), k_start, decay, k_min [T] -> experts per token [T] int64,
    ``round(max(k_min, k_start * decay**t))`` with halves rounded up (float64, so it is the same anywhere).

    Example: k_start 4, decay 0.92, k_min 1 -> t = 0..3: 4, 4, 3, 3; t = 9: 2 (1.74); t = 17: 1 (0.97 -> k_min)."""
    k = torch.maximum(k_min.double(), k_start.double() * decay.double().pow(t.double()))  # [T]
    return torch.floor(k + 0.5).long()


def token_k(
    gap: torch.Tensor, rules: KRules, top_k: int, widest: int, confidence: torch.Tensor | None = None
) -> torch.Tensor:
    """Experts each token chooses [T] int64, in 1..widest: decay_k's k, confidence_k's (from ``confidence``
    [T], ``token_rules.gate_confidence``; needed when ``rules.needs_confidence``) or adaptive_k's (top_k less
    its narrowing, at least k_min), else the gate's top_k; plus one for the tokens ``widen_rows`` picks; at
    most ``widest`` (the most the gate can choose, ``gate_hook.widest_k``)."""
    k = torch.full(gap.shape, top_k, dtype=torch.long)
    if rules.k is not None:
        k = torch.where(rules.k > 0, rules.k, k)
    if rules.needs_confidence:
        k = torch.where(rules.k_max > 0, confidence_k(confidence, rules.k_min, rules.k_max), k)
    if rules.narrow is not None:
        narrowed = torch.maximum(rules.k_min.double(), top_k - rules.narrow.double()).clamp(max=top_k).long()
        k = torch.where(rules.narrow > 0, narrowed, k)
    k = k + widen_rows(gap, rules).long()
    return k.clamp(1, max(widest, 1))


def apply_k_rules(
    index: torch.Tensor,
    weights: torch.Tensor,
    gap: torch.Tensor,
    rules: KRules,
    num_experts: int,
    regated: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate's top-k after the k rules.

    index [T, K] int64, weights [T, K]: the architecture's choice; gap [T] from ``top2_gap``.
    regated: per k' != K that ``token_k`` gave some tokens, (rows [W] int64, index [W, k'], weights [W, k']):
    the architecture's own top-(k') of those tokens. They are never narrowed.
    Returns index and weights [T, max(K, k'...)]; unused slots hold ``num_experts`` with weight 0. Tokens no
    rule touches keep their slots bit for bit.
    """
    T, K = index.shape
    width = max([K, *(i.shape[1] for _, i, _ in regated)])
    if width > K:
        index = torch.cat([index, torch.full((T, width - K), num_experts, dtype=index.dtype)], dim=1)  # [T, width]
        weights = torch.cat([weights, weights.new_zeros(T, width - K)], dim=1)
    narrow = gap > rules.delta  # [T]
    for rows, some_index, some_weights in regated:
        k = some_index.shape[1]
        index[rows] = num_experts
        weights[rows] = 0
        index[rows, :k] = some_index.to(index.dtype)
        weights[rows, :k] = some_weights.to(weights.dtype)
        narrow[rows] = False
    if bool(narrow.any()):
        top = weights[narrow].argmax(dim=1)  # [N] the slot of each narrowed token's strongest expert
        kept_index = index[narrow].gather(1, top[:, None])  # [N, 1]
        kept_weight = weights[narrow].gather(1, top[:, None]) * rules.weight_boost[narrow, None].to(weights.dtype)
        index[narrow] = num_experts
        weights[narrow] = 0
        index[narrow, :1] = kept_index
        weights[narrow, :1] = kept_weight
    return index, weights


# -- gate modifiers --------------------------------------------------------------------------


def temper(logits: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """gate_temperature: logits [T, E'] / tau [T] (per row); rows with tau 1 are returned bit for bit."""
    tau = tau.to(logits.device, logits.dtype).reshape(*logits.shape[:-1], 1)  # [T, 1]
    return torch.where(tau != 1, logits / tau, logits)


def capacity_route(
    index: torch.Tensor,
    weights: torch.Tensor,
    scores: torch.Tensor,
    rank: torch.Tensor,
    factor: torch.Tensor,
    normalised: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """capacity at one layer of one step.

    index, weights [T, K']: the choice after the k rules (slots >= E unused); scores [T, E]: the gate's
    scores its weights are proportional to; rank [T, E]: what it selects by (-inf: an expert the token may
    not take, e.g. masked or restricted); factor [T]: capacity_factor, 0 for tokens without the rule.
    The tokens of one factor share ``cap = ceil(factor * slots / E)`` per expert (slots: their valid ones).
    Tokens in order, each token's slots by rank: a slot whose expert is full moves to the token's best-ranked
    expert that has room and that it has not chosen (ties: the lower id), with weight times the ratio of
    the two experts' scores; where ``normalised``, a token with a moved slot has its weights scaled back to
    their sum. A slot with nowhere to go stays. Returns index and weights [T, K']; other tokens untouched.

    Example: E 4, two tokens of factor 1 choosing {0, 1} each: cap 1, the second token moves to its
    next-best two of {2, 3}.
    """
    E = scores.shape[1]
    out_index, out_weights = index.clone(), weights.clone()
    for f in sorted({float(x) for x in factor[factor > 0].tolist()}):
        rows = (factor == f).nonzero().squeeze(1).tolist()
        valid = index[rows] < E  # [R, K']
        cap = math.ceil(round(f * int(valid.sum()) / E, 9))
        load = [0] * E
        order = torch.argsort(rank[rows].double(), dim=1, descending=True, stable=True).tolist()  # [R, E]
        ranks = rank[rows].double().tolist()  # [R, E]
        for i, row in enumerate(rows):
            chosen = index[row].tolist()
            mine = {e for e in chosen if e < E}
            row_weights = weights[row].double()
            moved = False
            for slot in sorted((s for s, e in enumerate(chosen) if e < E), key=lambda s: -ranks[i][chosen[s]]):
                e = chosen[slot]
                j = e
                if load[e] >= cap:
                    free = (j for j in order[i] if j not in mine and load[j] < cap and ranks[i][j] > -math.inf)
                    j = next(free, e)
                load[j] += 1
                if j == e:
                    continue
                mine.add(j)
                out_index[row, slot] = j
                old = float(scores[row, e])
                if old > 0:
                    row_weights[slot] = row_weights[slot] * float(scores[row, j]) / old
                moved = True
            if moved:
                if normalised and float(row_weights.sum()) > 0:
                    row_weights = row_weights * (float(weights[row].double().sum()) / float(row_weights.sum()))
                out_weights[row] = row_weights.to(weights.dtype)
    return out_index, out_weights


# -- one serving step ------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestRouting:
    """One request's routing: its policy, its domain, the per-layer biases its bias rule adds, and noisy_topk's
    seed (``seeded``)."""

    policy: RoutingPolicy = RoutingPolicy()
    domain: str | None = None
    biases: Mapping[int, torch.Tensor] = field(default_factory=dict)  # layer -> [E]
    seed: int = 0

    @property
    def is_plain(self) -> bool:
        """Routed by the stock gate and counted under no domain: needs nothing from the step."""
        return self.policy.is_exact and self.domain is None


def seeded(routing: RequestRouting | None, seed: int | None, request_id: str) -> RequestRouting | None:
    """``routing`` with noisy_topk's seed from the request's sampling ``seed`` or, without one, ``request_id``
    (``token_rules.request_seed``); unchanged when it has no noisy_topk."""
    if routing is None or "noisy_topk" not in routing.policy.rules:
        return routing
    return replace(routing, seed=request_seed(seed, request_id))


#: ``step_routing``'s ``widen`` for a sequence whose tokens take the stock gate, none of its policy's rules
STOCK = -1


@dataclass(frozen=True)
class Noise:
    """noisy_topk per token of a forward."""

    scale: torch.Tensor  # [T] float32 noise_scale; 0: none
    seed: torch.Tensor  # [T] int64 its request's seed
    t: torch.Tensor  # [T] int64 its place relative to the answer (``token_rules``' glossary)


@dataclass(frozen=True)
class StepRouting:
    """Per token of one forward: the bias each gate adds, the temperature, the k and capacity rules, and
    the domain it counts under."""

    biases: Mapping[int, torch.Tensor]  # layer -> [T, E]; a layer no token biases is absent
    k_rules: KRules | None  # None: no token has one
    domain_ids: torch.Tensor  # [T] int64 into ``domains``; -1: none
    domains: tuple[str, ...]
    temperature: torch.Tensor | None = None  # [T] float32 tau, 1: none; None: no token has one
    capacity: torch.Tensor | None = None  # [T] float32 capacity_factor, 0: none; None: no token has one
    noise: Noise | None = None  # None: no token has noisy_topk
    sticky: tuple[StickySequence, ...] = ()  # the sequences with sticky, by their rows


def step_routing(
    parts: Sequence[tuple[RequestRouting | None, int]],
    first_t: Sequence[int] | None = None,
    widen: Sequence[int] | None = None,
    queue: QueueSignal | None = None,
    states: Sequence[RoutingState | None] | None = None,
    exact: bool = False,
) -> StepRouting | None:
    """(routing, tokens) of each sequence in the step, in packing order -> the step's StepRouting, or
    None when every sequence is plain (then the forward is the stock one). ``first_t``: per sequence, the
    answer index of its first token here (its position + 1 - its prompt's length; at most 0 in the prompt,
    the tokens generated so far when decoding), which decay_k reads; None: each sequence's tokens are a
    whole prompt (all at t 0). ``widen``: per sequence, the experts its tokens choose whatever its k rules say
    (0: its rules decide; ``STOCK``: the stock gate, none of its rules), with no narrowing: the consistency
    guard's recomputed tokens (``serving.consistency_guard``). ``queue``: the scheduler's queue at the step's
    start, which adaptive_k reads (None: nothing queued). ``states``: per sequence, its ``RoutingState``, which
    sticky reads and writes (None: none kept, each step's trace starts from zeros). ``exact``: every sequence's
    tokens take the stock gate, whatever its policy (the anomaly monitor's fallback); domains are still counted."""
    widen = [STOCK] * len(parts) if exact else list(widen or [0] * len(parts))
    routings = [
        RequestRouting(domain=r.domain) if r is not None and w == STOCK else r or RequestRouting()
        for (r, _), w in zip(parts, widen)
    ]
    widen = [0 if w == STOCK else w for w in widen]
    if all(r.is_plain for r in routings) and not any(widen):
        return None
    counts = torch.tensor([n for _, n in parts])

    def per_token(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.repeat_interleave(torch.tensor(values, dtype=dtype), counts)  # [T]

    def uses(rule: str) -> list[bool]:
        return [rule in r.policy.rules for r in routings]

    # each token's place relative to the answer: what decay_k, noisy_topk and sticky read
    starts = torch.repeat_interleave(torch.tensor(list(first_t or [1 - n for _, n in parts]), dtype=torch.long), counts)
    offsets = torch.arange(len(starts)) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    answer_t = starts + offsets  # [T]

    biases = {}
    for layer in sorted({layer for r in routings for layer in r.biases}):
        zero = torch.zeros_like(next(r.biases[layer] for r in routings if layer in r.biases))
        rows = [r.biases.get(layer, zero) for r in routings]
        biases[layer] = torch.repeat_interleave(torch.stack(rows), counts, dim=0)  # [T, E]
    k_rules = None
    if any(r.policy.rules & set(K_RULES) for r in routings) or any(widen):
        k = None
        if any(uses("decay_k")):
            k = decayed_k(
                answer_t.clamp(min=0),  # [T] each token's answer index
                per_token([r.policy.k_start for r in routings], torch.float64),
                per_token([r.policy.decay for r in routings], torch.float64),
                per_token([r.policy.k_min for r in routings], torch.float64),
            )
            k = torch.where(per_token([float(u) for u in uses("decay_k")]) > 0, k, 0)
        delta = [r.policy.delta if u else math.inf for r, u in zip(routings, uses("delta_gap"))]
        threshold = [r.policy.threshold if u else 0.0 for r, u in zip(routings, uses("dynamic_k"))]
        k_max = [r.policy.k_max if u else 0 for r, u in zip(routings, uses("confidence_k"))]
        signal = queue or QueueSignal()
        narrow = [
            adaptive_narrow(signal, r.policy.queue_slo_ms) if u else 0.0 for r, u in zip(routings, uses("adaptive_k"))
        ]
        if any(widen):
            forced = per_token([float(w) for w in widen], torch.float64).long()  # [T]
            k = forced if k is None else torch.where(forced > 0, forced, k)
            delta = [math.inf if w else d for d, w in zip(delta, widen)]
            threshold = [0.0 if w else t for t, w in zip(threshold, widen)]
            k_max = [0 if w else m for m, w in zip(k_max, widen)]
            narrow = [0.0 if w else n for n, w in zip(narrow, widen)]
        setting = any(k_max) or any(narrow)
        k_rules = KRules(
            delta=per_token(delta),
            weight_boost=per_token([r.policy.weight_boost for r in routings]),
            threshold=per_token(threshold),
            k=k,
            k_min=per_token([float(r.policy.k_min) for r in routings], torch.float64).long() if setting else None,
            k_max=per_token([float(m) for m in k_max], torch.float64).long() if any(k_max) else None,
            narrow=per_token(narrow, torch.float64) if any(narrow) else None,
        )
    temperature = capacity = None
    if any(uses("gate_temperature")):
        temperature = per_token([r.policy.tau if u else 1.0 for r, u in zip(routings, uses("gate_temperature"))])
    if any(uses("capacity")):
        capacity = per_token([r.policy.capacity_factor if u else 0.0 for r, u in zip(routings, uses("capacity"))])
    noise = None
    if any(uses("noisy_topk")):
        noise = Noise(
            scale=per_token([r.policy.noise_scale if u else 0.0 for r, u in zip(routings, uses("noisy_topk"))]),
            seed=torch.repeat_interleave(torch.tensor([r.seed for r in routings], dtype=torch.long), counts),
            t=answer_t,
        )
    sticky = []
    ends = torch.cumsum(counts, 0).tolist()
    for i, (r, used) in enumerate(zip(routings, uses("sticky"))):
        if used and int(counts[i]) > 0:
            start = ends[i] - int(counts[i])
            state = states[i] if states is not None else None
            sticky.append(
                StickySequence(
                    start, ends[i], int(answer_t[start]), r.policy.sticky_strength, r.policy.sticky_decay, state
                )
            )
    domains = tuple(sorted({r.domain for r in routings if r.domain is not None}))
    ids = [domains.index(r.domain) if r.domain is not None else -1 for r in routings]
    return StepRouting(
        biases,
        k_rules,
        torch.repeat_interleave(torch.tensor(ids), counts),
        domains,
        temperature,
        capacity,
        noise,
        tuple(sticky),
    )
