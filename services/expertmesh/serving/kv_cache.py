"""The KV cache of the packed serving step.

Glossary
- *sequence cache* (``SequenceKV``): one sequence's past, per attention layer
  the two tensors that layer hands to ``cache.update``: keys and values (or
  DeepSeek-V3's compressed latent and rotary key, of other widths), each
  ``[1, heads, length, dim]``. Grown by doubling, so appending a token costs
  O(1) amortised rather than a copy of the whole past.
- *step cache* (``PackedCache``): what one packed forward gets as its
  ``cache``. Every attention layer calls ``update`` once with the step's new
  states of all sequences side by side (``[1, heads, step tokens, dim]``); it
  appends each sequence's share to that sequence's cache, and
  ``serving.paged_attention`` then reads each sequence's own past with
  ``past`` (views: nothing is copied per step beyond the new tokens).

Being plain per-sequence tensors rather than pages of fixed shape, it holds
whatever an attention layer caches, whatever its widths: that is why
DeepSeek-V3's compressed cache takes the packed path too.
"""

from __future__ import annotations

import torch


class SequenceKV:
    def __init__(self) -> None:
        # layer -> (first [1, h, capacity, d1], second [1, h', capacity, d2]); rows up to the layer's length are valid
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lengths: dict[int, int] = {}

    def append(self, layer: int, first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add ``first``/``second`` [1, h, n, d] of layer ``layer``; returns that layer's whole past
        including them, [1, h, length, d] each (views: valid until the next append)."""
        n = first.shape[2]
        length = self._lengths.get(layer, 0)
        buffers = self._buffers.get(layer)
        if buffers is None or length + n > buffers[0].shape[2]:
            buffers = tuple(self._grown(old, new, length, length + n) for old, new in zip(buffers or (None, None), (first, second)))
            self._buffers[layer] = buffers
        buffers[0][:, :, length : length + n] = first
        buffers[1][:, :, length : length + n] = second
        self._lengths[layer] = length + n
        return buffers[0][:, :, : length + n], buffers[1][:, :, : length + n]

    @staticmethod
    def _grown(old: torch.Tensor | None, like: torch.Tensor, length: int, needed: int) -> torch.Tensor:
        """A buffer of at least twice ``needed`` rows holding ``old``'s first ``length`` rows."""
        shape = list(like.shape)
        shape[2] = max(16, 2 * needed)
        out = like.new_empty(shape)
        if old is not None:
            out[:, :, :length] = old[:, :, :length]
        return out

    def view(self, layer: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s past from position ``first``, [1, h, length - first, d] each (views)."""
        length = self._lengths[layer]
        first_buf, second_buf = self._buffers[layer]
        return first_buf[:, :, first:length], second_buf[:, :, first:length]

    def length(self, layer: int = 0) -> int:
        return self._lengths.get(layer, 0)


class PackedCache:
    """The ``cache`` of one packed forward: ``sequences[i]`` adds ``tokens[i]`` states this step."""

    def __init__(self, sequences: list[SequenceKV], tokens: list[int]):
        self._sequences = sequences
        self._tokens = tokens

    def update(
        self, first: torch.Tensor, second: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store first/second [1, h, step tokens, d] (each sequence its share); returns them as they came:
        the attention reads each sequence's past with ``past``."""
        for kv, a, b in zip(self._sequences, first.split(self._tokens, dim=2), second.split(self._tokens, dim=2)):
            kv.append(layer_idx, a, b)
        return first, second

    def past(self, layer: int, sequence: int, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's ``sequence``-th sequence's past on ``layer`` from position ``first``, [1, h, L, d] each."""
        return self._sequences[sequence].view(layer, first)
