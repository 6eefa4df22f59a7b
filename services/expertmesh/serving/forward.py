"""The forward pass of one serving step, over the stock model's own modules.

*packed* (every architecture we verify): the step's tokens of all sequences
(chunks of prompts being prefilled, one token of each decoding sequence) side
by side in one forward: ``input_ids`` and ``position_ids`` [1, T], a
``kv_cache.PackedCache``, and an attention mask [1, 1, T, KV] that lets each
query see only its own sequence's past (causal, within the layer's sliding
window where it has one). Embeddings, attention, norms, gates and the LM head
run once per step for everyone, and each MoE layer calls the experts function
once with all T tokens. Logits are computed only for the rows that need them.

*per-sequence* (the fallback): each sequence's own forward with its own
``DynamicCache``, one after another. For a model the packed step cannot take:
layers that keep state other than keys and values (linear attention, Mamba),
or an attention implementation that takes no 4D mask (flash, flex, paged).

Why not transformers' ``ContinuousBatchingManager`` (see the README, Serving):
its background loop samples for us (no per-request seed, no prompt logits for
Score), dies on a forward error, and its paged cache cannot hold DeepSeek-V3's
compressed latents; this step keeps all of that in the engine's hands.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache

from expertmesh.serving.kv_cache import PackedCache, SequenceKV

#: attention implementations that take a ready 4D mask as is
PACKED_ATTENTION = ("sdpa", "eager")
FULL, SLIDING = "full_attention", "sliding_attention"


class Rows(enum.Enum):
    """Which of a chunk's positions need logits."""

    NONE = "none"  # a prompt chunk with more prompt after it
    LAST = "last"  # the next token is chosen from the last position
    ALL = "all"  # Score: every prompt position


@dataclass(frozen=True)
class Chunk:
    """One sequence's share of a step: ``token_ids`` at positions ``start`` .. ``start + n - 1``."""

    cache: SequenceKV | DynamicCache
    token_ids: tuple[int, ...]
    start: int
    rows: Rows

    def positions(self) -> torch.Tensor:
        return torch.arange(self.start, self.start + len(self.token_ids))  # [n]


@dataclass(frozen=True)
class MaskSpec:
    """The model's attention as the packed mask needs it: which layer kinds, what window, which format."""

    implementation: str  # "sdpa" (boolean mask) or "eager" (additive float mask)
    kinds: tuple[str, ...]  # each attention layer's kind, in layer order
    window: int | None  # tokens a sliding layer sees, itself included
    dtype: torch.dtype

    @classmethod
    def of(cls, model: nn.Module) -> "MaskSpec":
        config = model.config.get_text_config()
        window = getattr(config, "sliding_window", None) or None  # Qwen2-MoE says 0 when it has none
        kinds = getattr(config, "layer_types", None) or [SLIDING if window else FULL] * config.num_hidden_layers
        return cls(config._attn_implementation, tuple(kinds), window, model.dtype)

    def unsupported(self) -> str | None:
        """Why the packed step cannot run this model, or None when it can."""
        if self.implementation not in PACKED_ATTENTION:
            return f"attention implementation {self.implementation!r} takes no packed 4D mask (sdpa and eager do)"
        other = sorted(set(self.kinds) - {FULL, SLIDING})
        if other:
            return f"layers of type {', '.join(other)} keep state outside the KV cache"
        if SLIDING in self.kinds and self.window is None:
            return "sliding-attention layers without a sliding_window size"
        return None


@dataclass(frozen=True)
class PackedBatch:
    input_ids: torch.Tensor  # [1, T]
    positions: torch.Tensor  # [T] each token's position in its own sequence
    attention_mask: torch.Tensor | dict[str, torch.Tensor]  # [1, 1, T, KV]; by layer kind when kinds differ
    logit_rows: torch.Tensor  # [R] the rows of T that need logits
    rows_per_chunk: list[int]  # how many of the R rows each chunk gets
    cache: PackedCache


