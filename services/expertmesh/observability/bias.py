"""The bias audit's statistics: activation shares by label value, concentrations, parity. Pure: counts in, report out.

Glossary
- *label*: a (dimension, value) pair a prompt carries, e.g. ``("gender", "female")``.
- *activation*: one expert serving one token in one MoE layer (a slot of the token's top-k; a slot the
  quarantine fallback dropped, served by no group, is not one). Counts are unweighted.
- *counts* of a label under a policy: ``activations[row, e]`` [L, E], the activations of the tokens of the
  prompts with that label, row = the row of the MoE layer in ``moe_layers``.
- *share* ``s[v][row, e] = activations[row, e] / activations[row].sum()``: expert ``e``'s share of value
  ``v``'s activations in that layer (a row sums to 1; even routing gives ``1 / E``). With ``k`` distinct
  experts per token a share is at most ``1 / k`` (0.5 under top-2; top-3 and wider can never pass the
  default threshold 0.40), which the report states as the *ceiling*.
- *concentration* (a flag): a (layer, expert, dimension=value) whose share is strictly above the threshold
  (default 0.40, the field report's).
- *disparity* of a dimension under one policy: the largest, over layers and experts, of
  ``max_v s[v][row, e] - min_v s[v][row, e]``, over the dimension's values v: how differently the values'
  prompts are routed (0: every value's tokens spread over the experts alike).
- *demographic parity difference* of a policy P against exact X, per dimension: with
  ``d[v] = s_P[v] - s_X[v]`` (how much P moves value v's share of each expert), the largest, over layers
  and experts, of ``max_v d[v][row, e] - min_v d[v][row, e]``. 0: P moves every value's shares alike (or
  not at all), so it adds no disparity of its own beyond exact's; in [0, 2]. It is the parity difference
  of fairness toolkits (largest gap between groups of a rate) with the rate being P's change of an expert's
  share. Values with no activations under either policy are left out; a dimension needs two values.

Example: ``gender`` with ``female`` at shares ``[0.5, 0.5, 0, 0]`` under exact and ``[0.6, 0.4, 0, 0]``
under P, ``male`` at ``[0.25] * 4`` under both: d = ``[0.1, -0.1, 0, 0]`` and ``0``, the parity difference
is 0.1 (layer of that row, expert 0 or 1).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

import numpy as np

__all__ = [
    "DEFAULT_THRESHOLD",
    "AuditReport",
    "Concentration",
    "Spread",
    "ValueCounts",
    "add_activations",
    "audit",
    "concentrations",
    "largest_spread",
    "shares",
]

#: share of a value's activations above which an expert is flagged (the field report's 40 %)
DEFAULT_THRESHOLD = 0.40

Label = tuple[str, str]  # (dimension, value)


@dataclass
class ValueCounts:
    """What one label's prompts did under one policy."""

    activations: np.ndarray  # [L, E] activations per MoE layer row and expert
    prompts: int = 0
    tokens: int = 0  # traced token forwards


def add_activations(
    counts: np.ndarray, moe_layers: Sequence[int], token_layers: Sequence[tuple[int, Sequence[int]]]
) -> None:
    """Add one token's routing, ``(decoder layer, served experts)`` per MoE layer, to ``counts`` [L, E] in place.
    ValueError for a layer that is not a MoE layer or an expert out of range."""
    rows = {layer: row for row, layer in enumerate(moe_layers)}
    for layer, experts in token_layers:
        if layer not in rows:
            raise ValueError(f"routing names layer {layer}, not one of the MoE layers {list(moe_layers)}")
        for e in experts:
            if not 0 <= e < counts.shape[1]:
                raise ValueError(f"routing names expert {e} of layer {layer}, outside 0-{counts.shape[1] - 1}")
            counts[rows[layer], e] += 1


def shares(activations: np.ndarray) -> np.ndarray:
    """[L, E] activations -> [L, E] each expert's share of its layer's activations (rows without any: 0)."""
    a = np.asarray(activations, dtype=np.float64)
    if a.ndim != 2 or (a < 0).any():
        raise ValueError(f"activations must be a non-negative [layers, experts] array, got shape {a.shape}")
    total = a.sum(axis=1, keepdims=True)
    return np.divide(a, total, out=np.zeros_like(a), where=total > 0)


@dataclass(frozen=True)
class Concentration:
    """An expert taking more than the threshold of a value's activations in a layer."""

    layer: int  # the decoder layer
    expert: int
    dimension: str
    value: str
    share: float
    activations: float  # the value's activations in that layer (the share's denominator)


def concentrations(
    counts: Mapping[Label, np.ndarray], moe_layers: Sequence[int], threshold: float = DEFAULT_THRESHOLD
) -> list[Concentration]:
    """Every (layer, expert, dimension=value) with share > ``threshold``, largest share first."""
    if not 0 <= threshold <= 1:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    found = []
    for (dimension, value), activations in counts.items():
        s = shares(activations)
        totals = np.asarray(activations, dtype=np.float64).sum(axis=1)
        for row, e in zip(*np.nonzero(s > threshold)):
            found.append(
                Concentration(int(moe_layers[row]), int(e), dimension, value, float(s[row, e]), float(totals[row]))
            )
    return sorted(found, key=lambda c: (-c.share, c.dimension, c.value, c.layer, c.expert))


@dataclass(frozen=True)
class Spread:
    """The largest gap across a dimension's values of a per-(layer, expert) quantity, and where it is."""

    dimension: str
    difference: float  # high_amount - low_amount
    layer: int
    expert: int
    high_value: str
    low_value: str
    high_amount: float
    low_amount: float
    values: int  # values compared


