"""A sampled health round (``health.sampling``): whole layers within a budget of probe rows, the layers that must be
checked first, every replica covered over several rounds; and the monitor probing only the chosen layers."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from health_mesh import CONFIG, running
from hypothesis import given, settings
from hypothesis import strategies as st

from expertmesh.orchestrator.health.monitor import HealthMonitor
from expertmesh.orchestrator.health.sampling import layers_for_round
from expertmesh.orchestrator.health.state import HealthState, ReplicaId, ReplicaRecord


def _fleet(replicas_per_layer: list[int]) -> list[ReplicaId]:
    return [ReplicaId(layer, e, f"g{e}") for layer, n in enumerate(replicas_per_layer) for e in range(n)]


def _checked(targets, at: float = 1.0, **changes) -> dict[ReplicaId, ReplicaRecord]:
    return {rid: replace(ReplicaRecord(rid), last_check=at, **changes) for rid in targets}


def test_no_budget_probes_every_layer():
    targets = _fleet([3, 2, 4])
    assert layers_for_round(targets, _checked(targets), tokens=100, budget_rows=0) == [0, 1, 2]


def test_stalest_layers_first_within_the_budget_and_at_least_one():
    targets = _fleet([2, 2, 2, 2])
    records = _checked(targets)
    for rid in targets:
        records[rid] = replace(records[rid], last_check={0: 5.0, 1: 2.0, 2: 9.0, 3: 2.0}[rid.layer])
    # 2 replicas x 100 tokens a layer: 400 rows take the two stalest, ties to the lower layer
    assert layers_for_round(targets, records, tokens=100, budget_rows=400) == [1, 3]
    assert layers_for_round(targets, records, tokens=100, budget_rows=399) == [1]
    assert layers_for_round(targets, records, tokens=100, budget_rows=1) == [1], "a round always makes progress"


@pytest.mark.parametrize(
    "change",
    [
        {"state": HealthState.SUSPECT},
        {"state": HealthState.PROBATION},
        {"state": HealthState.QUARANTINED},
        {"withdrawn": True},
        {"last_check": 0.0},
    ],
    ids=["suspect", "probation", "quarantined", "withdrawn", "never-checked"],
)
def test_a_layer_that_must_be_checked_goes_first_even_over_the_budget(change):
    targets = _fleet([2, 2, 2])
    records = _checked(targets)
    records[targets[0]] = replace(records[targets[0]], last_check=0.5)  # layer 0 the stalest
    urgent = ReplicaId(2, 1, "g1")
    records[urgent] = replace(records[urgent], **change)
    assert layers_for_round(targets, records, tokens=100, budget_rows=200) == [2]
    assert layers_for_round(targets, records, tokens=100, budget_rows=400) == [0, 2]
    del records[urgent]
    assert layers_for_round(targets, records, tokens=100, budget_rows=200) == [2], "no record yet: never checked"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=12), st.integers(1, 40), st.integers(1, 5))
def test_every_replica_is_checked_within_ceil_layers_over_layers_per_round(sizes, budget_replicas, tokens):
    """All healthy: a round takes the stalest layers; a replica waits at most ceil(layers / fewest per round)."""
    targets = _fleet(sizes)
    records = _checked(targets, at=0.5)
    biggest = max(sizes)
    per_round = max(1, budget_replicas // biggest)  # layers a round takes at least
    bound = math.ceil(len(sizes) / per_round)
    last_round = {layer: 0 for layer in range(len(sizes))}
    for t in range(1, 4 * bound + 1):
        chosen = layers_for_round(targets, records, tokens, budget_replicas * tokens)
        assert chosen
        assert sum(sizes[layer] for layer in chosen) * tokens <= max(
            budget_replicas * tokens, sizes[chosen[0]] * tokens
        )
        for rid in targets:
            if rid.layer in chosen:
                records[rid] = replace(records[rid], last_check=float(t))
        for layer in chosen:
            last_round[layer] = t
        if t >= bound:
            assert all(t - last_round[layer] < bound for layer in last_round), "a layer waited too long"


def test_the_monitor_probes_only_the_sampled_layers(tiny_checkpoints):
    """The tiny mesh: 2 layers of 4 or 5 replicas. With one layer's rows a round, the first round checks every
    replica (none has a baseline), then the rounds take one layer each, the stalest."""
    with running(tiny_checkpoints("mixtral")) as mesh:
        monitor = HealthMonitor(
            mesh.store, mesh.checkpoint, CONFIG.model_copy(update={"round_probe_rows": CONFIG.tokens})
        )
        try:
            first = monitor.update()
            assert {rid.layer for rid in first.findings} == {0, 1}
            layers = [{rid.layer for rid in monitor.update().findings} for _ in range(4)]
            assert all(len(checked) == 1 for checked in layers)
            assert layers[0] | layers[1] == {0, 1} and layers[2] | layers[3] == {0, 1}
        finally:
            monitor.close()
