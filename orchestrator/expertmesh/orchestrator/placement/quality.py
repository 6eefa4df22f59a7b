"""How good a placement is. Pure functions over arrays.

Glossary
--------
GPU load
    ``gpu_loads[l, g] = sum_e load[l, e] * shares[l, e, g]``: tokens GPU ``g``
    computes in layer ``l``. Shape [L, G].
balancedness
    As vLLM reports it: (sum over layers of the mean GPU load) divided by (sum
    over layers of the max GPU load); 1.0 is perfect. Per layer: mean / max.
cross-island fraction
    Of all co-activated expert pairs (weighted by co-activation count), the
    fraction expected to sit in different NVLink islands when each expert's
    tokens go to its replicas by share: a pair (e, f) lands in one island with
    probability ``sum_i P[e, i] * P[f, i]`` where ``P[e, i]`` is e's total share
    in island i. Cross-node fraction: the same over nodes.
weights moved
    Replicas in the new placement on a GPU that did not hold that (layer,
    expert) before: each is one expert's weights copied to a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def gpu_loads(load: np.ndarray, shares: np.ndarray) -> np.ndarray:
    """load [L, E], shares [L, E, G] -> [L, G]."""
    return np.einsum("le,leg->lg", load, shares)


def balancedness(load: np.ndarray, shares: np.ndarray) -> float:
    loads = gpu_loads(load, shares)
    top = loads.max(axis=1).sum()
    return float(loads.mean(axis=1).sum() / top) if top > 0 else 1.0


def layer_balancedness(load: np.ndarray, shares: np.ndarray) -> np.ndarray:
    """[L] mean / max per layer (1.0 for an idle layer)."""
    loads = gpu_loads(load, shares)
    top = loads.max(axis=1)
    return np.where(top > 0, loads.mean(axis=1) / np.where(top > 0, top, 1), 1.0)


def domain_shares(shares: np.ndarray, domain_of_gpu: np.ndarray) -> np.ndarray:
    """shares [L, E, G] -> [L, E, D]: each expert's total share per domain (island or node).

    Summed over the replicas (nonzero shares) only: a placement holds few replicas per expert.
    """
    L, E, _ = shares.shape
    D = int(domain_of_gpu.max()) + 1
    flat = shares.reshape(L * E, -1)
    row, g = np.nonzero(flat)
    return np.bincount(row * D + domain_of_gpu[g], weights=flat[row, g], minlength=L * E * D).reshape(L, E, D)


def split_pair_weight(coactivation: np.ndarray, shares: np.ndarray, domain_of_gpu: np.ndarray) -> np.ndarray:
    """[L] co-activation weight of pairs expected to sit in different domains (each pair once).

    With ``p = domain_shares`` [L, E, D], pairs (e, f) share a domain with probability ``p_e . p_f``, so the
    weight kept together is ``sum_d p_d^T C p_d`` less the diagonal's: no [L, E, E] temporaries.
    """
    p = domain_shares(shares, domain_of_gpu)  # [L, E, D]
    idx = np.arange(coactivation.shape[1])
    diag = coactivation[:, idx, idx]  # [L, E]
    total = coactivation.sum(axis=(1, 2)) - diag.sum(axis=1)
    together = np.einsum("led,led->l", coactivation @ p, p) - np.einsum("le,led,led->l", diag, p, p)
    return 0.5 * (total - together)


def split_pair_fraction(coactivation: np.ndarray | None, shares: np.ndarray, domain_of_gpu: np.ndarray) -> float:
    if coactivation is None:
        return 0.0
    idx = np.arange(coactivation.shape[1])
    total = 0.5 * (coactivation.sum() - coactivation[:, idx, idx].sum())
    return max(0.0, float(split_pair_weight(coactivation, shares, domain_of_gpu).sum() / total)) if total > 0 else 0.0


def weights_moved(before: np.ndarray, after: np.ndarray) -> int:
    """Replicas of ``after`` [L, E, G] that ``before`` did not already hold on that GPU."""
    return int(((after > 0) & ~(before > 0)).sum())


@dataclass(frozen=True)
class Summary:
    """One placement's figures, as the plan and bench commands print them."""

    balancedness: float
    cross_island: float  # fraction of co-activated pair weight split across islands
    cross_node: float
    max_gpu_load: float  # summed over layers
    weights_moved: int | None  # vs the previous placement, when there is one
    plan_seconds: float


def summarize(
    load: np.ndarray,
    coactivation: np.ndarray | None,
    island_of_gpu: np.ndarray,
    node_of_gpu: np.ndarray,
    shares: np.ndarray,
    before: np.ndarray | None = None,
    plan_seconds: float = 0.0,
) -> Summary:
    return Summary(
        balancedness(load, shares),
        split_pair_fraction(coactivation, shares, island_of_gpu),
        split_pair_fraction(coactivation, shares, node_of_gpu),
        float(gpu_loads(load, shares).max(axis=1).sum()),
        None if before is None else weights_moved(before, shares),
        plan_seconds,
    )
