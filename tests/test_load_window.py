"""The router's load window: counts, co-activation, ageing, and the stats file the planner reads."""

import numpy as np
import pytest
import torch

from expertmesh.contracts.load_window import LoadSnapshot, LoadWindow
from expertmesh.orchestrator.placement.stats import stats_from_dict


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_counts_and_coactivation():
    window = LoadWindow((1, 3), num_experts=4, top_k=2, clock=Clock())
    window.record(1, torch.tensor([[0, 1], [1, 2], [0, 1]]))
    window.record(3, torch.tensor([[3, 2], [2, 4]]))  # 4 = expert-parallel sentinel, skipped
    snap = window.snapshot()
    assert snap.load.tolist() == [[2, 3, 1, 0], [0, 0, 2, 1]]
    assert snap.coactivation[0][0][1] == 2 and snap.coactivation[0][1][2] == 1
    assert np.array_equal(snap.coactivation, snap.coactivation.transpose(0, 2, 1))
    assert np.all(np.diagonal(snap.coactivation, axis1=1, axis2=2) == 0)
    assert snap.coactivation[1][2][3] == 1 and snap.coactivation[1].sum() == 2


def test_old_buckets_age_out():
    clock = Clock()
    window = LoadWindow((0,), num_experts=2, top_k=1, window_s=40, buckets=4, clock=clock)
    window.record(0, torch.tensor([[0]]))
    clock.now += 20
    window.record(0, torch.tensor([[1], [1]]))
    assert window.snapshot().load.tolist() == [[1, 2]]
    clock.now += 25  # the first bucket is now older than the window
    assert window.snapshot().load.tolist() == [[0, 2]]
    clock.now += 100
    assert window.snapshot().load.tolist() == [[0, 0]]


def test_bytes_round_trip_sum_and_stats_file():
    window = LoadWindow((1,), num_experts=3, top_k=2, clock=Clock())
    window.record(1, torch.tensor([[0, 2], [1, 2]]))
    snap = LoadSnapshot.from_bytes(window.snapshot().to_bytes())
    total = snap + snap
    assert total.load.tolist() == [[2, 2, 4]]
    stats = stats_from_dict(total.to_stats_dict())
    assert (stats.num_layers, stats.num_experts, stats.top_k) == (1, 3, 2)
    assert stats.coactivation[0][0][2] == 2


def test_position_bins():
    window = LoadWindow((0,), num_experts=2, top_k=1, clock=Clock(), max_context=64, position_bins=4)
    window.record(0, torch.tensor([[0], [1], [1]]), positions=torch.tensor([0, 17, 63]))
    window.record(0, torch.tensor([[0]]))  # no positions known: counted in load only
    snap = window.snapshot()
    assert snap.load.tolist() == [[2, 2]]
    assert snap.position_load[0].tolist() == [[1, 0], [0, 1], [0, 0], [0, 1]]


def test_load_stats_come_in_pages_that_merge_back_to_the_whole():
    """At DeepSeek-V3's size the stats are ~30 MB of JSON, past gRPC's 4 MiB message limit: paged by rows."""
    import json

    from expertmesh.client import merge_stats_pages

    layers = tuple(range(1, 9))
    window = LoadWindow(layers, 16, 2)
    g = torch.Generator().manual_seed(0)
    for layer in layers:
        window.record(
            layer,
            torch.randint(0, 16, (50, 2), generator=g),
            None,
            (torch.randint(-1, 2, (50,), generator=g), ("code", "legal/contracts")),
        )
    snap = window.snapshot()
    whole = snap.to_stats_dict()
    one_row = len(snap.stats_page(0, max_rows=1)[0])
    pages, row = [], 0
    while True:
        text, row = snap.stats_page(row, max_bytes=3 * one_row)
        assert len(text) <= 3 * one_row + 64
        pages.append(json.loads(text))
        if not row:
            break
    assert len(pages) == 3 and [p["first_row"] for p in pages] == [0, 3, 6]
    assert merge_stats_pages(pages) == json.loads(json.dumps(whole))
    assert json.loads(snap.stats_page(0)[0])["num_layers"] == 8 and snap.stats_page(0)[1] == 0
    with pytest.raises(ValueError, match="first_row 8 is past the 8 MoE layers"):
        snap.stats_page(8)


def test_layers_recorded_together_count_as_each_recorded_alone():
    """``record_layers`` (a serving step's MoE layers in one pass) leaves every count ``record`` layer by layer
    leaves, to the bit: sentinels (>= num_experts, negative) skipped, a repeated id counted once, positions and
    domains as given; a layer listed twice counts twice."""
    g = np.random.default_rng(0)
    layers, E, T = (1, 3, 4), 6, 9
    ids = g.integers(-1, E + 3, size=(len(layers), T, 3))  # [L', T, K] with sentinels on both sides
    ids[0, 0] = [2, 2, 5]  # a repeated id
    positions = torch.tensor(g.integers(0, 5000, size=T))
    domains = (torch.tensor(g.integers(-1, 2, size=T)), ("code", "math"))
    together, alone = (LoadWindow(layers, E, 2, clock=Clock(), max_context=4096) for _ in range(2))
    together.record_layers(layers, ids, positions, domains)
    for i, layer in enumerate(layers):
        alone.record(layer, torch.from_numpy(ids[i]), positions, domains)
    a, b = together.snapshot(), alone.snapshot()
    for name in ("load", "coactivation", "position_load"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.load.sum() > 0 and a.domain_load.keys() == b.domain_load.keys() == {"code", "math"}
    assert all(np.array_equal(a.domain_load[d], b.domain_load[d]) for d in a.domain_load)
    assert np.array_equal(together.since_start(), alone.since_start())
    assert all(np.array_equal(a.load[i], _load_of(ids[i], E)) for i in range(len(layers)))  # by hand too

    twice = LoadWindow(layers, E, 2, clock=Clock())
    twice.record_layers((1, 1), ids[:2])
    assert np.array_equal(twice.snapshot().load[0], _load_of(ids[0], E) + _load_of(ids[1], E))


def _load_of(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """[T, K] ids -> [E] tokens per expert (each token once per expert; sentinels skipped), by hand."""
    out = np.zeros(num_experts)
    for row in ids:
        for e in set(int(x) for x in row if 0 <= x < num_experts):
            out[e] += 1
    return out
