r"""Each MoE layer's expert choices in one forward of the serving engine, sliced per sequence: the one
record the routing trace and the per-sequence load statistics (relative positions, experts per token by
query length) are built from.

The engine packs ``tokens_per_sequence`` tokens of each sequence side by side, in order, and gives the step a
``StepChoices`` (its ``StepContext.choices``); each layer's dispatch ``record``\ s its choice into it. Only
when some sequence of the step asked for a trace (``detail``) does a dispatch also keep the weights it applied
and the group that served each slot (``layer_plan.slot_groups``): a step without one pays for the expert ids
alone.

Shape: ``StepChoices.experts(i)`` [L, t_i, K] int16/int32 for sequence ``i`` of the step (L: the MoE
layers recorded, in order; ids >= num_experts: a slot left empty). Example: 2 sequences of 3 and 1 tokens,
2 MoE layers of top-2 -> ``experts(0).shape == (2, 3, 2)``, ``experts(1).shape == (2, 1, 2)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["LayerRouting", "StepChoices", "concat_steps", "split_rows"]


@dataclass(frozen=True)
class LayerRouting:
    """One token's routing in one MoE layer: the experts it chose (as served, in slot order), the weight
    each was applied with, and the group that served each ("" where none did: a quarantined expert's slot
    the fallback dropped)."""

    layer: int  # decoder-layer index
    experts: tuple[int, ...]
    weights: tuple[float, ...]
    groups: tuple[str, ...]


def split_rows(rows: np.ndarray, tokens_per_sequence: Sequence[int], axis: int = 0) -> list[np.ndarray]:
    """A packed step's per-token array split by sequence along ``axis``: ``tokens_per_sequence[i]`` rows each,
    in order. Raises ValueError when the counts do not add up to the rows."""
    if sum(tokens_per_sequence) != rows.shape[axis]:
        raise ValueError(f"{sum(tokens_per_sequence)} tokens per sequence in all, but {rows.shape[axis]} rows")
    return np.split(rows, np.cumsum(tokens_per_sequence)[:-1], axis=axis)


def concat_steps(steps: Sequence[np.ndarray], num_experts: int) -> np.ndarray:
    """One sequence's [L, n_s, K_s] choices of its steps, in order -> [L, sum n_s, max K_s]: a step of narrower
    K (another step's dynamic-k layer took one more) padded with empty slots (``num_experts``)."""
    width = max(step.shape[2] for step in steps)
    return np.concatenate(
        [np.pad(step, ((0, 0), (0, 0), (0, width - step.shape[2])), constant_values=num_experts) for step in steps],
        axis=1,
    )


@dataclass
class _Layer:
    layer: int
    experts: np.ndarray  # [T, K] int64
    weights: np.ndarray | None  # [T, K] float32 as applied (detail only)
    groups: np.ndarray | None  # [T, K] int64 group index, -1: none (detail only)
    group_names: tuple[str, ...]


class StepChoices:
    """One forward's expert choices, by the sequence they belong to. ``detail[i]``: sequence ``i`` wants
    the weights and groups of its tokens too (a routing trace)."""

    def __init__(self, tokens_per_sequence: Sequence[int], detail: Sequence[bool] = ()):
        self.tokens_per_sequence = tuple(tokens_per_sequence)
        #: experts per layer (ids from it up are empty slots), known from the first layer recorded
        self.num_experts = 0
        self.detail = tuple(detail) or (False,) * len(self.tokens_per_sequence)
        self._layers: list[_Layer] = []

    @property
    def wants_detail(self) -> bool:
        return any(self.detail)

    @property
    def layers(self) -> tuple[int, ...]:
        """The MoE layers recorded, in order."""
        return tuple(r.layer for r in self._layers)

    def record(
        self,
        layer: int,
        num_experts: int,
        experts: torch.Tensor,
        weights: torch.Tensor | None = None,
        groups: torch.Tensor | None = None,
        group_names: Sequence[str] = (),
    ) -> None:
        """experts [T, K] the ids served (>= num_experts: an empty slot); weights [T, K]; groups [T, K] (index
        into ``group_names``, -1: none). A layer whose T is not the step's tokens (a forward the engine did not
        pack) is not recorded."""
        if experts.shape[0] != sum(self.tokens_per_sequence):
            return
        self.num_experts = num_experts
        self._layers.append(
            _Layer(
                layer,
                experts.detach().to("cpu", torch.long).numpy(),
                None if weights is None else weights.detach().to("cpu", torch.float32).numpy(),
                None if groups is None else groups.detach().to("cpu", torch.long).numpy(),
                tuple(group_names),
            )
        )

    def experts(self) -> list[np.ndarray]:
        """Per sequence: [L, t_i, K] expert ids (int16 when they fit, else int32); [] when no layer recorded.
        The widest K of the step (a dynamic-k layer may take one more) pads the others with empty slots."""
        if not self._layers:
            return []
        width = max(r.experts.shape[1] for r in self._layers)
        dtype = np.int16 if self.num_experts < np.iinfo(np.int16).max else np.int32
        stacked = np.full((len(self._layers), sum(self.tokens_per_sequence), width), self.num_experts, dtype=dtype)
        for i, r in enumerate(self._layers):
            stacked[i, :, : r.experts.shape[1]] = np.minimum(r.experts, self.num_experts)
        return split_rows(stacked, self.tokens_per_sequence, axis=1)

    def token_routing(self, sequence: int, row: int = -1) -> tuple[LayerRouting, ...]:
        """The routing of row ``row`` of sequence ``sequence``'s tokens (default its last), in each layer
        recorded with detail; empty slots left out."""
        start = sum(self.tokens_per_sequence[:sequence])
        count = self.tokens_per_sequence[sequence]
        if not -count <= row < count:
            raise IndexError(f"sequence {sequence} has {count} tokens in this step, no row {row}")
        t = start + row % count
        out = []
        for r in self._layers:
            if r.weights is None or r.groups is None:
                continue
            slots = [k for k, e in enumerate(r.experts[t]) if e < self.num_experts]
            out.append(
                LayerRouting(
                    r.layer,
                    tuple(int(r.experts[t, k]) for k in slots),
                    tuple(float(r.weights[t, k]) for k in slots),
                    tuple(r.group_names[g] if g >= 0 else "" for g in (int(r.groups[t, k]) for k in slots)),
                )
            )
        return tuple(out)
