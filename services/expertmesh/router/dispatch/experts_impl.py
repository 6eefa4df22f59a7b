"""transformers' experts implementation ``"expertmesh"``, kept alone as transformers'
``integrations/moe.py`` keeps its registry: a MoE block's routed-experts call goes to the layer's
``LayerDispatcher``. ``router.model`` builds the model with this implementation and sets, on each experts
module, its dispatcher (``_expertmesh_dispatcher``) and MoE layer index (``_expertmesh_layer``).
Registered when imported."""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.moe import ExpertsInterface

IMPLEMENTATION = "expertmesh"


def _remote_experts_forward(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """hidden_states [T, H], top_k_index and top_k_weights [T, K] -> the routed experts' sum [T, H]."""
    return module._expertmesh_dispatcher.experts(module._expertmesh_layer, hidden_states, top_k_index, top_k_weights)


ExpertsInterface.register(IMPLEMENTATION, _remote_experts_forward)
