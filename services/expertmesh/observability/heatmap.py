"""Expert x token-position activation heatmaps, one panel per MoE layer, as PNG bytes. Pure: arrays in, bytes out.

Input is the router's ``position_load[row, p, e]`` [L, P, E]: tokens at
sequence positions in bin ``p`` that chose expert ``e`` (bin ``p`` covers
positions ``[p * max_context / P, (p + 1) * max_context / P)``), or with
``positions="relative"`` its ``relative_load`` [L, R, E]: tokens of finished
sequences by relative position (a token's position / its sequence's final
length; bin ``r`` covers ``[r / R, (r + 1) / R)`` of the sequence).

*Activation frequency* of expert ``e`` in bin ``p`` = ``position_load[row, p, e]
/ tokens in bin p``, where tokens = the bin's routed pairs / top_k: the share of
the tokens at those positions whose top-k chose ``e`` (a column sums to top_k;
``top_k / E`` everywhere is perfectly even routing). Bins no token reached are
left blank, and trailing empty bins are cut off.

Rendered with matplotlib's Agg canvas directly (no pyplot, no display, no
global state), so it is safe in servers and tests.
"""

from __future__ import annotations

import io
import math
from typing import Literal, Sequence

import numpy as np


def position_frequency(position_load: np.ndarray, top_k: int) -> np.ndarray:
    """[L, P, E] counts -> [L, P, E] activation frequency; NaN in bins without tokens."""
    counts = np.asarray(position_load, dtype=np.float64)
    tokens = counts.sum(axis=2, keepdims=True) / max(top_k, 1)  # [L, P, 1]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(tokens > 0, counts / np.where(tokens > 0, tokens, 1.0), np.nan)


#: how the x axis places a token: by its position / its sequence's final length, or by its position
Positions = Literal["relative", "absolute"]


def relative_ranges(bins: int) -> list[tuple[float, float]]:
    """[start, end) share of the sequence each relative bin covers, as the router assigns
    ``position * bins // final_length``."""
    return [(r / bins, (r + 1) / bins) for r in range(bins)]


def bin_ranges(max_context: int, bins: int) -> list[tuple[int, int]]:
    """Inclusive (first, last) position of each bin, as the router assigns ``position * bins // max_context``."""
    firsts = [math.ceil(p * max_context / bins) for p in range(bins + 1)]
    return [(firsts[p], firsts[p + 1] - 1) for p in range(bins)]


def render_position_heatmap(
    position_load: np.ndarray,
    moe_layers: Sequence[int],
    max_context: int,
    top_k: int,
    model_name: str = "",
    dpi: int = 100,
    positions: Positions = "absolute",
) -> bytes:
    """PNG of expert (y) x position bin (x) activation frequency, one panel per MoE layer. ``positions``:
    what ``position_load`` counts by (``relative``: a ``relative_load``, whose bins all show, 0 to 1;
    ``absolute``: positions binned over ``max_context``, trailing empty bins cut).

    Raises ValueError when the counts have the wrong shape or are all zero.
    """
    from matplotlib.figure import Figure  # imported here: matplotlib is only needed to render

    if positions not in ("relative", "absolute"):
        raise ValueError(f"positions is 'relative' or 'absolute', got {positions!r}")
    counts = np.asarray(position_load, dtype=np.float64)
    if counts.ndim != 3 or counts.shape[0] != len(moe_layers):
        raise ValueError(
            f"position_load has shape {counts.shape}, expected (MoE layers={len(moe_layers)}, bins, experts)"
        )
    L, P, E = counts.shape
    if counts.sum() <= 0:
        raise ValueError("no routed tokens with known positions in the counts")
    used = np.flatnonzero(counts.sum(axis=(0, 2)) > 0)
    shown = P if positions == "relative" else int(used.max()) + 1  # absolute: cut trailing empty bins
    freq = position_frequency(counts, top_k)[:, :shown, :]  # [L, shown, E]
    tokens_per_bin = counts[:, :shown, :].sum(axis=2) / max(top_k, 1)  # [L, shown]
    if positions == "relative":
        ranges = [f"{a:.2f}-{b:.2f}" for a, b in relative_ranges(P)]
        axis = "position / sequence length (tokens in bin)"
    else:
        ranges = [f"{a}-{b}" for a, b in bin_ranges(max_context, P)[:shown]]
        axis = "token positions (tokens in bin)"
    vmax = float(np.nanmax(freq)) or 1.0

    rows, cols, size = grid(L, shown, E)
    fig = Figure(figsize=size, dpi=dpi, layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    image = None
    cmap = _colormap()
    for row, ax in enumerate(axes):
        if row >= L:
            ax.set_axis_off()
            continue
        data = np.ma.masked_invalid(freq[row].T)  # [E, shown]
        image = ax.imshow(data, aspect="auto", origin="lower", cmap=cmap, vmin=0.0, vmax=vmax, interpolation="nearest")
        ax.set_title(f"layer {moe_layers[row]}", fontsize=9)
        ax.set_xticks(range(shown))
        ax.set_xticklabels(
            [f"{label}\nn={n:.0f}" for label, n in zip(ranges, tokens_per_bin[row])], fontsize=6, rotation=90
        )
        step = max(1, math.ceil(E / 16))
        ax.set_yticks(range(0, E, step))
        ax.tick_params(axis="y", labelsize=7)
        if row % cols == 0:
            ax.set_ylabel("expert", fontsize=8)
        if row >= L - cols:
            ax.set_xlabel(axis, fontsize=8)
    if image is not None:
        bar = fig.colorbar(image, ax=list(axes[:L]), shrink=0.85, pad=0.01)
        bar.set_label("share of the bin's tokens routed to the expert", fontsize=8)
        bar.ax.tick_params(labelsize=7)
        bar.ax.axhline(top_k / E, color="red", linewidth=1.5)  # the even-routing level
    total = counts[0].sum() / max(top_k, 1)
    name = f"{model_name}: " if model_name else ""
    fig.suptitle(
        f"{name}expert activation by {'relative ' if positions == 'relative' else ''}token position, "
        f"{total:.0f} tokens, top-{top_k} of {E} experts "
        f"(red line on the colour bar: even routing)",
        fontsize=10,
    )
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def grid(layers: int, bins: int, experts: int) -> tuple[int, int, tuple[float, float]]:
    """(rows, columns, figure size in inches) for ``layers`` panels of ``bins`` x ``experts`` cells."""
    width = max(3.0, 0.35 * bins + 1.2)
    cols = max(1, min(layers, 4, int(16 // width)))  # figures stay within ~16 inches across
    rows = math.ceil(layers / cols)
    height = max(2.4, 0.22 * min(experts, 64) + 1.4)
    return rows, cols, (cols * width + 1.2, rows * height + 0.9)


def _colormap():
    from matplotlib import colormaps

    return colormaps["viridis"].with_extremes(bad="#e6e6e6")  # bad: bins no token reached
