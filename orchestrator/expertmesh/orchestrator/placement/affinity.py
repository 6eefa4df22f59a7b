"""Domain affinity: co-locate experts that the same domain's tokens use together.

Glossary
--------
affinity
    ``share[l, d, e]``: of domain ``d``'s expert choices in MoE layer ``l``, the
    fraction that went to expert ``e`` (each row sums to 1), with ``weight[d]``
    the fraction of traffic from domain ``d``. Built from capability profiles.
groups touched per token
    How many distinct expert groups (here: GPUs, one group per GPU) one token's
    top-k choice reaches in one layer. Each group touched is one dispatch and one
    partial sum to wait for, so fewer is cheaper. Expected value, with
    ``P[d, g] = sum_e share[l, d, e] * shares[l, e, g]`` the chance that one pick
    of a domain-``d`` token lands on GPU ``g``:
    ``sum_d weight[d] sum_g 1 - (1 - P[d, g])**k`` (picks treated as independent).

The refinement (``colocate``) exchanges replicas between GPUs, or moves one into
a free slot, best exchange first, while no GPU rises above a cap, so the plan's
balance guarantee holds by construction. Pure and deterministic: ties go to the
lowest index.

Affinity file (JSON), as ``expertmesh plan --profiles`` reads it::

    {"domains": ["code", "legal"], "weight": [0.6, 0.4],
     "share": [[[...E shares...], ...D rows], ...L layers]}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from expertmesh.contracts.errors import InputError

# Shares are fractions; a row may miss 1 by this much from rounding in a JSON export.
_ROW_TOLERANCE = 1e-3


@dataclass(frozen=True, eq=False)
class DomainAffinity:
    domains: tuple[str, ...]  # [D]
    share: np.ndarray  # [L, D, E] float64, rows sum to 1
    weight: np.ndarray  # [D] float64, sums to 1

    def __post_init__(self) -> None:
        if self.share.ndim != 3 or self.share.shape[1] != len(self.domains) or not self.domains:
            raise InputError(
                f"affinity: share must be [layers, {len(self.domains)} domains, experts], got {list(self.share.shape)}"
            )
        if self.weight.shape != (len(self.domains),):
            raise InputError(f"affinity: weight must hold one number per domain ({len(self.domains)})")
        for name, arr in (("share", self.share), ("weight", self.weight)):
            if not np.all(np.isfinite(arr)) or (arr < 0).any():
                raise InputError(f"affinity: {name} must hold finite, non-negative numbers")
        if np.abs(self.share.sum(axis=2) - 1).max() > _ROW_TOLERANCE:
            raise InputError("affinity: each layer's share row of a domain must sum to 1")
        if abs(self.weight.sum() - 1) > _ROW_TOLERANCE:
            raise InputError("affinity: domain weights must sum to 1")

    @property
    def num_layers(self) -> int:
        return self.share.shape[0]

    @property
    def num_experts(self) -> int:
        return self.share.shape[2]

    def check_shape(self, num_layers: int, num_experts: int) -> None:
        if (self.num_layers, self.num_experts) != (num_layers, num_experts):
            raise InputError(
                f"affinity covers {self.num_layers} layers x {self.num_experts} experts,"
                f" the stats {num_layers} x {num_experts}"
            )


def affinity_from_counts(domains: tuple[str, ...], counts: np.ndarray) -> DomainAffinity:
    """counts [L, D, E] tokens per (layer, domain, expert) -> affinity; domains with no tokens are dropped."""
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim != 3 or counts.shape[1] != len(domains):
        raise InputError(
            f"affinity: counts must be [layers, {len(domains)} domains, experts], got {list(counts.shape)}"
        )
    per_domain = counts.sum(axis=2)  # [L, D]
    seen = per_domain.min(axis=0) > 0
    if not seen.any():
        raise InputError("affinity: no domain has tokens in every layer")
    counts, per_domain = counts[:, seen], per_domain[:, seen]
    total = per_domain.sum(axis=0)
    return DomainAffinity(
        tuple(d for d, keep in zip(domains, seen) if keep), counts / per_domain[:, :, None], total / total.sum()
    )


def affinity_from_dict(doc: Any) -> DomainAffinity:
    if not isinstance(doc, dict) or not all(k in doc for k in ("domains", "weight", "share")):
        raise InputError("affinity file must be a JSON object with domains, weight and share")
    domains = doc["domains"]
    if not isinstance(domains, list) or not all(isinstance(d, str) and d for d in domains):
        raise InputError("affinity: domains must be a list of non-empty strings")
    try:
        share = np.asarray(doc["share"], dtype=np.float64)
        weight = np.asarray(doc["weight"], dtype=np.float64)
    except (ValueError, TypeError):
        raise InputError("affinity: share and weight must be rectangular arrays of numbers") from None
    return DomainAffinity(tuple(domains), share, weight)


def affinity_to_dict(affinity: DomainAffinity) -> dict[str, Any]:
    return {"domains": list(affinity.domains), "weight": affinity.weight.tolist(), "share": affinity.share.tolist()}


def parse_affinity_json(text: str) -> DomainAffinity:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError(f"affinity file is not valid JSON: {err}") from None
    return affinity_from_dict(doc)


def _touched(p: np.ndarray, top_k: int) -> np.ndarray:
    return 1.0 - (1.0 - np.clip(p, 0.0, 1.0)) ** top_k


def groups_per_token(affinity: DomainAffinity, shares: np.ndarray, top_k: int) -> np.ndarray:
    """[L] expected GPUs touched per token per layer, traffic-weighted over domains."""
    p = affinity.share @ shares  # [L, D, G]
    return np.einsum("d,ldg->l", affinity.weight, _touched(p, top_k))


def colocate(
    load: np.ndarray,
    shares: np.ndarray,
    affinity: DomainAffinity,
    top_k: int,
    slots: int,
    cap: np.ndarray,
    max_swaps: int,
) -> np.ndarray:
    """Exchange replicas between GPUs to lower groups touched per token, keeping every GPU load <= cap [L].

    load [L, E], shares [L, E, G] -> shares [L, E, G]. A free slot is a replica of
    no expert with no load, so exchanging with it is a move.
    """
    out = shares.copy()
    for layer in range(load.shape[0]):
        out[layer] = _colocate_layer(
            load[layer], shares[layer], affinity.share[layer], affinity.weight, top_k, slots, cap[layer], max_swaps
        )
    return out


def _colocate_layer(load, shares, share, weight, top_k, slots, cap, max_swaps) -> np.ndarray:
    E, G = shares.shape
    placed_expert, placed_gpu = np.nonzero(shares)  # one row per replica, expert-major
    free = np.maximum(slots - (shares > 0).sum(axis=0), 0)  # [G]
    expert = np.concatenate([placed_expert, np.full(int(free.sum()), E)])  # E: the "no expert" of a free slot
    gpu = np.concatenate([placed_gpu, np.repeat(np.arange(G), free)])  # [R]
    frac = np.concatenate([shares[placed_expert, placed_gpu], np.zeros(int(free.sum()))])  # [R] share of its expert
    w = np.append(load, 0.0)[expert] * frac  # [R] tokens each replica computes
    m = np.append(share, np.zeros((share.shape[0], 1)), axis=1)[:, expert].T * frac[:, None]  # [R, D] pick mass
    gpu_load = np.bincount(gpu, weights=w, minlength=G)
    P = np.zeros((G, m.shape[1]))
    np.add.at(P, gpu, m)
    has = np.zeros((E + 1, G), dtype=bool)
    has[expert, gpu] = True
    has[E] = False
    limit = cap * (1 + 1e-12) + 1e-9
    floor = 1e-9
    for _ in range(max_swaps):
        a, b = gpu[:, None], gpu[None, :]  # r sits on a, s on b
        delta = m[None, :, :] - m[:, None, :]  # [R, R, D]: a gains m_s - m_r, b the opposite
        Pa, Pb = P[gpu][:, None, :], P[gpu][None, :, :]
        change = (
            _touched(Pa + delta, top_k) - _touched(Pa, top_k) + _touched(Pb - delta, top_k) - _touched(Pb, top_k)
        ) @ weight
        dw = w[None, :] - w[:, None]
        valid = (
            (a != b)
            & (gpu_load[a] + dw <= limit)
            & (gpu_load[b] - dw <= limit)
            & ~has[expert[:, None], b]
            & ~has[expert[None, :], a]
        )
        change = np.where(valid, change, np.inf)
        r, s = np.unravel_index(np.argmin(change), change.shape)
        if not change[r, s] < -floor:
            break
        ga, gb = gpu[r], gpu[s]
        gpu_load[ga] += w[s] - w[r]
        gpu_load[gb] += w[r] - w[s]
        P[ga] += m[s] - m[r]
        P[gb] += m[r] - m[s]
        has[expert[r], ga], has[expert[s], gb] = False, False
        has[expert[r], gb], has[expert[s], ga] = True, True
        has[E] = False
        gpu[r], gpu[s] = gb, ga
    out = np.zeros_like(shares)
    real = expert < E
    out[expert[real], gpu[real]] = frac[real]
    return out
