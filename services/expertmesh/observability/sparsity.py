"""How sparse and how balanced a model's routing is, from the router's load counts. Pure: numpy in, dataclasses out.

Input is ``load[row, e]`` (tokens whose top-k chose expert ``e`` in the MoE layer
of that row; rows are the MoE layers in order, as in ``GetLoadStats``) plus the
model's parameter counts (``ListModels``).

Glossary (``L`` MoE layers, ``E`` experts per layer, ``k`` = top_k)
- *pairs* of a layer: routed (token, expert) pairs, ``load[row].sum()``.
- *tokens* of a layer: tokens that went through it, ``pairs / k`` (every token
  picks ``k`` experts; the stats carry no separate token count, so pass
  ``tokens=`` when it is known otherwise).
- *pairs per token*: ``pairs / tokens`` (= ``k`` unless expert-parallel
  sentinels dropped some choices).
- *active parameters per token*: ``dense_parameters + sum over layers of
  pairs_per_token * parameters_per_expert``: the weights one token touches.
  ``dense_parameters`` is everything but the routed experts (attention,
  embeddings, gates, shared experts); ``parameters_per_expert`` is one routed
  expert of one layer. *Share* = active / total parameters.
- *utilisation* of expert ``e``: ``load[e] / (tokens * k / E)``, its load over
  its fair share; 1.0 everywhere is perfect balance, 0 is never chosen.
- *never used*: load 0. *Rarely used*: ``0 < utilisation < rare_threshold``
  (0.1 by default).
- *load std*: population standard deviation of ``load[row]`` in tokens;
  *load CV* = std / mean, comparable across traffic volumes.
- *routing entropy*: Shannon entropy in bits of ``load[row] / pairs``; its
  maximum is ``log2(E)`` (uniform routing), 0 when one expert takes everything.
- *group load*: the pairs an expert group serves in a layer; an expert hosted
  by several groups (replicas) counts a ``1/replicas`` share to each, as the
  router splits its tokens evenly by default.
- *balancedness* of a layer: mean group load / max group load over the groups
  that host at least one expert of that layer; 1.0 = every group equally busy,
  ``1/G`` = one group does all the work. ``None`` when the layer saw no load.
- *spread* of active parameters per token: from the router's ``experts_per_token[q, h]``
  (tokens of finished sequences whose prompt length is in query-length bucket ``q``
  that were served by ``h`` experts over all MoE layers), each token's active
  parameters are ``dense_parameters + h * parameters_per_expert``; p5 / p50 / p95 are
  nearest-rank percentiles (the smallest value at least that share of tokens reach,
  numpy's ``inverted_cdf``), overall and per bucket. Constant under the exact policy
  (every token ``L * k``); policies that vary k (delta_gap, dynamic_k, decay_k) spread it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

DEFAULT_RARE_THRESHOLD = 0.1


@dataclass(frozen=True)
class ModelShape:
    """What the computations need to know about the model (from ``ListModels``)."""

    name: str
    moe_layers: tuple[int, ...]  # decoder-layer index of each row
    num_experts: int
    top_k: int
    total_parameters: int
    dense_parameters: int
    parameters_per_expert: int


@dataclass(frozen=True)
class LayerSparsity:
    layer: int  # decoder-layer index
    load: tuple[float, ...]  # [E] the input counts
    tokens: float
    pairs_per_token: float
    #: routed-expert parameters one token activates in this layer
    active_expert_parameters: float
    load_std: float
    load_cv: float
    utilisation: tuple[float, ...]  # [E]
    entropy_bits: float
    max_entropy_bits: float
    never_used: tuple[int, ...]
    rarely_used: tuple[int, ...]
    group_load: dict[str, float]  # groups hosting part of this layer -> pairs served
    balancedness: float | None

    @property
    def entropy_ratio(self) -> float:
        return self.entropy_bits / self.max_entropy_bits if self.max_entropy_bits > 0 else 1.0


@dataclass(frozen=True)
class Spread:
    """Active parameters per token of some tokens: how many, and their p5 / p50 / p95 (None: no tokens)."""

    label: str  # "all", or the query-length bucket ("17-64")
    tokens: float
    p5: float | None
    p50: float | None
    p95: float | None


PERCENTILES = (5, 50, 95)


def histogram_percentile(counts: np.ndarray, q: float) -> int | None:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of integer values, ``counts[v]`` tokens at value
    ``v``: the smallest ``v`` whose cumulative count reaches ``q / 100`` of all (numpy's ``inverted_cdf``).
    None when there are no tokens."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum()
    if total <= 0:
        return None
    if not 0 < q <= 100:
        raise ValueError(f"a percentile is in (0, 100], got {q}")
    return int(np.searchsorted(np.cumsum(counts), q / 100 * total - 1e-9 * total))


def active_spread(experts_per_token: np.ndarray, model: ModelShape, bucket_labels: Sequence[str]) -> tuple[Spread, ...]:
    """The spread of active parameters per token: overall ("all") first, then per query-length bucket.
    ``experts_per_token`` [Q, H] (Q = len(bucket_labels)); raises ValueError when the shapes disagree."""
    counts = np.asarray(experts_per_token, dtype=np.float64)
    if counts.ndim != 2 or counts.shape[0] != len(bucket_labels):
        raise ValueError(f"experts_per_token has shape {counts.shape}, expected ({len(bucket_labels)} buckets, H)")

    def spread(label: str, row: np.ndarray) -> Spread:
        values = [histogram_percentile(row, q) for q in PERCENTILES]
        params = [
            None if v is None else float(model.dense_parameters + v * model.parameters_per_expert) for v in values
        ]
        return Spread(label, float(row.sum()), *params)

    return (spread("all", counts.sum(axis=0)), *(spread(b, row) for b, row in zip(bucket_labels, counts)))


@dataclass(frozen=True)
class SparsityReport:
    model: ModelShape
    tokens: float  # tokens through the busiest layer (every token passes every MoE layer)
    active_parameters_per_token: float
    active_share: float  # of total_parameters
    layers: tuple[LayerSparsity, ...]
    rare_threshold: float
    #: how the expert -> group map was obtained, e.g. "contiguous split over g0, g1 (assumed)"
    placement: str
    #: active parameters per token of finished sequences: overall, then per query-length bucket (empty: unknown)
    spread: tuple[Spread, ...] = ()

    @property
    def mean_load_std(self) -> float:
        return float(np.mean([layer.load_std for layer in self.layers]))

    @property
    def mean_load_cv(self) -> float:
        return float(np.mean([layer.load_cv for layer in self.layers]))

    @property
    def mean_entropy_bits(self) -> float:
        return float(np.mean([layer.entropy_bits for layer in self.layers]))

    @property
    def max_entropy_bits(self) -> float:
        return math.log2(self.model.num_experts) if self.model.num_experts > 0 else 0.0

    @property
    def mean_entropy_ratio(self) -> float:
        return float(np.mean([layer.entropy_ratio for layer in self.layers]))

    @property
    def mean_balancedness(self) -> float | None:
        values = [layer.balancedness for layer in self.layers if layer.balancedness is not None]
        return float(np.mean(values)) if values else None

    @property
    def min_utilisation(self) -> float:
        return float(min(min(layer.utilisation) for layer in self.layers))

    @property
    def max_utilisation(self) -> float:
        return float(max(max(layer.utilisation) for layer in self.layers))

    def to_dict(self) -> dict:
        """JSON-ready: per layer and overall."""
        layers = []
        for layer in self.layers:
            row = asdict(layer)
            row["load"] = list(layer.load)
            row["utilisation"] = list(layer.utilisation)
            row["never_used"] = list(layer.never_used)
            row["rarely_used"] = list(layer.rarely_used)
            row["entropy_ratio"] = layer.entropy_ratio
            layers.append(row)
        return {
            "model": asdict(self.model) | {"moe_layers": list(self.model.moe_layers)},
            "placement": self.placement,
            "rare_threshold": self.rare_threshold,
            "overall": {
                "tokens": self.tokens,
                "active_parameters_per_token": self.active_parameters_per_token,
                "active_share": self.active_share,
                "mean_load_std": self.mean_load_std,
                "mean_load_cv": self.mean_load_cv,
                "mean_entropy_bits": self.mean_entropy_bits,
                "max_entropy_bits": self.max_entropy_bits,
                "mean_entropy_ratio": self.mean_entropy_ratio,
                "min_utilisation": self.min_utilisation,
                "max_utilisation": self.max_utilisation,
                "never_used": sum(len(layer.never_used) for layer in self.layers),
                "rarely_used": sum(len(layer.rarely_used) for layer in self.layers),
                "mean_balancedness": self.mean_balancedness,
            },
            "active_parameters_per_token_spread": {
                "overall": _spread_dict(self.spread[0]) if self.spread else None,
                "by_query_length": [{"query_length": s.label, **_spread_dict(s)} for s in self.spread[1:]],
            },
            "layers": layers,
        }


def _spread_dict(spread: Spread) -> dict:
    return {"tokens": spread.tokens, "p5": spread.p5, "p50": spread.p50, "p95": spread.p95}


def group_shares(
    groups: Mapping[str, Iterable[tuple[int, int]]], moe_layers: Sequence[int], num_experts: int
) -> tuple[tuple[str, ...], np.ndarray]:
    """``groups[name]`` = (layer, expert) pairs it hosts -> (names, shares [G, L, E]).

    ``shares[g, row, e]`` is the part of expert ``e``'s load in that row that group
    ``g`` serves: ``1 / replicas`` for each group hosting it, 0 elsewhere.
    """
    names = tuple(groups)
    row_of = {layer: i for i, layer in enumerate(moe_layers)}
    hosted = np.zeros((len(names), len(moe_layers), num_experts))  # [G, L, E]
    for g, name in enumerate(names):
        for layer, expert in groups[name]:
            if layer in row_of and 0 <= expert < num_experts:
                hosted[g, row_of[layer], expert] = 1.0
    replicas = hosted.sum(axis=0)  # [L, E]
    return names, np.divide(hosted, replicas, out=np.zeros_like(hosted), where=replicas > 0)


def entropy_bits(counts: np.ndarray) -> float:
    """Shannon entropy (bits) of the distribution proportional to ``counts`` [E]; 0 for all-zero counts."""
    total = counts.sum()
    if total <= 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(max(0.0, -(p * np.log2(p)).sum()))


def balancedness(group_load: np.ndarray) -> float | None:
    """mean / max of the loads [G] of the groups in play; None when all are 0."""
    if group_load.size == 0 or group_load.max() <= 0:
        return None
    return float(group_load.mean() / group_load.max())


def analyse(
    load: np.ndarray,
    model: ModelShape,
    groups: Mapping[str, Iterable[tuple[int, int]]] | None = None,
    placement: str = "",
    rare_threshold: float = DEFAULT_RARE_THRESHOLD,
    tokens: Sequence[float] | None = None,
) -> SparsityReport:
    """The sparsity report of ``load`` [L, E] (rows = ``model.moe_layers``).

    ``groups`` maps group name -> hosted (layer, expert) pairs (a
    ``GroupPlacement.groups``); None means one group holding everything.
    ``tokens`` [L] overrides the per-layer token counts derived from the load.
    Raises ValueError when the shapes disagree or there is no load at all.
    """
    load = np.asarray(load, dtype=np.float64)
    L, E, k = len(model.moe_layers), model.num_experts, model.top_k
    if load.shape != (L, E):
        raise ValueError(f"load has shape {load.shape}, expected {(L, E)} (MoE layers x experts)")
    if (load < 0).any():
        raise ValueError("load counts must be non-negative")
    if load.sum() <= 0:
        raise ValueError("no routed tokens in the load counts")
    if tokens is not None and len(tokens) != L:
        raise ValueError(f"tokens has {len(tokens)} entries, expected {L}")
    if groups is None:
        groups = {"all": [(layer, e) for layer in model.moe_layers for e in range(E)]}
    names, shares = group_shares(groups, model.moe_layers, E)  # [G, L, E]
    max_entropy = math.log2(E) if E > 0 else 0.0

    layers = []
    for row, layer in enumerate(model.moe_layers):
        counts = load[row]  # [E]
        pairs = float(counts.sum())
        n_tokens = float(tokens[row]) if tokens is not None else pairs / k
        pairs_per_token = pairs / n_tokens if n_tokens > 0 else 0.0
        fair = n_tokens * k / E  # the load of each expert under perfect balance
        utilisation = counts / fair if fair > 0 else np.zeros(E)
        mean = counts.mean()
        std = float(counts.std())
        in_play = shares[:, row, :].sum(axis=1) > 0  # [G] groups hosting part of this layer
        served = shares[:, row, :] @ counts  # [G]
        layers.append(
            LayerSparsity(
                layer=int(layer),
                load=tuple(float(c) for c in counts),
                tokens=n_tokens,
                pairs_per_token=pairs_per_token,
                active_expert_parameters=pairs_per_token * model.parameters_per_expert,
                load_std=std,
                load_cv=std / mean if mean > 0 else 0.0,
                utilisation=tuple(float(u) for u in utilisation),
                entropy_bits=entropy_bits(counts),
                max_entropy_bits=max_entropy,
                never_used=tuple(int(e) for e in np.flatnonzero(counts == 0)),
                rarely_used=tuple(int(e) for e in np.flatnonzero((counts > 0) & (utilisation < rare_threshold))),
                group_load={names[g]: float(served[g]) for g in np.flatnonzero(in_play)},
                balancedness=balancedness(served[in_play]),
            )
        )
    active = model.dense_parameters + sum(layer.active_expert_parameters for layer in layers)
    return SparsityReport(
        model=model,
        tokens=max(layer.tokens for layer in layers),
        active_parameters_per_token=float(active),
        active_share=float(active / model.total_parameters) if model.total_parameters > 0 else 0.0,
        layers=tuple(layers),
        rare_threshold=rare_threshold,
        placement=placement,
    )
