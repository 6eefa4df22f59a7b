"""Attention backends of the packed step: what the model's attention layers compute with, behind one interface
(vLLM's attention backends; FlashInfer's plan-then-run). A step's layout in the pool is plain data
(``AttentionMetadata``: block tables, computed tokens, sequence lengths, where each sequence's queries start,
where each new token's keys and values go), built once per step by ``attention_metadata``; the backend chosen for
the model (``choose_backend``) turns it, once per step, into what its kernel reads (``plan``), and every attention
layer of the step then calls its ``attend``.

Backends (``ATTENTION_BACKENDS``, keyed by ``AttentionKernel``):
- ``per-sequence``: each sequence's past gathered from its blocks, attended with the model's own attention (sdpa
  or its eager function); every device, every model.
- ``batched-decode``: as ``per-sequence``, with the step's decode rows (one query each) in one padded call per
  layer (``paged_attention.DecodeBatch``); every device, every model but those caching latents.
- ``cpu-paged-decode``: as ``batched-decode``, the decode rows by a CPU kernel reading the pool in place through
  their block tables (``cpu_paged_decode``, as vLLM's CPU paged attention does); CPU, float32, sdpa models.
- ``flash-varlen``: flash-attn's varlen kernel over the gathered pasts, one call per layer; CUDA, half precision,
  plain sdpa models (``paged_attention``'s docstring says why only there).
A backend that reads the pool through the block tables themselves on a GPU (FlashInfer's paged kernels) plugs in
here: its ``plan`` takes the metadata as it is.

Shapes: B sequences, T tokens in the step, M the widest block table; tables hold -1 where a sequence has no block
(given back behind a sliding window, or past its end).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, get_args

import numpy as np
import torch

from expertmesh.serving import cpu_paged_decode, cpu_prefill_attention, paged_attention
from expertmesh.serving.kv_cache import KVPool, PackedCache, positions_and_slots
from expertmesh.serving.paged_attention import (
    AttendKernel,
    AttentionKernel,
    SequenceRows,
    StepAttention,
    batched_decode_attend,
    cpu_paged_decode_attend,
    flash_varlen_attend,
    per_sequence_attend,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "StepLayout",
    "attention_metadata",
    "choose_backend",
]


@dataclass(frozen=True)
class AttentionMetadata:
    """One packed step's layout in the pool (see the module's shapes)."""

    block_tables: np.ndarray  # [B, M] int64
    num_computed_tokens: np.ndarray  # [B] positions each sequence had before the step
    seq_lens: np.ndarray  # [B] its positions after the step
    query_start_loc: np.ndarray  # [B + 1] where each sequence's queries start among the T tokens
    positions: np.ndarray  # [T] the position of each new token in its sequence
    slot_mapping: np.ndarray  # [T] the pool slot of each new token
    block_size: int

    @property
    def num_sequences(self) -> int:
        return len(self.seq_lens)


def attention_metadata(tables: Sequence[Sequence[int]], starts: Sequence[int], tokens: Sequence[int], block_size: int):
    """The metadata of a step whose sequence i feeds ``tokens[i]`` tokens from position ``starts[i]``, its block
    table ``tables[i]`` holding them. Built in numpy over all sequences at once: a call per sequence (numpy's or
    torch's) costs more than the arithmetic."""
    width = max(len(t) for t in tables)
    block_tables = np.full((len(tables), width), -1, dtype=np.int64)
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = table
    starts_a, tokens_a = np.asarray(starts, dtype=np.int64), np.asarray(tokens, dtype=np.int64)
    seq_lens = starts_a + tokens_a
    query_start_loc = np.concatenate([[0], np.cumsum(tokens_a)])
    positions, slot_mapping = positions_and_slots(block_tables, starts_a, query_start_loc, block_size)
    return AttentionMetadata(block_tables, starts_a, seq_lens, query_start_loc, positions, slot_mapping, block_size)


class AttentionBackend(Protocol):
    name: AttentionKernel

    def plan(
        self, metadata: AttentionMetadata, pool: KVPool, layout: "StepLayout"
    ) -> tuple[PackedCache, StepAttention]:
        """Once per step: the step's cache (where the layers' new keys and values go, how pasts are read) and the
        layout the layers' attention gets (with this backend's ``attend``)."""


@dataclass(frozen=True)
class StepLayout:
    """What of the model the attention's layout needs (``forward.MaskSpec``'s part)."""

    implementation: str  # "sdpa" or "eager"
    kinds: tuple[str, ...]
    window: int | None
    dtype: torch.dtype
    threads: int = 0  # the router's intra-op threads (``StepAttention.threads``)


class _GatheredPasts:
    """Backends that read each sequence's past from its first held block to its end: gathered by its slots, or
    (``cpu-paged-decode``'s decode rows) in place through its block table."""

    name: AttentionKernel
    attend: AttendKernel

    def plan(self, metadata: AttentionMetadata, pool: KVPool, layout: StepLayout) -> tuple[PackedCache, StepAttention]:
        size, tables = metadata.block_size, metadata.block_tables
        bases = (tables >= 0).argmax(axis=1) * size  # [B] each table's first held block's first position
        write_slots = torch.from_numpy(metadata.slot_mapping).to(pool.device)
        cache = PackedCache(pool, write_slots, tables, bases, metadata.seq_lens, size)
        qsl = metadata.query_start_loc.tolist()
        sequences = [
            SequenceRows(qsl[i], qsl[i + 1] - qsl[i], int(start))
            for i, start in enumerate(metadata.num_computed_tokens.tolist())
        ]
        step = StepAttention(
            sequences,
            cache,
            layout.implementation,
            layout.kinds,
            layout.window,
            layout.dtype,
            pool.device,
            self.attend,
            threads=layout.threads,
        )
        return cache, step


class PerSequenceBackend(_GatheredPasts):
    name: AttentionKernel = "per-sequence"
    attend = staticmethod(per_sequence_attend)


class BatchedDecodeBackend(_GatheredPasts):
    name: AttentionKernel = "batched-decode"
    attend = staticmethod(batched_decode_attend)


class CpuPagedDecodeBackend(_GatheredPasts):
    name: AttentionKernel = "cpu-paged-decode"
    attend = staticmethod(cpu_paged_decode_attend)


class FlashVarlenBackend(_GatheredPasts):
    name: AttentionKernel = "flash-varlen"
    attend = staticmethod(flash_varlen_attend)


ATTENTION_BACKENDS: dict[str, AttentionBackend] = {
    "per-sequence": PerSequenceBackend(),
    "batched-decode": BatchedDecodeBackend(),
    "cpu-paged-decode": CpuPagedDecodeBackend(),
    "flash-varlen": FlashVarlenBackend(),
}
assert set(ATTENTION_BACKENDS) == set(get_args(AttentionKernel)), "every backend the type names, and no other"


def choose_backend(device: torch.device, implementation: str, latent: bool, dtype: torch.dtype) -> AttentionKernel:
    """``flash-varlen`` where it computes what the model's own attention does (CUDA, sdpa, no latent expansion,
    half precision, flash-attn importable); ``cpu-paged-decode`` on CPU for sdpa models without latents in float32
    where its kernel builds (``cpu_paged_decode.load``); else ``batched-decode``, or ``per-sequence`` for a model
    whose cache holds latents (expanded per sequence)."""
    if (
        device.type == "cuda"
        and implementation == "sdpa"
        and not latent
        and dtype in (torch.float16, torch.bfloat16)
        and paged_attention.flash_varlen() is not None
    ):
        return "flash-varlen"
    if latent:
        return "per-sequence"
    if device.type == "cpu" and implementation == "sdpa" and dtype == torch.float32 and cpu_paged_decode.load():
        cpu_prefill_attention.load()  # its prompts' rows on the sibling kernel, built now rather than at a first prompt
        return "cpu-paged-decode"
    return "batched-decode"
