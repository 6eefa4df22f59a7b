"""Biasing the stock gate's scores before its own top-k, for every architecture.

Each MoE block's gate (``MixtralTopKRouter``, ``DeepseekV3TopkRouter``,
``GptOssTopKRouter``, ...) computes its logits with one ``F.linear`` and then
applies the architecture's own selection (softmax or sigmoid, group-limited
top-k, renormalisation, scaling). Adding a bias to that linear's output steers
selection while every later step stays the architecture's: a bias of ``-inf`` on
an expert makes the gate choose the next-best expert in its slot (how a
quarantined expert with no healthy replica is routed around), and a finite bias
per token is what a routing policy needs.

The bias is added by a ``TorchFunctionMode`` entered only around the forward of
a gate whose layer has a bias set (none set: no mode, the stock forward runs
untouched). Torch function modes are thread-local, so the serving engine's
per-sequence threads each see only their own.

Sigmoid gates (DeepSeek-V3) select on ``sigmoid(logit) + correction bias``: an
expert at ``-inf`` has score 0 and may still be among the top-k when its
correction bias is large, with routing weight 0; the dispatch plan drops such
slots, so the output is the same as if it had not been chosen.
"""

from __future__ import annotations

import threading
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from expertmesh.checkpoint import experts_modules


class _BiasFirstLinear(TorchFunctionMode):
    """Adds ``bias`` ([E] or [T, E]) to the output of the first ``F.linear`` it sees: the gate's logits."""

    def __init__(self, bias: torch.Tensor):
        super().__init__()
        self._bias = bias
        self._done = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is F.linear and not self._done:
            self._done = True
            out = out + self._bias.to(out.device, out.dtype)
        return out


def find_gates(model: nn.Module) -> dict[int, nn.Module]:
    """layer -> the gate of its MoE block: the block's child whose weight is [num_experts, hidden]."""
    gates = {}
    for layer, (name, experts) in experts_modules(model).items():
        block = model.get_submodule(name.rsplit(".", 1)[0])
        for child in block.children():
            weight = getattr(child, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == experts.num_experts:
                gates[layer] = child
                break
        else:
            raise ValueError(f"layer {layer}: no gate with a [{experts.num_experts}, hidden] weight in {name}'s block")
    return gates


class GateBias:
    """Per MoE layer, a bias on the gate's logits; ``set`` swaps the whole map in one assignment."""

    def __init__(self, model: nn.Module):
        self._biases: Mapping[int, torch.Tensor] = {}
        self._local = threading.local()
        self.gates = find_gates(model)
        for layer, gate in self.gates.items():
            gate.register_forward_pre_hook(lambda _m, _a, layer=layer: self._enter(layer))
            gate.register_forward_hook(lambda *_: self._exit(), always_call=True)

    def set(self, biases: Mapping[int, torch.Tensor]) -> None:
        """layer -> bias [num_experts] (or [tokens, num_experts]) from the next gate forward on."""
        self._biases = dict(biases)

    def biases(self) -> Mapping[int, torch.Tensor]:
        return self._biases

    def _enter(self, layer: int) -> None:
        bias = self._biases.get(layer)
        mode = _BiasFirstLinear(bias) if bias is not None else None
        if mode is not None:
            mode.__enter__()
        self._local.mode = mode

    def _exit(self) -> None:
        mode = getattr(self._local, "mode", None)
        if mode is not None:
            self._local.mode = None
            mode.__exit__(None, None, None)


def masked(num_experts: int, experts: frozenset[int]) -> torch.Tensor:
    """A bias [num_experts] that keeps ``experts`` from being chosen: -inf on them, 0 elsewhere."""
    bias = torch.zeros(num_experts)
    bias[sorted(experts)] = float("-inf")
    return bias
