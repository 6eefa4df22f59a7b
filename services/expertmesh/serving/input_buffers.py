"""The model runner's input buffers: a packed forward's token ids, positions and logit rows, preallocated once per
size bucket on the model's device and reused by every step of that size (vLLM's persistent input batch): no
allocation per step, fixed addresses (what a captured CUDA graph replays on), and on a GPU a pinned host staging
buffer so the copy to the device is asynchronous.

Buckets: powers of two from ``MIN_BUCKET`` up to the step's token budget, and the budget itself; a step of T tokens
uses the smallest bucket of at least T, and the first T entries of it (the rest is never read: eager forwards take
exactly T; a captured graph of the bucket pads).

Example: a budget of 512 -> buckets 16, 32, 64, 128, 256, 512; a step of 40 tokens fills 40 of bucket 64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MIN_BUCKET", "BufferPlan", "DeviceInputs", "InputBuffers", "buckets_for", "plan_for"]

MIN_BUCKET = 16


def buckets_for(max_tokens: int) -> list[int]:
    """The size buckets of a step budget of ``max_tokens``."""
    out, size = [], MIN_BUCKET
    while size < max_tokens:
        out.append(size)
        size *= 2
    return [*out, max_tokens]


@dataclass(frozen=True)
class BufferPlan:
    """Where the buffers live: the model's device, and whether a pinned host copy stages them (a GPU's)."""

    device: torch.device
    pinned_staging: bool


def plan_for(device: torch.device) -> BufferPlan:
    """The buffers of a model on ``device``: pinned staging on CUDA (an asynchronous copy), none elsewhere."""
    return BufferPlan(device, pinned_staging=device.type == "cuda")


@dataclass(frozen=True)
class DeviceInputs:
    """One step's inputs where the model computes: views of the first T (and R) entries of a bucket."""

    input_ids: torch.Tensor  # [1, T]
    positions: torch.Tensor  # [1, T]
    logit_rows: torch.Tensor  # [R]


class InputBuffers:
    def __init__(self, max_tokens: int, plan: BufferPlan):
        self.plan = plan
        self.buckets = buckets_for(max_tokens)
        # bucket -> (ids, positions, rows) on the device, and the host staging of each (None: copied directly)
        self._device: dict[int, tuple[torch.Tensor, ...]] = {}
        self._staging: dict[int, tuple[torch.Tensor, ...] | None] = {}
        for size in self.buckets:
            self._device[size] = tuple(torch.zeros(size, dtype=torch.long, device=plan.device) for _ in range(3))
            self._staging[size] = (
                tuple(torch.zeros(size, dtype=torch.long, pin_memory=True) for _ in range(3))
                if plan.pinned_staging
                else None
            )

    def bucket(self, tokens: int) -> int:
        """The smallest bucket of at least ``tokens`` (a step never feeds more than the budget: the last one)."""
        return next((size for size in self.buckets if size >= tokens), self.buckets[-1])

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, logit_rows: torch.Tensor) -> DeviceInputs:
        """input_ids [1, T], positions [T] and logit_rows [R] (R <= T) of a step, built on the host, into its
        bucket on the device."""
        tokens = positions.shape[0]
        if tokens > self.buckets[-1]:  # a step over the budget (a test's): its own tensors
            device = self.plan.device
            return DeviceInputs(input_ids.to(device), positions[None].to(device), logit_rows.to(device))
        size = self.bucket(tokens)
        sources = (input_ids[0], positions, logit_rows)
        staging = self._staging[size]
        outs = []
        for i, (target, source) in enumerate(zip(self._device[size], sources)):
            n = source.shape[0]
            if staging is not None:  # host -> pinned -> device, asynchronous on the copy's stream
                staging[i][:n].copy_(source)
                target[:n].copy_(staging[i][:n], non_blocking=True)
            else:
                target[:n].copy_(source)
            outs.append(target[:n])
        ids, pos, rows = outs
        return DeviceInputs(ids[None], pos[None], rows)
