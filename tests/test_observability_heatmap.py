"""Heatmap rendering: pure arrays in, a PNG out (no server)."""

from __future__ import annotations

import io

import numpy as np
import pytest

from expertmesh.observability.heatmap import bin_ranges, grid, position_frequency, render_position_heatmap

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