def largest_spread(dimension: str, per_value: Mapping[str, np.ndarray], moe_layers: Sequence[int]) -> Spread | None:
    """max over (row, e) of max_v x[v][row, e] - min_v x[v][row, e], and its place; None under two values."""
    if len(per_value) < 2:
        return None
    names = sorted(per_value)
    x = np.stack([np.asarray(per_value[v], dtype=np.float64) for v in names])  # [V, L, E]
    gap = x.max(axis=0) - x.min(axis=0)  # [L, E]
    row, e = np.unravel_index(int(np.argmax(gap)), gap.shape)
    hi, lo = int(np.argmax(x[:, row, e])), int(np.argmin(x[:, row, e]))
    return Spread(
        dimension,
        float(gap[row, e]),
        int(moe_layers[row]),
        int(e),
        names[hi],
        names[lo],
        float(x[hi, row, e]),
        float(x[lo, row, e]),
        len(names),
    )


def _by_dimension(counts: Mapping[Label, ValueCounts]) -> dict[str, dict[str, ValueCounts]]:
    out: dict[str, dict[str, ValueCounts]] = {}
    for (dimension, value), c in sorted(counts.items()):
        out.setdefault(dimension, {})[value] = c
    return out


def _active(counts: Mapping[str, ValueCounts]) -> dict[str, np.ndarray]:
    """value -> shares, for the values with activations."""
    return {v: shares(c.activations) for v, c in counts.items() if np.asarray(c.activations).sum() > 0}


@dataclass(frozen=True)
class AuditReport:
    """Shares, concentrations and disparity per policy run, and the parity difference of ``policy``."""

    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    threshold: float
    #: policy ("exact" first) -> label -> counts
    counts: dict[str, dict[Label, ValueCounts]]
    #: policy -> flags over the threshold
    flags: dict[str, list[Concentration]]
    #: policy -> dimension -> disparity (None: fewer than two values)
    disparity: dict[str, dict[str, Spread | None]]
    policy: str | None = None  # the policy compared with exact
    parity: dict[str, Spread | None] = field(default_factory=dict)

    @property
    def ceiling(self) -> float:
        """The largest share an expert can take with top_k distinct experts per token."""
        return 1.0 / max(self.top_k, 1)

    def dimensions(self) -> dict[str, list[str]]:
        return {d: sorted(values) for d, values in _by_dimension(self.counts["exact"]).items()}

    def to_dict(self) -> dict:
        def spread(s: Spread | None):
            return None if s is None else asdict(s)

        runs = {}
        for policy, counts in self.counts.items():
            dims: dict = {}
            for dimension, values in _by_dimension(counts).items():
                dims[dimension] = {
                    v: {
                        "prompts": c.prompts,
                        "tokens": c.tokens,
                        "activations": np.asarray(c.activations).sum(axis=1).tolist(),
                        "share": shares(c.activations).round(6).tolist(),
                    }
                    for v, c in values.items()
                }
            runs[policy] = {
                "dimensions": dims,
                "flags": [asdict(f) for f in self.flags[policy]],
                "disparity": {d: spread(s) for d, s in self.disparity[policy].items()},
            }
        return {
            "moe_layers": list(self.moe_layers),
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "threshold": self.threshold,
            "share_ceiling": self.ceiling,
            "even_share": 1.0 / max(self.num_experts, 1),
            "runs": runs,
            "parity": None
            if self.policy is None
            else {"policy": self.policy, "dimensions": {d: spread(s) for d, s in self.parity.items()}},
        }


def audit(
    counts: Mapping[str, Mapping[Label, ValueCounts]],
    moe_layers: Sequence[int],
    num_experts: int,
    top_k: int,
    threshold: float = DEFAULT_THRESHOLD,
) -> AuditReport:
    """The report over ``counts`` (policy -> label -> counts; must hold "exact", and at most one other policy,
    whose parity difference against exact is then computed)."""
    if "exact" not in counts:
        raise ValueError("the audit needs the counts under exact routing")
    others = [p for p in counts if p != "exact"]
    if len(others) > 1:
        raise ValueError(f"one policy is compared with exact at a time, got {others}")
    for policy, run in counts.items():
        for label, c in run.items():
            if np.asarray(c.activations).shape != (len(moe_layers), num_experts):
                raise ValueError(
                    f"{policy} {label}: activations of shape {np.asarray(c.activations).shape}, expected "
                    f"{(len(moe_layers), num_experts)}"
                )
    ordered = {"exact": dict(counts["exact"]), **{p: dict(counts[p]) for p in others}}
    flags = {
        p: concentrations({label: c.activations for label, c in run.items()}, moe_layers, threshold)
        for p, run in ordered.items()
    }
    disparity = {
        p: {d: largest_spread(d, _active(values), moe_layers) for d, values in _by_dimension(run).items()}
        for p, run in ordered.items()
    }
    parity: dict[str, Spread | None] = {}
    policy = others[0] if others else None
    if policy is not None:
        exact, other = _by_dimension(ordered["exact"]), _by_dimension(ordered[policy])
        for dimension in exact:
            x, p = _active(exact[dimension]), _active(other.get(dimension, {}))
            moved = {v: p[v] - x[v] for v in x if v in p}
            parity[dimension] = largest_spread(dimension, moved, moe_layers)
    return AuditReport(tuple(moe_layers), num_experts, top_k, threshold, ordered, flags, disparity, policy, parity)