def pack(chunks: list[Chunk], spec: MaskSpec) -> PackedBatch:
    """The inputs of one packed forward over ``chunks`` (each with a SequenceKV cache)."""
    # The indices are built in numpy: a step packs every step, and a torch op per chunk costs more
    # than the arithmetic it does.
    tokens = [len(c.token_ids) for c in chunks]
    n = np.array(tokens, dtype=np.int64)  # [B]
    lengths = np.array([c.start for c in chunks], dtype=np.int64) + n  # [B] the pasts after this step
    query_seq = np.repeat(np.arange(len(chunks)), n)  # [T]
    positions = lengths[query_seq] - n[query_seq] + _offsets_within(n, query_seq)  # [T]
    key_seq = np.repeat(np.arange(len(chunks)), lengths)  # [KV]
    key_pos = _offsets_within(lengths, key_seq)  # [KV]
    causal = (query_seq[:, None] == key_seq[None, :]) & (key_pos[None, :] <= positions[:, None])  # [T, KV]
    masks = {FULL: causal}
    if SLIDING in spec.kinds:
        masks[SLIDING] = causal & (key_pos[None, :] > positions[:, None] - spec.window)
    masks = {kind: _formatted(torch.from_numpy(m), spec) for kind, m in masks.items()}
    # A model with one kind of layer takes the mask itself; one that mixes kinds takes a dict by kind.
    attention_mask = masks[spec.kinds[0]] if len(set(spec.kinds)) == 1 else masks
    rows, offset = [], 0
    for chunk, k in zip(chunks, tokens):
        if chunk.rows is Rows.ALL:
            rows.extend(range(offset, offset + k))
        elif chunk.rows is Rows.LAST:
            rows.append(offset + k - 1)
        offset += k
    return PackedBatch(
        input_ids=torch.tensor([[t for c in chunks for t in c.token_ids]]),
        positions=torch.from_numpy(positions),
        attention_mask=attention_mask,
        logit_rows=torch.tensor(rows, dtype=torch.long),
        rows_per_chunk=[{Rows.NONE: 0, Rows.LAST: 1, Rows.ALL: k}[c.rows] for c, k in zip(chunks, tokens)],
        cache=PackedCache([c.cache for c in chunks], tokens),
    )


def _offsets_within(sizes: np.ndarray, owner: np.ndarray) -> np.ndarray:
    """For items laid out group after group (``sizes[g]`` items of group g; ``owner`` [N] each item's
    group), each item's index within its group: 0, 1, .. sizes[0]-1, 0, 1, .."""
    return np.arange(len(owner)) - (np.cumsum(sizes) - sizes)[owner]


def _formatted(allowed: torch.Tensor, spec: MaskSpec) -> torch.Tensor:
    """allowed [T, KV] -> the [1, 1, T, KV] mask the attention implementation wants."""
    if spec.implementation == "eager":  # added to the scores
        zero = torch.zeros((), dtype=spec.dtype)
        return torch.where(allowed, zero, torch.finfo(spec.dtype).min)[None, None]
    return allowed[None, None]


def forward_packed(model: nn.Module, batch: PackedBatch) -> list[torch.Tensor | None]:
    """One forward of ``batch``; per chunk, its logits [rows, V] float32 on the host, or None if it needs none.
    The batch is built on the host and goes to the model's device here."""
    device = model.device
    mask = batch.attention_mask
    out = model(
        input_ids=batch.input_ids.to(device),
        position_ids=batch.positions[None].to(device),
        attention_mask={kind: m.to(device) for kind, m in mask.items()} if isinstance(mask, dict) else mask.to(device),
        cache=batch.cache,
        use_cache=True,
        logits_to_keep=batch.logit_rows.to(device),
    )
    logits = out.logits[0].float().cpu()  # [R, V]: sampling and the Score API read them on the host
    return [part if n else None for part, n in zip(logits.split(batch.rows_per_chunk), batch.rows_per_chunk)]


def forward_alone(model: nn.Module, chunk: Chunk) -> torch.Tensor | None:
    """The per-sequence fallback: ``chunk``'s own forward on its DynamicCache; logits [rows, V] on the host, or None."""
    device = model.device
    out = model(
        input_ids=torch.tensor([chunk.token_ids], device=device),  # [1, n]
        position_ids=chunk.positions()[None].to(device),
        cache=chunk.cache,
        use_cache=True,
        logits_to_keep=0 if chunk.rows is Rows.ALL else 1,
    )
    return None if chunk.rows is Rows.NONE else out.logits[0].float().cpu()
