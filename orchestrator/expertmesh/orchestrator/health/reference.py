"""An expert's output computed in the orchestrator from the checkpoint: the
reference a repaired replica is verified against.

It is stock transformers: ``HostedExperts`` holds the one expert in the
architecture's own experts module and runs its eager forward, the code the
fidelity tests hold the whole platform to. Only that expert's weights are read
(memory-mapped safetensors), once per repair, and dropped again after.
"""

from __future__ import annotations

import torch

from expertmesh.models.checkpoint import Checkpoint
from expertmesh.models.hosted_experts import HostedExperts


class Reference:
    def __init__(self, checkpoint: Checkpoint):
        self._checkpoint = checkpoint
        #: one meta skeleton per dtype, built on first use
        self._hosted: dict[torch.dtype, HostedExperts] = {}

    def output(self, layer: int, expert: int, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] (its dtype is the one computed in) -> the expert's unweighted output [T, H]."""
        hosted = self._hosted.get(hidden.dtype)
        if hosted is None:
            hosted = self._hosted[hidden.dtype] = HostedExperts(self._checkpoint, dtype=hidden.dtype)
        pair = (layer, expert)
        hosted.load([pair])
        try:
            ids = torch.full((hidden.shape[0], 1), expert, dtype=torch.int32)  # [T, 1]
            return hosted.compute(layer, hidden, ids, torch.ones(hidden.shape[0], 1))  # [T, H]
        finally:
            hosted.unload([pair])
