"""Expert x query-domain heatmaps, one panel per MoE layer, as PNG bytes. Pure: arrays in, bytes out.

Input is the router's ``domain_load[d][row, e]`` (expert choices of domain ``d``'s tokens, since the
router started). Cell (domain, expert) is the share of the domain's tokens whose top-k chose the expert
(``load / (choices / top_k)``; a column sums to about top_k), so domains with few tokens compare with
busy ones; ``top_k / E`` everywhere is routing that ignores the domain.
"""

from __future__ import annotations

import io
import math
from typing import Mapping, Sequence

import numpy as np

from expertmesh.observability.heatmap import _colormap, grid


def domain_frequency(domain_load: Mapping[str, np.ndarray], top_k: int) -> tuple[list[str], np.ndarray]:
    """domain -> [L, E] counts -> (domains in order, [L, D, E] share of each domain's tokens per expert)."""
    domains = sorted(d for d, load in domain_load.items() if np.asarray(load).sum() > 0)
    counts = np.stack([np.asarray(domain_load[d], dtype=np.float64) for d in domains], axis=1)  # [L, D, E]
    tokens = counts.sum(axis=2, keepdims=True) / max(top_k, 1)  # [L, D, 1]
    return domains, np.divide(counts, tokens, out=np.zeros_like(counts), where=tokens > 0)


def render_domain_heatmap(
    domain_load: Mapping[str, np.ndarray], moe_layers: Sequence[int], top_k: int, model_name: str = "", dpi: int = 100
) -> bytes:
    """PNG of expert (y) x domain (x) activation share, one panel per MoE layer. ValueError when empty."""
    from matplotlib.figure import Figure  # imported here: matplotlib is only needed to render

    if not any(np.asarray(load).sum() > 0 for load in domain_load.values()):
        raise ValueError("no tokens with a domain in the counts")
    domains, freq = domain_frequency(domain_load, top_k)
    L, D, E = freq.shape
    if L != len(moe_layers):
        raise ValueError(f"domain_load has {L} MoE layers, expected {len(moe_layers)}")
    rows, cols, size = grid(L, D, E)
    fig = Figure(figsize=size, dpi=dpi, layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    image = None
    for row, ax in enumerate(axes):
        if row >= L:
            ax.set_axis_off()
            continue
        image = ax.imshow(
            freq[row].T,
            aspect="auto",
            origin="lower",
            cmap=_colormap(),
            vmin=0.0,
            vmax=float(freq.max()) or 1.0,
            interpolation="nearest",
        )
        ax.set_title(f"layer {moe_layers[row]}", fontsize=9)
        ax.set_xticks(range(D))
        ax.set_xticklabels(domains, fontsize=6, rotation=90)
        ax.set_yticks(range(0, E, max(1, math.ceil(E / 16))))
        ax.tick_params(axis="y", labelsize=7)
        if row % cols == 0:
            ax.set_ylabel("expert", fontsize=8)
    if image is not None:
        bar = fig.colorbar(image, ax=list(axes[:L]), shrink=0.85, pad=0.01)
        bar.set_label("share of the domain's tokens routed to the expert", fontsize=8)
        bar.ax.tick_params(labelsize=7)
        bar.ax.axhline(top_k / E, color="red", linewidth=1.5)  # routing that ignores the domain
    name = f"{model_name}: " if model_name else ""
    fig.suptitle(
        f"{name}expert activation by query domain, top-{top_k} of {E} experts (red line: even routing)", fontsize=10
    )
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
