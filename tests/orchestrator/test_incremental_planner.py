"""The incremental planner (``placement.incremental.replan``): valid placements from any previous one, every layer as
balanced as the full plan's when ``min_gain`` is 0, and far fewer weights moved for one GPU added or removed."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expertmesh.bench.placement import grid_topology, synthetic_stats
from expertmesh.bench.scale.planning import with_gpu_added, with_gpu_removed
from expertmesh.contracts.errors import PlacementError
from expertmesh.contracts.gpu_plan import Placement
from expertmesh.orchestrator.placement.incremental import carry, replan
from expertmesh.orchestrator.placement.planner import PlanOptions, plan
from expertmesh.orchestrator.placement.quality import gpu_loads, layer_balancedness, weights_moved
from expertmesh.orchestrator.placement.stats import LoadStats

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _valid(result, stats, options):
    shares = result.placement.shares
    assert shares.shape == (stats.num_layers, stats.num_experts, len(result.placement.gpu_ids))
    assert ((shares > 0).sum(axis=2) >= 1).all(), "every expert has a replica"
    assert np.allclose(shares.sum(axis=2), 1.0, atol=1e-9), "shares of an expert sum to 1"
    assert ((shares > 0).sum(axis=1) <= result.slots_per_gpu).all(), "no GPU exceeds its slots"
    assert ((shares > 0).sum(axis=(1, 2)) <= stats.num_experts + options.redundant).all(), "within the redundant budget"
    result.placement.check(result.slots_per_gpu)


@st.composite
def changes(draw):
    """A previous plan on one topology, then new load and/or one GPU added or removed."""
    nodes, per_node = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    topo = grid_topology(nodes, 1, per_node)
    L, E = draw(st.integers(1, 3)), draw(st.integers(2, 16))
    seed = draw(st.integers(0, 10_000))
    stats = synthetic_stats(L, E, min(2, E), draw(st.sampled_from([0.5, 1.0, 1.4])), 2, seed=seed)
    redundant = draw(st.integers(0, min(E * (topo.num_gpus - 1), 2 * topo.num_gpus)))
    previous = plan(stats, topo, PlanOptions(redundant)).placement
    change = draw(st.sampled_from(["load", "added", "removed", "load+added"]))
    if "load" in change:
        stats = synthetic_stats(L, E, min(2, E), 1.0, 2, seed=seed + 1)
    new_topo = topo
    if "added" in change:
        new_topo = with_gpu_added(topo)
    elif change == "removed" and topo.num_gpus > 1:
        new_topo = with_gpu_removed(topo)
    redundant = min(redundant, E * (new_topo.num_gpus - 1))
    return stats, new_topo, redundant, previous


@SETTINGS
@given(changes(), st.sampled_from([0, 8, 64]))
def test_valid_deterministic_and_every_layer_as_balanced_as_the_full_plan(change, moves):
    stats, topo, redundant, previous = change
    options = PlanOptions(redundant, repair_moves=moves)
    first, second = replan(stats, topo, options, previous), replan(stats, topo, options, previous)
    _valid(first, stats, options)
    assert np.array_equal(first.placement.shares, second.placement.shares), "same input, same plan"
    assert first.placement.gpu_ids == tuple(s.gpu.id for s in topo.sites())
    full = plan(stats, topo, options)
    # min_gain 0: a layer kept from the previous placement is at least as balanced as the full plan's.
    ours, theirs = (
        layer_balancedness(stats.load, first.placement.shares),
        layer_balancedness(stats.load, full.placement.shares),
    )
    assert (ours >= theirs - 1e-9).all()
    # ... so never above EPLB's max GPU load either, the planner's first objective.
    eplb = gpu_loads(stats.load, first.baseline.shares).max(axis=1)
    assert (gpu_loads(stats.load, first.placement.shares).max(axis=1) <= eplb * (1 + 1e-9) + 1e-9).all()
    moved = weights_moved(carry(previous, first.placement.gpu_ids), first.placement.shares)
    assert first.moved.sum() == moved


@SETTINGS
@given(changes(), st.floats(0.0, 0.2))
def test_min_gain_bounds_how_far_a_kept_layer_falls_below_the_full_plan(change, min_gain):
    stats, topo, redundant, previous = change
    options = PlanOptions(redundant, min_gain=min_gain)
    result = replan(stats, topo, options, previous)
    _valid(result, stats, options)
    full = plan(stats, topo, PlanOptions(redundant))
    ours, theirs = (
        layer_balancedness(stats.load, result.placement.shares),
        layer_balancedness(stats.load, full.placement.shares),
    )
    assert (ours >= theirs - min_gain - 1e-9).all()


def test_the_same_load_on_the_same_gpus_moves_nothing():
    topo = grid_topology(2, 1, 4)
    stats = synthetic_stats(4, 16, 2, 1.0, 4, seed=3)
    options = PlanOptions(redundant=8)
    previous = plan(stats, topo, options).placement
    again = replan(stats, topo, options, previous)
    assert again.layers_replanned == () and again.moved.sum() == 0
    assert weights_moved(previous.shares, again.placement.shares) == 0


def test_one_gpu_added_or_removed_moves_far_fewer_weights_than_a_full_plan():
    topo = grid_topology(4, 1, 4)
    stats = synthetic_stats(6, 32, 4, 1.0, 4, seed=1)
    previous = plan(stats, topo, PlanOptions(redundant=16)).placement
    for changed, redundant in ((with_gpu_added(topo), 17), (with_gpu_removed(topo), 15)):
        options = PlanOptions(redundant, min_gain=0.01)
        ours = replan(stats, changed, options, previous)
        _valid(ours, stats, options)
        full = plan(stats, changed, options)
        carried = carry(previous, ours.placement.gpu_ids)
        assert weights_moved(carried, ours.placement.shares) < weights_moved(carried, full.placement.shares) / 2
        assert ours.moved.sum() == weights_moved(carried, ours.placement.shares)
        bal = layer_balancedness(stats.load, ours.placement.shares)
        assert (bal >= layer_balancedness(stats.load, full.placement.shares) - 0.01 - 1e-9).all()


def test_a_removed_gpus_sole_replicas_find_a_new_home():
    """Every expert on GPU 3 only: removing GPU 3 re-homes each of them on the GPUs left."""
    topo = grid_topology(1, 1, 4)
    L, E = 1, 8
    shares = np.zeros((L, E, 4))
    shares[0, np.arange(E), np.arange(E) % 4] = 1.0
    previous = Placement((0, 1, 2, 3), shares)
    stats = LoadStats(L, E, 2, np.full((L, E), 100.0))
    smaller = with_gpu_removed(topo)
    result = replan(stats, smaller, PlanOptions(redundant=0, min_gain=1.0), previous)
    assert result.placement.gpu_ids == (0, 1, 2)
    assert ((result.placement.shares > 0).sum(axis=2) == 1).all()
    assert result.moved.sum() == 2  # experts 3 and 7, nothing else


def test_a_new_gpu_is_filled_when_that_balances_the_layer():
    """One hot expert on one GPU: a GPU added gets a replica of it."""
    topo = grid_topology(1, 1, 2)
    stats = LoadStats(1, 2, 1, np.array([[900.0, 100.0]]))
    previous = Placement((0, 1), np.array([[[1.0, 0.0], [0.0, 1.0]]]))
    result = replan(stats, with_gpu_added(topo), PlanOptions(redundant=1), previous)
    assert result.placement.shares[0, 0, 2] > 0, "the hot expert took a replica on the new GPU"
    assert (
        layer_balancedness(stats.load, result.placement.shares)[0]
        > layer_balancedness(stats.load, carry(previous, result.placement.gpu_ids))[0]
    )


def test_a_previous_placement_of_another_shape_is_refused():
    topo = grid_topology(1, 1, 2)
    stats = synthetic_stats(2, 4, 2, 1.0, 2, seed=0)
    other = plan(synthetic_stats(3, 4, 2, 1.0, 2, seed=0), topo, PlanOptions(0)).placement
    with pytest.raises(PlacementError, match="previous placement covers 3 layers"):
        replan(stats, topo, PlanOptions(0), other)


def test_carry_maps_columns_by_gpu_id():
    previous = Placement((5, 7), np.array([[[0.25, 0.75]]]))
    np.testing.assert_array_equal(carry(previous, (7, 9, 5)), [[[0.75, 0.0, 0.25]]])
    assert replace(PlanOptions(1), min_gain=0.5).repair_moves == PlanOptions(1).repair_moves
