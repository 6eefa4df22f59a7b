"""Where the model runner captures its forward as graphs, and how it would cut them. vLLM captures CUDA graphs
piecewise around attention; here the cut is each MoE layer's dispatch to the expert groups: host-driven I/O that
no graph can hold. The forward is then a run of pieces (``pieces``): from the embeddings to the first MoE layer's
gate, from each MoE layer's experts to the next one's gate, from the last one's experts to the LM head; each piece
is fixed work for a given step size (the runner's input buckets, ``input_buffers``), so one graph per piece and
bucket replays it.

The runner calls its capture (``StepCapture.run``) around every packed forward. ``eager`` runs the forward as it
is, on every device. A piecewise CUDA-graph capture plugs in here (a ``StepCapture`` keyed ``piecewise``, chosen on
CUDA by ``choose_capture``); it is not built yet: capturing needs a GPU to be checked on (token-identical output,
the dispatch as the only break), and none has been lent to this project. Until then every device runs eager.

Example: MoE layers 1 and 3 of a 4-layer model -> pieces (start, 1), (1, 3), (3, end).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

import torch

__all__ = ["CAPTURES", "CaptureMode", "Piece", "StepCapture", "choose_capture", "pieces"]

CaptureMode = Literal["eager"]


@dataclass(frozen=True)
class Piece:
    """One stretch of the forward a graph can hold: after MoE layer ``after``'s experts (None: from the
    embeddings) up to MoE layer ``before``'s experts (None: through the LM head)."""

    after: int | None
    before: int | None


def pieces(moe_layers: Sequence[int]) -> list[Piece]:
    """The pieces of a forward whose MoE layers (decoder-layer indices, ascending) each break it once."""
    bounds: list[int | None] = [None, *sorted(moe_layers), None]
    return [Piece(a, b) for a, b in zip(bounds, bounds[1:])]


class StepCapture(Protocol):
    mode: CaptureMode

    def run(self, bucket: int, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The forward of a step of size bucket ``bucket`` (``forward()`` runs it eagerly)."""


class EagerCapture:
    mode: CaptureMode = "eager"

    def run(self, bucket: int, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        return forward()


CAPTURES: dict[str, StepCapture] = {"eager": EagerCapture()}
assert set(CAPTURES) == set(get_args(CaptureMode)), "every capture mode the type names, and no other"


def choose_capture(device: torch.device) -> CaptureMode:
    """The capture of a model on ``device``: ``eager`` everywhere until a piecewise CUDA-graph capture is built
    and checked on a GPU (see the module)."""
    return "eager"
