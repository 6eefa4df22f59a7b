"""The experts one group holds, computed with the architecture's own experts module.

For each hosted MoE layer the group keeps one instance of the checkpoint's
experts class (``MixtralExperts``, ``GptOssExperts``, ...) whose stacked
parameters hold only the hosted experts, in ascending global id. A request's
global expert ids are mapped to local rows, and the module's stock ``eager``
forward does the math, so activation, biases, clamping and gate layout are the
architecture's, not ours.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import nn

from expertmesh.checkpoint import Checkpoint, experts_modules
from expertmesh.errors import InvalidRequest, NotHosted


@dataclass
class _LayerExperts:
    module: nn.Module
    #: global expert ids held, ascending; row i of each stacked parameter is expert ids[i]
    ids: list[int]
    #: [num_experts] int64: global id -> local row, -1 where not held
    local_of: torch.Tensor


class HostedExperts:
    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        self.checkpoint = checkpoint
        self.spec = checkpoint.spec
        self.dtype = dtype
        self.device = torch.device(device)
        # A meta skeleton gives us one experts-module instance per MoE layer to fill.
        self._templates = {layer: module for layer, (_, module) in experts_modules(checkpoint.skeleton("eager", dtype)).items()}
        self._layers: dict[int, _LayerExperts] = {}
        self._lock = threading.Lock()

    # -- what is held ----------------------------------------------------------------

    def pairs(self) -> list[tuple[int, int]]:
        return [(layer, e) for layer, held in sorted(self._layers.items()) for e in held.ids]

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for held in self._layers.values() for p in held.module.parameters())

    # -- load / unload -----------------------------------------------------------------

    def _check_pairs(self, pairs: list[tuple[int, int]]) -> None:
        for layer, expert in pairs:
            if layer not in self.spec.moe_layers:
                raise NotHosted(f"layer {layer} is not an MoE layer of this model (MoE layers: {list(self.spec.moe_layers)})")
            if not 0 <= expert < self.spec.num_experts:
                raise NotHosted(f"expert {expert} of layer {layer} does not exist ({self.spec.num_experts} experts)")

    def load(self, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Start holding ``pairs``; returns those that were not held before."""
        self._check_pairs(pairs)
        with self._lock:
            added = sorted(set(pairs) - set(self.pairs()))
            for layer in sorted({layer for layer, _ in added}):
                held = set(self._layers[layer].ids) if layer in self._layers else set()
                self._rebuild(layer, sorted(held | {e for l, e in added if l == layer}))
            return added

    def unload(self, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Stop holding ``pairs``; returns those that were held."""
        self._check_pairs(pairs)
        with self._lock:
            removed = sorted(set(pairs) & set(self.pairs()))
            for layer in sorted({layer for layer, _ in removed}):
                keep = sorted(set(self._layers[layer].ids) - {e for l, e in removed if l == layer})
                self._rebuild(layer, keep)
            return removed

    def _rebuild(self, layer: int, ids: list[int]) -> None:
        """Point ``layer``'s module at exactly ``ids``: rows already held are reused, new ones read from disk."""
        if not ids:
            self._layers.pop(layer, None)
            return
        old = self._layers.get(layer)
        new_ids = [e for e in ids if old is None or e not in old.ids]
        fresh = self.checkpoint.expert_weights(layer, new_ids, self.dtype) if new_ids else {}
        module = old.module if old is not None else self._instantiate(layer)
        for name in self.spec.expert_params:
            rows = []
            for e in ids:
                if old is not None and e in old.ids:
                    rows.append(getattr(old.module, name)[old.ids.index(e)])
                else:
                    rows.append(fresh[name][new_ids.index(e)])
            module._parameters[name] = nn.Parameter(torch.stack(rows).to(self.device), requires_grad=False)
        module.num_experts = len(ids)
        local_of = torch.full((self.spec.num_experts,), -1, dtype=torch.long)
        local_of[ids] = torch.arange(len(ids))
        self._layers[layer] = _LayerExperts(module, list(ids), local_of.to(self.device))

    def _instantiate(self, layer: int) -> nn.Module:
        """A real (non-meta) copy of the layer's experts module without its stacked parameters."""
        template = self._templates[layer]
        for name in self.spec.expert_params:
            template._parameters[name] = None
        module = template.to_empty(device=self.device)
        module.requires_grad_(False)
        return module

    # -- compute -------------------------------------------------------------------------

    def compute(
        self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """hidden [T, H], expert_ids [T, K] (global ids, -1 = empty), weights [T, K] -> partial sums [T, H]."""
        if hidden.dim() != 2 or hidden.shape[1] != self.spec.hidden_size:
            raise InvalidRequest(
                f"hidden_states must be [tokens, {self.spec.hidden_size}], got {list(hidden.shape)}"
            )
        if expert_ids.dim() != 2 or expert_ids.shape[0] != hidden.shape[0]:
            raise InvalidRequest(
                f"expert_ids must be [{hidden.shape[0]}, K] to match {hidden.shape[0]} tokens, got {list(expert_ids.shape)}"
            )
        if weights.shape != expert_ids.shape:
            raise InvalidRequest(f"routing_weights {list(weights.shape)} must match expert_ids {list(expert_ids.shape)}")
        if expert_ids.dtype not in (torch.int32, torch.int64):
            raise InvalidRequest(f"expert_ids must be int32 or int64, got {expert_ids.dtype}")
        if not weights.is_floating_point():
            raise InvalidRequest(f"routing_weights must be floating point, got {weights.dtype}")
        held = self._layers.get(layer)
        if held is None:
            layers = sorted(self._layers)
            raise NotHosted(f"layer {layer} has no experts in this group (it holds layers {layers})")

        expert_ids = expert_ids.to(self.device, torch.long)
        token_idx, slot = (expert_ids >= 0).nonzero(as_tuple=True)  # [S] each: one row per (token, expert) pair
        global_ids = expert_ids[token_idx, slot]  # [S]
        unknown = global_ids >= self.spec.num_experts
        local = held.local_of[global_ids.clamp(max=self.spec.num_experts - 1)]  # [S]
        if bool(unknown.any()) or bool((local < 0).any()):
            missing = sorted(set(global_ids[unknown | (local < 0)].tolist()))
            raise NotHosted(f"experts {missing} of layer {layer} are not held by this group (it holds {held.ids})")

        hidden = hidden.to(self.device, self.dtype)
        partial = torch.zeros_like(hidden)  # [T, H]
        if token_idx.numel():
            with torch.no_grad():
                # Each (token, expert) pair is its own row with top-k 1, so the stock eager loop sees
                # no sentinels (GPT-OSS's has no slot for one) and computes every pair exactly once.
                rows = held.module(
                    hidden[token_idx],  # [S, H]
                    local.unsqueeze(1),  # [S, 1]
                    weights.to(self.device)[token_idx, slot].unsqueeze(1),  # [S, 1]
                )  # [S, H], already weighted
                partial.index_add_(0, token_idx, rows.to(partial.dtype))
        return partial
