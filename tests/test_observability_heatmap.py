"""Heatmap rendering: pure arrays in, a PNG out (no server)."""

from __future__ import annotations

import io

import numpy as np
import pytest

from expertmesh.contracts.load_window import LoadWindow, query_bucket, query_bucket_labels, relative_bins
from expertmesh.observability.heatmap import (
    bin_ranges,
    grid,
    position_frequency,
    relative_ranges,
    render_position_heatmap,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("max_context, bins", [(512, 16), (128, 16), (100, 16), (4096, 16), (10, 16)])
def test_bin_ranges_match_the_routers_binning(max_context, bins):
    ranges = bin_ranges(max_context, bins)
    assert len(ranges) == bins
    for position in range(max_context):
        first, last = ranges[position * bins // max_context]
        assert first <= position <= last


def test_bin_ranges_of_the_embedded_model():
    assert bin_ranges(512, 16)[:2] == [(0, 31), (32, 63)]
    assert bin_ranges(512, 16)[-1] == (480, 511)


def test_frequency_columns_sum_to_top_k_and_empty_bins_are_nan():
    counts = np.zeros((1, 3, 4))
    counts[0, 0] = [10, 10, 0, 0]  # 10 tokens, top-2: both chose experts 0 and 1
    counts[0, 1] = [1, 2, 3, 4]  # 5 tokens
    freq = position_frequency(counts, top_k=2)
    assert freq[0, 0].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert freq[0, 1].tolist() == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert np.nansum(freq[0, :2], axis=1).tolist() == pytest.approx([2.0, 2.0])
    assert np.isnan(freq[0, 2]).all()


def test_renders_a_png_of_the_expected_size_with_trailing_empty_bins_cut():
    rng = np.random.default_rng(0)
    L, P, E, used = 3, 16, 8, 5
    counts = np.zeros((L, P, E))
    counts[:, :used, :] = rng.integers(0, 50, size=(L, used, E))
    counts[:, 2, :] = 0  # an empty bin in the middle stays (blank)
    png = render_position_heatmap(counts, moe_layers=(0, 2, 5), max_context=512, top_k=2, model_name="tiny", dpi=50)
    assert png[:8] == PNG_MAGIC
    from matplotlib import image

    pixels = image.imread(io.BytesIO(png), format="png")
    _, _, (width, height) = grid(L, used, E)
    assert pixels.shape[:2] == (round(height * 50), round(width * 50))


def test_many_layers_and_experts_render():
    counts = np.ones((6, 16, 64))
    png = render_position_heatmap(counts, moe_layers=tuple(range(1, 7)), max_context=4096, top_k=8, dpi=30)
    assert png[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    "counts, layers, message",
    [
        (np.zeros((2, 16, 4)), (0, 1), "no routed tokens"),
        (np.ones((2, 16, 4)), (0,), "expected"),
        (np.ones((2, 4)), (0, 1), "expected"),
    ],
)
def test_bad_counts_are_refused(counts, layers, message):
    with pytest.raises(ValueError, match=message):
        render_position_heatmap(counts, moe_layers=layers, max_context=64, top_k=2)


# -- relative positions: a token's position / its sequence's final length -----------------------------


@pytest.mark.parametrize("final_length, bins", [(10, 4), (1, 16), (7, 16), (100, 16), (4096, 16)])
def test_relative_bins_place_each_position_in_the_range_of_its_share(final_length, bins):
    positions = np.arange(final_length)
    found = relative_bins(positions, final_length, bins)
    ranges = relative_ranges(bins)
    for position, r in zip(positions, found):
        start, end = ranges[r]
        assert start <= position / final_length < end
    assert relative_bins(np.array([0, 3, 5, 9]), 10, 4).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="at least 1"):
        relative_bins(positions, 0, bins)


def test_relative_ranges_cover_zero_to_one():
    assert relative_ranges(4) == [(0.0, 0.25), (0.25, 0.5), (0.5, 0.75), (0.75, 1.0)]


def test_query_buckets_and_their_labels():
    assert [query_bucket(n) for n in (1, 16, 17, 64, 65, 4096, 4097)] == [0, 0, 1, 1, 2, 4, 5]
    assert query_bucket_labels() == ["1-16", "17-64", "65-256", "257-1024", "1025-4096", "4097+"]


def test_a_finished_sequence_adds_its_tokens_by_relative_position_and_experts_per_token():
    window = LoadWindow((1, 3), num_experts=4, top_k=2, relative_bins=4)
    # 3 tokens at positions 2, 3, 4 of a sequence that ended 8 tokens long (prompt 5): bins 1, 1, 2
    experts = np.array(
        [
            [[0, 1], [2, 3], [1, 4]],  # layer 1; 4: an empty slot (a dynamic-k sentinel)
            [[0, 2], [0, 3], [3, 4]],  # layer 3
        ]
    )
    window.record_sequence((1, 3), experts, first_position=2, final_length=8, query_length=5)
    snap = window.snapshot()
    assert snap.relative_load.shape == (2, 4, 4)
    assert snap.relative_load[0, 1].tolist() == [1, 1, 1, 1] and snap.relative_load[0, 2].tolist() == [0, 1, 0, 0]
    assert snap.relative_load[1, 1].tolist() == [2, 0, 1, 1] and snap.relative_load[1, 2].tolist() == [0, 0, 0, 1]
    assert snap.relative_load[:, [0, 3]].sum() == 0
    # experts per token over both layers: 4, 4, 2 -- all in the 1-16 query-length bucket
    assert snap.experts_per_token.shape == (6, 2 * 3 + 1)
    assert snap.experts_per_token[0].tolist() == [0, 0, 1, 0, 2, 0, 0] and snap.experts_per_token[1:].sum() == 0
    stats = snap.to_stats_dict()
    assert stats["relative_load"][1][1] == [2, 0, 1, 1] and stats["query_length_edges"] == [16, 64, 256, 1024, 4096]
    again = type(snap).from_bytes(snap.to_bytes())
    assert (again.relative_load == snap.relative_load).all() and (again + snap).experts_per_token[0, 4] == 4


def test_a_relative_heatmap_shows_every_bin_from_zero_to_one():
    counts = np.zeros((2, 16, 8))
    counts[:, :3, :] = 5  # trailing empty bins stay: the axis is the whole sequence
    png = render_position_heatmap(counts, (0, 1), max_context=512, top_k=2, dpi=50, positions="relative")
    from matplotlib import image

    pixels = image.imread(io.BytesIO(png), format="png")
    _, _, (width, height) = grid(2, 16, 8)
    assert pixels.shape[:2] == (round(height * 50), round(width * 50))
    with pytest.raises(ValueError, match="'relative' or 'absolute'"):
        render_position_heatmap(counts, (0, 1), max_context=512, top_k=2, positions="sideways")
