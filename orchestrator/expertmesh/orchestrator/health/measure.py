"""Probe batches, and the figures of one replica's probe output: histograms, the KL
divergence from a baseline, the distance between replicas. Pure functions, no I/O
(the probe inputs themselves are ``probes``').
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from expertmesh.orchestrator.health.state import Baseline, Histogram
from expertmesh.orchestrator.migration.plan import Canary

#: output values an activation histogram looks at (a fixed stride through the finite rows)
ACTIVATION_SAMPLE = 1 << 16
#: Laplace smoothing of the KL: half a count added to every bin, so an empty bin is no infinity
SMOOTHING = 0.5


def probe_batch(hidden: torch.Tensor, experts: tuple[int, ...]) -> Canary:
    """One Dispatch that probes each of ``experts`` on all of hidden [T, H]: rows e*T .. (e+1)*T - 1 go to
    ``experts[e]`` alone at weight 1, so those rows of the partial sums [len(experts) * T, H] are its output."""
    tokens = hidden.shape[0]
    ids = torch.tensor(experts, dtype=torch.int32).repeat_interleave(tokens)[:, None]  # [E*T, 1]
    return Canary(hidden.repeat(len(experts), 1), ids, torch.ones(ids.shape[0], 1))


def batches(experts: list[int], tokens: int, row_bytes: int, budget_bytes: int) -> list[tuple[int, ...]]:
    """``experts`` in chunks whose probe batch (tokens rows each, ``row_bytes`` a row) stays within
    ``budget_bytes`` (at least one expert a chunk): few calls, none too large for a message."""
    per_call = max(1, budget_bytes // max(1, tokens * row_bytes))
    return [tuple(experts[i : i + per_call]) for i in range(0, len(experts), per_call)]


@dataclass(frozen=True, eq=False)
class Output:
    """One probe output [T, H], summarised."""

    #: [T] float64: the L2 norm of each row; inf for a row with a NaN or an Inf
    norms: np.ndarray
    #: [A] float64: values of the finite rows, a fixed stride through them (A <= ACTIVATION_SAMPLE)
    activations: np.ndarray

    @property
    def finite_norms(self) -> np.ndarray:
        return self.norms[np.isfinite(self.norms)]

    @property
    def non_finite(self) -> int:
        return int((~np.isfinite(self.norms)).sum())

    @property
    def norm_mean(self) -> float:
        finite = self.finite_norms
        return float(finite.mean()) if finite.size else 0.0


def summarise(out: torch.Tensor) -> Output:
    """out [T, H], any float dtype."""
    out = out.detach().float()
    finite = torch.isfinite(out).all(dim=1)  # [T]
    norms = torch.where(finite, out.norm(dim=1), math.inf)  # [T]
    values = out[finite].reshape(-1)  # [T_finite * H]
    stride = max(1, math.ceil(values.numel() / ACTIVATION_SAMPLE))
    return Output(norms=norms.double().numpy(), activations=values[::stride].double().numpy())


def quantile_edges(values: np.ndarray, bins: int) -> tuple[float, ...]:
    """The ``bins - 1`` interior edges that split ``values`` into equally full bins (all 0 when empty)."""
    if not values.size:
        return (0.0,) * (bins - 1)
    return tuple(float(v) for v in np.quantile(values, np.arange(1, bins) / bins))


def histogram(values: np.ndarray, edges: tuple[float, ...]) -> Histogram:
    index = np.searchsorted(np.asarray(edges, dtype=np.float64), values, side="left")  # edges[i-1] < v <= edges[i]
    return Histogram(edges, tuple(int(c) for c in np.bincount(index, minlength=len(edges) + 1)))


def kl_divergence(p: Histogram, q: Histogram) -> float:
    """KL(p || q) in nats over the same bins, both smoothed by SMOOTHING counts per bin."""
    if p.edges != q.edges:
        raise ValueError("KL divergence of histograms over different bins")
    a = np.asarray(p.counts, dtype=np.float64) + SMOOTHING
    b = np.asarray(q.counts, dtype=np.float64) + SMOOTHING
    a, b = a / a.sum(), b / b.sum()
    return float(np.sum(a * np.log(a / b)))


def baseline(output: Output, fingerprint: str, at: float, bins: int, probe: str) -> Baseline:
    """The baseline ``output`` (of the probe input ``probe``) makes: its histograms on bins at its own quantiles."""
    norms, values = output.finite_norms, output.activations
    return Baseline(
        taken_at=at,
        fingerprint=fingerprint,
        probe=probe,
        norm_mean=output.norm_mean,
        norms=histogram(norms, quantile_edges(norms, bins)),
        activations=histogram(values, quantile_edges(values, bins)),
    )


def divergence(output: Output, base: Baseline) -> float:
    """The larger of the norm and activation KL(baseline || output), on the baseline's bins."""
    return max(
        kl_divergence(base.norms, histogram(output.finite_norms, base.norms.edges)),
        kl_divergence(base.activations, histogram(output.activations, base.activations.edges)),
    )


def deviations(norms: dict[str, np.ndarray]) -> dict[str, float]:
    """group -> max over rows of |its norm - the replicas' median| / the median's mean: how far each
    replica of one expert computes from the others on the same probe. Empty with one replica;
    inf for a replica with a non-finite row."""
    if len(norms) < 2:
        return {}
    stacked = np.stack(list(norms.values()))  # [R, T]
    median = np.median(stacked, axis=0)  # [T]
    finite = median[np.isfinite(median)]
    scale = max(float(np.abs(finite).mean()) if finite.size else 0.0, np.finfo(np.float64).tiny)
    out = {}
    for group, row in norms.items():
        distance = np.abs(row - median)  # [T]; inf - inf is nan: a non-finite row is as far as it gets
        out[group] = float(np.where(np.isnan(distance), np.inf, distance).max() / scale)
    return out
