"""The health monitor's measurements (``orchestrator.health.measure``): probe batches,
output summaries, histograms, KL divergence, baselines, distances between replicas.
Pure functions on hand-made tensors and arrays."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from expertmesh.orchestrator.health import measure
from expertmesh.orchestrator.health.state import Histogram


def test_a_probe_batch_sends_each_expert_all_the_rows_alone_at_weight_one():
    hidden = torch.arange(6.0).reshape(3, 2)  # [T=3, H=2]
    batch = measure.probe_batch(hidden, (5, 1))
    assert torch.equal(batch.hidden, torch.cat([hidden, hidden]))
    assert batch.expert_ids.dtype == torch.int32 and batch.expert_ids.flatten().tolist() == [5, 5, 5, 1, 1, 1]
    assert torch.equal(batch.weights, torch.ones(6, 1))


@pytest.mark.parametrize(
    ("budget", "expected"),
    [(10**9, [(0, 1, 2, 3, 4)]), (2 * 1000 * 8, [(0, 1), (2, 3), (4,)]), (1, [(0,), (1,), (2,), (3,), (4,)])],
)
def test_probe_batches_stay_within_the_byte_budget_with_at_least_one_expert(budget, expected):
    assert measure.batches([0, 1, 2, 3, 4], tokens=1000, row_bytes=8, budget_bytes=budget) == expected


def test_summarise_counts_non_finite_rows_and_bounds_the_activation_sample():
    out = torch.ones(4, 3)
    out[1, 2] = math.nan
    out[3, 0] = math.inf
    s = measure.summarise(out)
    assert s.non_finite == 2
    assert s.norms[0] == pytest.approx(math.sqrt(3)) and math.isinf(s.norms[1]) and math.isinf(s.norms[3])
    assert s.finite_norms.tolist() == pytest.approx([math.sqrt(3)] * 2) and s.norm_mean == pytest.approx(math.sqrt(3))
    assert s.activations.tolist() == [1.0] * 6  # the finite rows only
    big = measure.summarise(torch.randn(100, 2000))
    assert 0 < big.activations.size <= measure.ACTIVATION_SAMPLE
    assert measure.summarise(torch.full((2, 2), math.nan)).norm_mean == 0.0


def test_histogram_bins_are_closed_on_the_right():
    h = measure.histogram(np.array([-5.0, 0.0, 0.5, 1.0, 1.5, 9.0]), (0.0, 1.0))
    assert h == Histogram((0.0, 1.0), (2, 2, 2))  # <=0 | (0, 1] | >1


def test_quantile_edges_split_evenly_and_survive_an_empty_sample():
    edges = measure.quantile_edges(np.arange(1, 101, dtype=float), 4)
    assert len(edges) == 3
    assert measure.histogram(np.arange(1, 101, dtype=float), edges).counts == (25, 25, 25, 25)
    assert measure.quantile_edges(np.array([]), 5) == (0.0,) * 4


def test_kl_is_zero_for_the_same_counts_and_finite_with_empty_bins():
    p = Histogram((0.0, 1.0), (10, 10, 10))
    assert measure.kl_divergence(p, p) == 0.0
    q = Histogram((0.0, 1.0), (0, 0, 30))  # every value moved to the last bin
    assert 0 < measure.kl_divergence(p, q) < math.inf
    assert measure.kl_divergence(p, Histogram((0.0, 1.0), (9, 11, 10))) < 0.01
    with pytest.raises(ValueError, match="different bins"):
        measure.kl_divergence(p, Histogram((0.0, 2.0), (10, 10, 10)))


def test_the_same_output_does_not_diverge_from_its_baseline_and_a_scaled_one_does():
    out = torch.randn(200, 32, generator=torch.Generator().manual_seed(0))
    base = measure.baseline(measure.summarise(out), "f", at=5.0, bins=10, probe="p")
    assert (base.taken_at, base.fingerprint, base.probe) == (5.0, "f", "p")
    assert sum(base.norms.counts) == 200 and len(base.norms.counts) == 10
    assert base.norm_mean == pytest.approx(out.norm(dim=1).mean().item(), rel=1e-6)
    assert measure.divergence(measure.summarise(out), base) == 0.0
    assert measure.divergence(measure.summarise(out * 1.001), base) < 0.05
    assert measure.divergence(measure.summarise(out * 3), base) > 1.0
    assert (
        measure.divergence(measure.summarise(-out), base)
        < 0.05
        < measure.divergence(measure.summarise(out.abs()), base)
    ), "a sign flip keeps the norms; the activation histogram tells the rectified output"


def test_deviations_measure_each_replica_from_the_median():
    a = np.array([1.0, 2.0, 3.0])
    assert measure.deviations({"g0": a}) == {}
    assert measure.deviations({"g0": a, "g1": a.copy()}) == {"g0": 0.0, "g1": 0.0}
    three = measure.deviations({"g0": a, "g1": a.copy(), "g2": a * 2})
    assert three["g0"] == three["g1"] == 0.0 and three["g2"] == pytest.approx(3.0 / 2.0)
    two = measure.deviations({"g0": a, "g1": a * 2})
    assert two["g0"] == two["g1"], "two replicas that disagree are equally far from their midpoint"
    bad = measure.deviations({"g0": a, "g1": np.array([1.0, math.inf, 3.0]), "g2": a.copy()})
    assert math.isinf(bad["g1"]) and bad["g0"] == 0.0
