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
  widen when torn); a token that widens is never narrowed.

Bias rules are logits added before the architecture's own selection (``gate_hook``); k rules transform its
top-k afterwards, so a token's choice may have 1..k+1 valid slots: the rest carry the skip sentinel
``num_experts`` with weight 0, which the dispatch plan and the load window skip.

In a serving step every token carries its own request's rules (``StepRouting``); tokens of ``exact``
requests get a zero bias and no k rule, so their routing is bit-identical to the stock gate's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

EXACT = "exact"
BIAS_RULES = ("prefer", "restrict")
K_RULES = ("delta_gap", "dynamic_k")
RULES = BIAS_RULES + K_RULES


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


def parameters(top_k: int, num_experts: int) -> tuple[Parameter, ...]:
    """Every rule's parameters for a model with ``num_experts`` experts chosen ``top_k`` at a time."""
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
    )


DESCRIPTIONS = {
    EXACT: "the stock gate, bit-identical (default)",
    "prefer": "bias the gate toward the domain's strong experts, away from its weak ones",
    "restrict": "choose only among the domain's top-N experts of each layer",
    "delta_gap": "top-1 when the gate is sure (top-1/top-2 gap above delta)",
    "dynamic_k": "top-(k+1) when the top-2 scores are within threshold",
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
        return {
            p: getattr(self, p)
            for p in ("alpha", "top_n", "delta", "weight_boost", "threshold")
            if _RULE_OF[p] in self.rules
        }

    @property
    def key(self) -> str:
        """Name and active parameters, e.g. ``prefer+delta_gap(alpha=1,delta=0.18,weight_boost=1.2)``: what
        a quality record is filed under."""
        params = ",".join(f"{k}={v:g}" for k, v in self.active().items())
        return f"{self.name}({params})" if params else self.name


_RULE_OF = {
    "alpha": "prefer",
    "top_n": "restrict",
    "delta": "delta_gap",
    "weight_boost": "delta_gap",
    "threshold": "dynamic_k",
}


def policy_names() -> tuple[str, ...]:
    """Every accepted name: exact, each rule, and the sensible combinations (one bias rule, any k rules)."""
    k_sets = [(), ("delta_gap",), ("dynamic_k",), K_RULES]
    names = [EXACT]
    for bias in ((), *((b,) for b in BIAS_RULES)):
        names += ["+".join(bias + ks) for ks in k_sets if bias or ks]
    return tuple(names)


def parse_policy(
    name: str, given: Mapping[str, float], top_k: int, num_experts: int, field_prefix: str = "routing_policy"
) -> RoutingPolicy:
    """``name`` ('' means exact) and the parameters the caller set -> a RoutingPolicy, or PolicyError
    naming the field. A parameter of a rule the policy does not use is refused rather than ignored."""
    name = name.strip() or EXACT
    rules = [] if name == EXACT else name.split("+")
    if any(r not in RULES for r in rules) or len(set(rules)) != len(rules):
        raise PolicyError(f"{field_prefix}.name", f"unknown policy {name!r}; known: {', '.join(policy_names())}")
    if len(set(rules) & set(BIAS_RULES)) > 1:
        raise PolicyError(f"{field_prefix}.name", "prefer and restrict do not combine: choose one bias rule")
    values = {}
    for p in parameters(top_k, num_experts):
        if p.name not in given:
            values[p.name] = int(p.default) if p.integer else p.default
            continue
        value = given[p.name]
        where = f"{field_prefix}.{p.name}"
        if p.rule not in rules:
            raise PolicyError(where, f"is a parameter of {p.rule}, which policy {name!r} does not use")
        if not math.isfinite(value) or not p.low <= value <= p.high or (p.integer and value != int(value)):
            kind = "an integer" if p.integer else "a number"
            raise PolicyError(where, f"must be {kind} in [{p.low:g}, {p.high:g}], got {value:g}")
        values[p.name] = int(value) if p.integer else float(value)
    return RoutingPolicy(rules=frozenset(rules), **values)


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
    """Per token of a forward: which k rules apply. Off is delta = inf, threshold = 0."""

    delta: torch.Tensor  # [T] float32
    weight_boost: torch.Tensor  # [T] float32
    threshold: torch.Tensor  # [T] float32

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


def apply_k_rules(
    index: torch.Tensor,
    weights: torch.Tensor,
    gap: torch.Tensor,
    rules: KRules,
    num_experts: int,
    wide: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate's top-k after the k rules.

    index [T, K] int64, weights [T, K]: the architecture's choice; gap [T] from ``top2_gap``.
    wide: (rows [W] int64, index [W, K+1], weights [W, K+1]): the architecture's top-(k+1) of the tokens
    ``widen_rows`` picked, or None when none did.
    Returns index and weights [T, K] ([T, K+1] when any token widened); unused slots hold ``num_experts``
    with weight 0. Tokens no rule touches keep their slots bit for bit.
    """
    T = index.shape[0]
    if wide is not None:
        index = torch.cat([index, torch.full((T, 1), num_experts, dtype=index.dtype)], dim=1)  # [T, K+1]
        weights = torch.cat([weights, weights.new_zeros(T, 1)], dim=1)
        rows, wide_index, wide_weights = wide
        index[rows] = wide_index.to(index.dtype)
        weights[rows] = wide_weights.to(weights.dtype)
    narrow = gap > rules.delta  # [T]
    if wide is not None:
        narrow[wide[0]] = False
    if bool(narrow.any()):
        top = weights[narrow].argmax(dim=1)  # [N] the slot of each narrowed token's strongest expert
        kept_index = index[narrow].gather(1, top[:, None])  # [N, 1]
        kept_weight = weights[narrow].gather(1, top[:, None]) * rules.weight_boost[narrow, None].to(weights.dtype)
        index[narrow] = num_experts
        weights[narrow] = 0
        index[narrow, :1] = kept_index
        weights[narrow, :1] = kept_weight
    return index, weights


# -- one serving step ------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestRouting:
    """One request's routing: its policy, its domain, and the per-layer biases its bias rule adds."""

    policy: RoutingPolicy = RoutingPolicy()
    domain: str | None = None
    biases: Mapping[int, torch.Tensor] = field(default_factory=dict)  # layer -> [E]

    @property
    def is_plain(self) -> bool:
        """Routed by the stock gate and counted under no domain: needs nothing from the step."""
        return self.policy.is_exact and self.domain is None


@dataclass(frozen=True)
class StepRouting:
    """Per token of one forward: the bias each gate adds, the k rules, and the domain it counts under."""

    biases: Mapping[int, torch.Tensor]  # layer -> [T, E]; a layer no token biases is absent
    k_rules: KRules | None  # None: no token has one
    domain_ids: torch.Tensor  # [T] int64 into ``domains``; -1: none
    domains: tuple[str, ...]


def step_routing(parts: Sequence[tuple[RequestRouting | None, int]]) -> StepRouting | None:
    """(routing, tokens) of each sequence in the step, in packing order -> the step's StepRouting, or
    None when every sequence is plain (then the forward is the stock one)."""
    routings = [r or RequestRouting() for r, _ in parts]
    if all(r.is_plain for r in routings):
        return None
    counts = torch.tensor([n for _, n in parts])
    biases = {}
    for layer in sorted({layer for r in routings for layer in r.biases}):
        zero = torch.zeros_like(next(r.biases[layer] for r in routings if layer in r.biases))
        rows = [r.biases.get(layer, zero) for r in routings]
        biases[layer] = torch.repeat_interleave(torch.stack(rows), counts, dim=0)  # [T, E]
    k_rules = None
    if any(r.policy.rules & set(K_RULES) for r in routings):

        def per_token(values: list[float]) -> torch.Tensor:
            return torch.repeat_interleave(torch.tensor(values, dtype=torch.float32), counts)  # [T]

        k_rules = KRules(
            delta=per_token([r.policy.delta if "delta_gap" in r.policy.rules else math.inf for r in routings]),
            weight_boost=per_token([r.policy.weight_boost for r in routings]),
            threshold=per_token([r.policy.threshold if "dynamic_k" in r.policy.rules else 0.0 for r in routings]),
        )
    domains = tuple(sorted({r.domain for r in routings if r.domain is not None}))
    ids = [domains.index(r.domain) if r.domain is not None else -1 for r in routings]
    return StepRouting(biases, k_rules, torch.repeat_interleave(torch.tensor(ids), counts), domains)
