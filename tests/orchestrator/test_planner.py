"""Planner properties: constraints, determinism, and balancedness never below EPLB."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expertmesh.bench.placement import grid_topology, synthetic_stats
from expertmesh.contracts.errors import PlacementError
from expertmesh.orchestrator.placement.planner import PlanOptions, plan
from expertmesh.orchestrator.placement.quality import balancedness, gpu_loads, split_pair_fraction, weights_moved
from expertmesh.orchestrator.placement.stats import LoadStats

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw):
    topo = grid_topology(draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 3)))
    G = topo.num_gpus
    L, E = draw(st.integers(1, 3)), draw(st.integers(1, 12))
    redundant = draw(st.integers(0, min(E * (G - 1), 2 * E)))
    default_slots = -(-(E + redundant) // G)
    slots = draw(st.sampled_from([None, default_slots, default_slots + 1, default_slots + 3]))
    load = np.array(
        draw(st.lists(st.lists(st.integers(0, 1000), min_size=E, max_size=E), min_size=L, max_size=L)), float
    )
    coact = None
    if draw(st.booleans()):
        raw = np.array(draw(st.lists(st.integers(0, 50), min_size=L * E * E, max_size=L * E * E)), float).reshape(
            L, E, E
        )
        coact = raw + raw.transpose(0, 2, 1)
    stats = LoadStats(L, E, draw(st.integers(1, E)), load, coact)
    options = PlanOptions(redundant, slots, eplb_groups=draw(st.sampled_from([1, 2])))
    return stats, topo, options


def _check_constraints(result, stats):
    shares = result.placement.shares
    assert shares.shape == (stats.num_layers, stats.num_experts, len(result.placement.gpu_ids))
    assert ((shares > 0).sum(axis=2) >= 1).all(), "every expert has a replica"
    assert np.allclose(shares.sum(axis=2), 1.0, atol=1e-9), "shares of an expert sum to 1"
    assert (shares >= 0).all()
    assert ((shares > 0).sum(axis=1) <= result.slots_per_gpu).all(), "no GPU exceeds its slots"
    result.placement.check(result.slots_per_gpu)  # the dense form cannot hold two replicas on one GPU


@SETTINGS
@given(problems())
def test_constraints_determinism_and_at_least_eplb(problem):
    stats, topo, options = problem
    first, second = plan(stats, topo, options), plan(stats, topo, options)
    _check_constraints(first, stats)
    assert np.array_equal(first.placement.shares, second.placement.shares), "same input, same plan"
    ours = gpu_loads(stats.load, first.placement.shares).max(axis=1)
    eplb = gpu_loads(stats.load, first.baseline.shares).max(axis=1)
    assert (ours <= eplb * (1 + 1e-9) + 1e-9).all(), "per layer max load never above EPLB's"
    assert balancedness(stats.load, first.placement.shares) >= balancedness(stats.load, first.baseline.shares) - 1e-12


@SETTINGS
@given(problems(), st.data())
def test_with_current_placement(problem, data):
    stats, topo, options = problem
    drifted = LoadStats(stats.num_layers, stats.num_experts, stats.top_k, stats.load[:, ::-1].copy(), None)
    current = plan(drifted, topo, options).placement
    kept_all = plan(stats, topo, PlanOptions(options.redundant, options.slots_per_gpu, min_gain=1.0), current)
    _check_constraints(kept_all, stats)
    assert kept_all.layers_kept == stats.num_layers
    assert weights_moved(current.shares, kept_all.placement.shares) == 0, "min_gain 1 keeps every replica"
    replanned = plan(stats, topo, options, current)
    _check_constraints(replanned, stats)
    ours = gpu_loads(stats.load, replanned.placement.shares).max(axis=1)
    eplb = gpu_loads(stats.load, replanned.baseline.shares).max(axis=1)
    assert (ours <= eplb * (1 + 1e-6) + 1e-9).all()


def test_current_placement_keeps_replicas_where_they_are():
    topo = grid_topology(2, 1, 4)
    stats = synthetic_stats(4, 16, 2, 1.0, 4, seed=3)
    options = PlanOptions(redundant=4)
    first = plan(stats, topo, options).placement
    again = plan(stats, topo, options, current=first).placement
    assert weights_moved(first.shares, again.shares) == 0


def test_beats_eplb_and_splits_fewer_pairs_on_clustered_workload():
    topo = grid_topology(4, 1, 4)
    stats = synthetic_stats(6, 64, 4, 1.0, 4, seed=1)
    result = plan(stats, topo, PlanOptions(redundant=8))
    island = np.array([s.island for s in topo.sites()])
    assert balancedness(stats.load, result.placement.shares) >= balancedness(stats.load, result.baseline.shares)
    ours = split_pair_fraction(stats.coactivation, result.placement.shares, island)
    assert ours < split_pair_fraction(stats.coactivation, result.baseline.shares, island)


@pytest.mark.parametrize(
    "redundant, slots, message",
    [
        (-1, None, "--redundant must be >= 0"),
        (2, 1, "too few slots"),
        (100, None, "without two copies"),
        (0, 0, "must be >= 1"),
    ],
)
def test_option_errors(redundant, slots, message):
    stats = synthetic_stats(1, 4, 2, 1.0, 2, seed=0)
    with pytest.raises(PlacementError, match=message):
        plan(stats, grid_topology(1, 1, 2), PlanOptions(redundant, slots))
