"""Observed expert load: the planner's input.

Glossary
--------
load
    ``load[l][e]``: tokens routed to logical expert ``e`` of MoE layer ``l`` over
    the observation window. Shape [L, E].
coactivation
    ``coactivation[l][e][f]``: tokens of layer ``l`` whose top-k choice holds both
    ``e`` and ``f``; symmetric, diagonal ignored. Shape [L, E, E]. Optional.

Stats file (JSON)::

    {"num_layers": L, "num_experts": E, "top_k": k,
     "load": [[...E counts...], ...L rows],
     "coactivation": [[[...E...], ...E rows], ...L]}     # optional
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from expertmesh.contracts.errors import InputError


@dataclass(frozen=True, eq=False)
class LoadStats:
    num_layers: int
    num_experts: int
    top_k: int
    load: np.ndarray  # [L, E] float64, >= 0
    coactivation: np.ndarray | None = None  # [L, E, E] float64, symmetric, >= 0

    def __post_init__(self) -> None:
        L, E = self.num_layers, self.num_experts
        if L < 1 or E < 1:
            raise InputError(f"stats: num_layers and num_experts must be >= 1, got {L} and {E}")
        if not 1 <= self.top_k <= E:
            raise InputError(f"stats: top_k must be between 1 and num_experts ({E}), got {self.top_k}")
        if self.load.shape != (L, E):
            raise InputError(
                f"stats: load has shape {list(self.load.shape)}, expected [{L}, {E}] (num_layers, num_experts)"
            )
        if not np.all(np.isfinite(self.load)) or (self.load < 0).any():
            raise InputError("stats: load must hold finite, non-negative token counts")
        c = self.coactivation
        if c is not None:
            if c.shape != (L, E, E):
                raise InputError(f"stats: coactivation has shape {list(c.shape)}, expected [{L}, {E}, {E}]")
            if not np.all(np.isfinite(c)) or (c < 0).any():
                raise InputError("stats: coactivation must hold finite, non-negative counts")
            if not np.allclose(c, c.transpose(0, 2, 1), rtol=1e-9, atol=1e-9):
                raise InputError(
                    "stats: coactivation must be symmetric (coactivation[l][e][f] == coactivation[l][f][e])"
                )


def stats_from_dict(doc: Any) -> LoadStats:
    if not isinstance(doc, dict):
        raise InputError("stats file must be a JSON object with num_layers, num_experts, top_k, load")
    for key in ("num_layers", "num_experts", "top_k", "load"):
        if key not in doc:
            raise InputError(f"stats file has no {key!r}")
    ints = {}
    for key in ("num_layers", "num_experts", "top_k"):
        v = doc[key]
        if isinstance(v, bool) or not isinstance(v, int):
            raise InputError(f"stats: {key} must be an integer, got {v!r}")
        ints[key] = v
    load = _array(doc["load"], "load")
    coact = doc.get("coactivation")
    return LoadStats(
        ints["num_layers"],
        ints["num_experts"],
        ints["top_k"],
        load,
        None if coact is None else _array(coact, "coactivation"),
    )


def stats_to_dict(stats: LoadStats) -> dict[str, Any]:
    out: dict[str, Any] = {
        "num_layers": stats.num_layers,
        "num_experts": stats.num_experts,
        "top_k": stats.top_k,
        "load": stats.load.tolist(),
    }
    if stats.coactivation is not None:
        out["coactivation"] = stats.coactivation.tolist()
    return out


def parse_stats_json(text: str) -> LoadStats:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError(f"stats file is not valid JSON: {err}") from None
    return stats_from_dict(doc)


def _array(value: Any, name: str) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (ValueError, TypeError):
        # Ragged rows or strings: numpy cannot make a rectangular float array.
        raise InputError(f"stats: {name} must be a rectangular array of numbers") from None
    return arr
