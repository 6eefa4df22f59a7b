"""The forward pass of one serving step, over the stock model's own modules.

*packed* (every architecture we verify): the step's tokens of all sequences
(chunks of prompts being prefilled, one token of each decoding sequence) side
by side in one forward: ``input_ids`` and ``position_ids`` [1, T], a
``kv_cache.PackedCache`` that stores each sequence's new keys and values in its
blocks of the paged pool (``kv_cache.KVPool``), and
the step's layout for ``paged_attention``, which attends each sequence's
queries to its own past only (causal, within the layer's sliding window where
it has one). Embeddings, projections, norms, gates and the LM head run once per
step for everyone, and each MoE layer calls the experts function once with all
T tokens. Logits are computed only for the rows that need them.

*per-sequence* (the fallback): each sequence's own forward with its own
``DynamicCache``, one after another. For a model the packed step cannot take:
layers that keep state other than keys and values (linear attention, Mamba),
or an attention implementation that takes no 4D mask (flash, flex, paged).

Why not transformers' ``ContinuousBatchingManager`` (see docs/how-it-works.md, The serving step):
its background loop samples for us (no per-request seed, no prompt logits for
Score), dies on a forward error, and its paged cache cannot hold DeepSeek-V3's
compressed latents; this step keeps all of that in the engine's hands.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn
from transformers import DynamicCache

from expertmesh.serving.attention_backends import ATTENTION_BACKENDS, StepLayout, attention_metadata, choose_backend
from expertmesh.serving.input_buffers import DeviceInputs
from expertmesh.serving.kv_cache import KVPool, PackedCache
from expertmesh.serving.paged_attention import FULL, IMPLEMENTATION, SLIDING, STEP, AttentionKernel, StepAttention
from expertmesh.serving.scheduler import Rows

#: the model's attention implementations that ``paged_attention`` runs per sequence
PACKED_ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True)
class Chunk:
    """One sequence's share of a step: ``token_ids`` at positions ``start`` .. ``start + n - 1``."""

    cache: list[int] | DynamicCache  # its block table in the packed step's pool, or its own cache alone
    token_ids: tuple[int, ...]
    start: int
    rows: Rows

    def positions(self) -> torch.Tensor:
        return torch.arange(self.start, self.start + len(self.token_ids))  # [n]


@dataclass(frozen=True)
class MaskSpec:
    """The model's attention as the step's per-sequence masks need it: which layer kinds, what window, which format."""

    implementation: str  # "sdpa" (boolean masks) or "eager" (additive float masks)
    kinds: tuple[str, ...]  # each attention layer's kind, in layer order
    window: int | None  # tokens a sliding layer sees, itself included
    dtype: torch.dtype
    kernel: AttentionKernel = "per-sequence"  # the attention backend's, for this model on its device
    threads: int = 0  # the router's intra-op threads, which a large decode attention takes in a narrowed step

    @classmethod
    def of(cls, model: nn.Module, threads: int = 0) -> "MaskSpec":
        config = model.config.get_text_config()
        window = getattr(config, "sliding_window", None) or None  # Qwen2-MoE says 0 when it has none
        kinds = getattr(config, "layer_types", None) or [SLIDING if window else FULL] * config.num_hidden_layers
        implementation = config._attn_implementation
        latent = bool(getattr(config, "kv_lora_rank", None))
        kernel = choose_backend(model.device, implementation, latent, model.dtype)
        return cls(implementation, tuple(kinds), window, model.dtype, kernel, threads)

    def unsupported(self) -> str | None:
        """Why the packed step cannot run this model, or None when it can."""
        if self.implementation not in PACKED_ATTENTION:
            return (
                f"attention implementation {self.implementation!r} is not one the step runs per sequence "
                "(sdpa and eager are)"
            )
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
    attention: StepAttention  # each sequence's queries and past, for paged_attention
    logit_rows: torch.Tensor  # [R] the rows of T that need logits
    rows_per_chunk: list[int]  # how many of the R rows each chunk gets
    cache: PackedCache


def pack(chunks: list[Chunk], spec: MaskSpec, pool: KVPool) -> PackedBatch:
    """The inputs of one packed forward over ``chunks`` (each with a block table holding its positions up to the
    chunk's end): the step's layout in the pool (``attention_backends.AttentionMetadata``), planned by the model's
    attention backend."""
    tokens = [len(c.token_ids) for c in chunks]
    metadata = attention_metadata([c.cache for c in chunks], [c.start for c in chunks], tokens, pool.block_size)
    layout = StepLayout(spec.implementation, spec.kinds, spec.window, spec.dtype, spec.threads)
    cache, attention = ATTENTION_BACKENDS[spec.kernel].plan(metadata, pool, layout)
    rows = []
    for chunk, offset, k in zip(chunks, metadata.query_start_loc.tolist(), tokens):
        if chunk.rows is Rows.ALL:
            rows.extend(range(offset, offset + k))
        elif chunk.rows is Rows.LAST:
            rows.append(offset + k - 1)
    return PackedBatch(
        input_ids=torch.tensor([[t for c in chunks for t in c.token_ids]]),
        positions=torch.from_numpy(metadata.positions),
        attention=attention,
        logit_rows=torch.tensor(rows, dtype=torch.long),
        rows_per_chunk=[{Rows.NONE: 0, Rows.LAST: 1, Rows.ALL: k}[c.rows] for c, k in zip(chunks, tokens)],
        cache=cache,
    )


@contextmanager
def _paged_attention(model: nn.Module) -> Iterator[None]:
    """Within: the model's attention modules call ``paged_attention`` (the engine's thread is the
    model's only user while it serves; stock calls outside a step see the model unchanged)."""
    config = model.config
    own = config._attn_implementation
    config._attn_implementation = IMPLEMENTATION
    try:
        yield
    finally:
        config._attn_implementation = own


def forward_packed(model: nn.Module, batch: PackedBatch, inputs: DeviceInputs) -> torch.Tensor:
    """One forward of ``batch``, whose token ids, positions and logit rows are ``inputs`` on the model's device (the
    runner's buffers): the logits [R, V] of the rows it asked for, where the model computes them (the model runner
    splits them by chunk and takes to the host what the host needs)."""
    with _paged_attention(model):
        out = model(
            input_ids=inputs.input_ids,
            position_ids=inputs.positions,
            cache=batch.cache,
            use_cache=True,
            logits_to_keep=inputs.logit_rows,
            **{STEP: batch.attention},
        )
    return out.logits[0]  # [R, V]


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
