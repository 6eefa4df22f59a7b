"""The attention of the packed serving step: each sequence's queries attend to its own past only.

Registered in transformers' attention registry as ``IMPLEMENTATION``; ``forward.forward_packed``
selects it for the duration of one packed forward and hands it the step's layout (``StepAttention``)
as the keyword ``STEP``, which transformers passes through every decoder layer to here, as its own
continuous batching passes ``cu_seq_lens``. The model's attention module has just stored the step's
new keys and values with ``cache.update``; this function then, sequence by sequence, reads that
sequence's past for the layer (``cache.past``: only the window on a sliding layer) and runs the
model's own attention on it with a mask of that sequence alone. A chunk with no past before the step (a
prompt's first chunk) attends to the step's own new keys and values as the module handed them over, the
same values the cache now holds: nothing to gather.

- ``sdpa`` models: the registry's ``sdpa`` (torch SDPA) with a boolean mask;
- ``eager`` models: the module's own ``eager_attention_forward`` (found in its modeling module, so
  GPT-OSS keeps its attention sinks) with an additive mask.

Work per layer is therefore Σ (chunk × own past) rather than T × Σ past, and nothing copies the
step's pasts side by side. A module that expands its cached latents after ``cache.update``
(DeepSeek-V3's multi-head latent attention, ``expand_kv``) gets its past expanded here, per sequence.

Kernels (the attention backends' ``attend``, ``attention_backends``, chosen once per model; each an
``AttendKernel``: one layer's call, ``LayerAttention``, in, that layer's output out):
- ``per-sequence``: the loop above, over each sequence's gathered blocks; every device, every model.
- ``batched-decode``: the loop above for the sequences that feed several tokens (prefill chunks), and the
  step's *decode rows* (sequences feeding one token, which need no mask but their length) in one call per
  layer: their pasts gathered side by side, right-padded to the longest, the padding masked
  (``DecodeBatch``). A decode step of B sequences then costs a layer one gather and one attention call instead
  of B of each: the per-call overhead was most of a decode step's attention on CPU. Every device; not for
  models whose cache holds latents (``expand_kv``), which the loop expands per sequence.
- ``cpu-paged-decode``: as ``batched-decode``, the decode rows computed by a CPU kernel that reads their keys
  and values in the pool where they lie (``cpu_paged_decode``: no gather into a padded copy, the pool read once);
  on CPU, float32, sdpa models, where the kernel builds. A sequence feeding several tokens that sees every key
  before each (a prompt's chunk) is computed by its sibling, ``cpu_prefill_attention`` (causal blocks only, 2.6x
  torch's SDPA at 480 tokens). On a layer call where they would not compute what the model's sdpa does (dropout,
  a soft cap, a position bias), that call's rows go the padded way and its prompts to the model's own.
- ``flash-varlen``: flash-attn's ``flash_attn_varlen_func``, one call per layer for all the step's
  sequences over their gathered pasts (bottom-right causal, its ``window_size`` for sliding layers);
  on CUDA, when flash-attn is importable, for plain sdpa models in half precision (no attention
  sinks, no latent expansion, which it does not take).

Glossary
- *step layout* (``StepAttention``): for each sequence of the step, where its queries sit among
  the step's T tokens and how long its past was before the step.
- *key range*: the positions a sequence's chunk attends to on a layer: 0 .. its end on a full
  layer; on a sliding layer from ``window - 1`` before its first query.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Callable, Literal, Protocol

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from expertmesh.infra.cpu_threads import all_threads_for
from expertmesh.serving import cpu_paged_decode, cpu_prefill_attention

__all__ = [
    "IMPLEMENTATION",
    "STEP",
    "AttendKernel",
    "AttentionKernel",
    "LayerAttention",
    "SequenceRows",
    "StepAttention",
    "DecodeBatch",
    "batched_decode_attend",
    "cpu_paged_decode_attend",
    "flash_varlen_attend",
    "per_sequence_attend",
]

IMPLEMENTATION = "expertmesh_paged"
#: the keyword the step's layout travels under, from the model's forward to this function
STEP = "expertmesh_step"
FULL, SLIDING = "full_attention", "sliding_attention"


AttentionKernel = Literal["per-sequence", "batched-decode", "cpu-paged-decode", "flash-varlen"]


class PastReader(Protocol):
    def past(self, layer: int, sequence: int, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``sequence``'s two cached tensors of ``layer`` from position ``first`` to its end, [1, h, L, d]
        each."""

    def pasts(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every step sequence's past of ``layer`` from its first held block, one after another, [1, h, ΣL, d]
        each (a sequence of a sliding-window model may have given back the blocks behind its window)."""

    def past_offsets(self) -> list[int]:
        """Where each sequence's past begins in ``pasts``, and their total: [B + 1]."""

    def padded_pasts(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s two cached tensors at ``slots`` [B, L] (pool slots, from ``padded_slots``), [B, h, L, d]
        each."""

    def padded_slots(self, sequences: list[int], firsts: list[int]) -> tuple[torch.Tensor, list[int]]:
        """The pool slots of step sequences ``sequences`` from positions ``firsts`` to their ends, right-padded
        with each one's last slot, [B, L]; and each one's length."""

    def layer_pool(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s two pool tensors, [slots, h, d] each, which ``padded_slots``' slots index."""

    def block_tables(self, sequences: list[int]) -> torch.Tensor:
        """Step sequences ``sequences``' block tables, [B, M] int64 (-1: no block): where ``layer_pool`` holds
        their positions (position p in slot ``table[p // block_size] * block_size + p % block_size``)."""

    @property
    def block_size(self) -> int: ...


@dataclass(frozen=True)
class SequenceRows:
    """One sequence's share of the step: queries ``offset`` .. ``offset + n - 1`` of T, at positions ``start`` ..."""

    offset: int
    n: int
    start: int

    @property
    def end(self) -> int:
        """Its past's length after this step."""
        return self.start + self.n


@dataclass
class StepAttention:
    """The layout one packed forward's attention needs (see the glossary)."""

    sequences: list[SequenceRows]
    cache: PastReader
    implementation: str  # the model's own: "sdpa" (boolean masks) or "eager" (additive masks)
    kinds: tuple[str, ...]  # each attention layer's kind, in layer order
    window: int | None  # tokens a sliding layer sees, itself included
    dtype: torch.dtype
    device: torch.device | str = "cpu"
    #: the attention backend's kernel (``AttendKernel``)
    attend: "AttendKernel" = lambda call: per_sequence_attend(call)
    #: the router's intra-op threads, which the decode rows' kernel takes in a step narrowed to fewer
    #: (``infra.cpu_threads.all_threads_for``); 0: the step's
    threads: int = 0
    #: (sequence, kind) -> (first key position, mask [1, 1, n, L]); the same for every layer of a kind
    _masks: dict[tuple[int, str], tuple[int, torch.Tensor]] = field(default_factory=dict)
    #: kind -> the step's decode rows on layers of that kind (``decode_batch``), built at the first such layer
    _decode: dict[str, "DecodeBatch"] = field(default_factory=dict)

    def first_key(self, rows: SequenceRows, kind: str) -> int:
        return max(0, rows.start - self.window + 1) if kind == SLIDING else 0

    def plainly_causal(self, rows: SequenceRows, kind: str) -> bool:
        """Whether each of the rows sees every key from position 0 to its own (a full layer, or a sliding one whose
        window reaches back past position 0 from the chunk's last row)."""
        return kind == FULL or rows.end <= self.window

    def allowed(self, i: int, kind: str) -> tuple[int, torch.Tensor]:
        """Sequence ``i``'s key range start on a ``kind`` layer and which keys each of its queries sees,
        [n, L] boolean (causal, within the window on a sliding layer)."""
        rows = self.sequences[i]
        first = self.first_key(rows, kind)
        queries = torch.arange(rows.start, rows.end)[:, None]  # [n, 1]
        keys = torch.arange(first, rows.end)[None, :]  # [1, L]
        allowed = keys <= queries  # [n, L]
        if kind == SLIDING:
            allowed &= keys > queries - self.window
        return first, allowed

    def mask(self, i: int, kind: str) -> tuple[int, torch.Tensor | None]:
        """``allowed`` as the model's attention takes it, [1, 1, n, L] on the model's device (built once a
        step), or None where no mask means the same, as in stock decoding and prefill: one query sees
        its whole key range; sdpa's own causal flag covers a chunk that is its whole key range."""
        rows = self.sequences[i]
        first = self.first_key(rows, kind)
        whole_chunk = rows.start == 0 and self.plainly_causal(rows, kind)
        if rows.n == 1 or (self.implementation == "sdpa" and whole_chunk):
            return first, None
        key = (i, kind)
        if key not in self._masks:
            first, allowed = self.allowed(i, kind)
            if self.implementation == "eager":  # added to the scores
                formatted = torch.where(allowed, torch.zeros((), dtype=self.dtype), torch.finfo(self.dtype).min)
            else:
                formatted = allowed
            self._masks[key] = first, formatted[None, None].to(self.device)
        return self._masks[key]

    def decode_batch(self, kind: str, least: int = 2) -> "DecodeBatch | None":
        """The step's decode rows on a ``kind`` layer in one padded batch (built once a step), or None when fewer
        than ``least`` sequences feed a single token. Two for a padded gather (a lone sequence's own call costs the
        same); one for the in-place kernel, which reads even a lone sequence's keys where they lie (no gather)."""
        decoding = self._decoding
        if len(decoding) < least:  # nothing built: a batch no layer of the step will use
            return None
        if kind not in self._decode:
            self._decode[kind] = DecodeBatch.of(self, decoding, kind)
        return self._decode[kind]

    @property
    def decode_only(self) -> bool:
        """Whether every sequence of the step feeds a single token (its T tokens are its B sequences, in order)."""
        return len(self._decoding) == len(self.sequences)

    @functools.cached_property
    def _decoding(self) -> list[int]:
        """The step's sequences that feed a single token, ascending."""
        return [i for i, rows in enumerate(self.sequences) if rows.n == 1]


@dataclass(frozen=True)
class DecodeBatch:
    """The step's single-query sequences of one layer kind, side by side (B of them, L the longest key range):
    each one's key range as positions (``firsts``, ``lengths``), for a kernel that reads them in place through
    the block tables (``tables``); or as pool slots right-padded to L (``slots``, ``mask``), for a padded call.
    Each form is built at its first use, once a step.

    Padding keys are each sequence's own last key, masked out; a batch whose key ranges are all as long has no
    mask, like a lone decoding sequence's call."""

    sequences: list[int]  # [B] step sequence indices, ascending
    rows: torch.Tensor  # [B] each one's query row among the step's T tokens
    firsts: list[int]  # [B] each one's first key position
    lengths: torch.Tensor  # [B] int64, each one's key range's length
    step: "StepAttention"

    @classmethod
    def of(cls, step: "StepAttention", sequences: list[int], kind: str) -> "DecodeBatch":
        firsts = [step.first_key(step.sequences[i], kind) for i in sequences]
        lengths = torch.tensor([step.sequences[i].end - first for i, first in zip(sequences, firsts)])
        rows = torch.tensor([step.sequences[i].offset for i in sequences], device=step.device)
        return cls(sequences, rows, firsts, lengths.to(step.device), step)

    @functools.cached_property
    def slots(self) -> torch.Tensor:
        """[B, L]: pool slots of each one's key range, right-padded with its last."""
        return self.step.cache.padded_slots(self.sequences, self.firsts)[0]

    @functools.cached_property
    def mask(self) -> torch.Tensor | None:
        """[B, 1, 1, L]: boolean (sdpa) or additive (eager), which of ``slots`` each one attends to; None without
        padding."""
        lengths, step = self.lengths.cpu(), self.step
        width = int(lengths.max())
        if int(lengths.min()) == width:
            return None
        allowed = torch.arange(width)[None, :] < lengths[:, None]  # [B, L]
        if step.implementation == "eager":  # added to the scores
            allowed = torch.where(allowed, torch.zeros((), dtype=step.dtype), torch.finfo(step.dtype).min)
        return allowed[:, None, None, :].to(step.device)

    @functools.cached_property
    def tables(self) -> torch.Tensor:
        """[B, M]: each one's block table."""
        return self.step.cache.block_tables(self.sequences)

    @functools.cached_property
    def first_positions(self) -> torch.Tensor:
        """[B] int64: ``firsts`` as a tensor."""
        return torch.tensor(self.firsts, device=self.lengths.device)


@dataclass(frozen=True)
class LayerAttention:
    """One attention layer's call in a packed step: what a kernel is handed."""

    module: torch.nn.Module
    query: torch.Tensor  # [1, H, T, d]
    new_keys: torch.Tensor  # [1, h, T, d] the step's new keys (the cache holds them too)
    new_values: torch.Tensor  # [1, h, T, dv]
    step: StepAttention
    kind: str  # the layer's kind: FULL or SLIDING
    kwargs: dict  # the model's own attention arguments (scaling, dropout, ...)


class AttendKernel(Protocol):
    def __call__(self, call: LayerAttention) -> torch.Tensor:
        """The layer's attention output [1, T, H, dv]."""


def _inner(module: torch.nn.Module, implementation: str):
    """The model's own attention function for one sequence."""
    if implementation == "sdpa":
        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    return sys.modules[type(module).__module__].eager_attention_forward


def _past(call: LayerAttention, i: int, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step sequence ``i``'s keys and values on the call's layer from position ``first``, [1, h, L, d] each: the
    step's new ones [1, h, T, d] when its chunk is all of its past (read back from the cache, they would be the
    same values), else gathered from the cache; expanded where the cache holds latents."""
    module, rows = call.module, call.step.sequences[i]
    expand = getattr(module, "expand_kv", None)  # MLA: the cache holds latents, expanded per use
    if expand is None and rows.start == 0 and first == 0:
        return tuple(t[:, :, rows.offset : rows.offset + rows.n] for t in (call.new_keys, call.new_values))
    past_first, past_second = call.step.cache.past(module.layer_idx, i, first)  # [1, h, L, d] each
    return expand(past_first, past_second) if expand is not None else (past_first, past_second)


def _own_attention(call: LayerAttention, i: int) -> torch.Tensor:
    """[1, n, H, dv]: step sequence ``i``'s rows by the model's own attention over its key range, its mask."""
    module, rows = call.module, call.step.sequences[i]
    first, mask = call.step.mask(i, call.kind)
    keys, values = _past(call, i, first)
    q = call.query[:, :, rows.offset : rows.offset + rows.n]  # [1, H, n, d]
    attended, _ = _inner(module, call.step.implementation)(module, q, keys, values, mask, **call.kwargs)
    return attended


#: one step sequence's rows of a layer call, [1, n, H, dv] (``_own_attention``, or a kernel's)
SequenceAttend = Callable[[LayerAttention, int], torch.Tensor]


def per_sequence_attend(call: LayerAttention, sequence_rows: SequenceAttend = _own_attention) -> torch.Tensor:
    """[1, T, H, dv]: sequence by sequence (``sequence_rows``: the model's own attention)."""
    return torch.cat([sequence_rows(call, i) for i in range(len(call.step.sequences))], dim=1)


def batched_decode_attend(call: LayerAttention) -> torch.Tensor:
    """[1, T, H, dv]: the decode rows in one padded call (``DecodeBatch``), every other sequence as
    ``per_sequence_attend`` does it."""
    return _decode_rows_together(call, _padded_rows)


def cpu_paged_decode_attend(call: LayerAttention) -> torch.Tensor:
    """[1, T, H, dv]: as ``batched_decode_attend``, the decode rows computed by the CPU kernel that reads their
    keys and values in the pool where they lie (``cpu_paged_decode``), a lone decoding sequence's too, wherever it
    computes what the model's sdpa would (``_in_place_computes``); else padded, as there."""
    if _in_place_computes(call):
        return _decode_rows_together(call, _in_place_rows, least=1, sequence_rows=_in_place_prompt_rows)
    return _decode_rows_together(call, _padded_rows)


DecodeRows = Callable[[LayerAttention, "DecodeBatch"], torch.Tensor]


def _decode_rows_together(
    call: LayerAttention, decode_rows: DecodeRows, least: int = 2, sequence_rows: SequenceAttend = _own_attention
) -> torch.Tensor:
    """[1, T, H, dv]: the step's decode rows by ``decode_rows`` (``[B, H, dv]`` for the batch) when there are at
    least ``least`` (``StepAttention.decode_batch``), each other sequence by ``sequence_rows``."""
    query, step = call.query, call.step
    batch = step.decode_batch(call.kind, least)
    if batch is None:
        return per_sequence_attend(call, sequence_rows)
    decoded = decode_rows(call, batch)  # [B, H, dv]
    if step.decode_only:  # the B rows are the T tokens, in order
        return decoded[None]  # [1, T, H, dv]
    # Each row where its token sits: no list of T one-row pieces to concatenate
    out = decoded.new_empty((1, query.shape[2], *decoded.shape[1:]))  # [1, T, H, dv]
    out[0, batch.rows] = decoded
    decoding = set(batch.sequences)
    for i, rows in enumerate(step.sequences):
        if i not in decoding:
            out[:, rows.offset : rows.offset + rows.n] = sequence_rows(call, i)
    return out


def _padded_rows(call: LayerAttention, batch: "DecodeBatch") -> torch.Tensor:
    """[B, H, dv]: the decode rows' pasts gathered side by side, right-padded, in one call of the model's own
    attention (the padding masked)."""
    module, step = call.module, call.step
    keys, values = step.cache.padded_pasts(module.layer_idx, batch.slots)  # [B, h, L, d] each
    q = call.query[0][:, batch.rows].transpose(0, 1).unsqueeze(2)  # [B, H, 1, d]
    decoded, _ = _inner(module, step.implementation)(module, q, keys, values, batch.mask, **call.kwargs)
    return decoded[:, 0]  # [B, 1, H, dv] -> [B, H, dv]


def _in_place_computes(call: LayerAttention) -> bool:
    """Whether the in-place kernel computes what the model's attention would for one query: torch SDPA's
    ``softmax(scale * q . k) . v`` (the sdpa implementation, which ignores every other keyword; no dropout, soft
    cap or position bias), float32 throughout, keys and values as the pool holds them (no latents to expand)."""
    kwargs = call.kwargs
    return (
        call.step.implementation == "sdpa"
        and not kwargs.get("dropout")
        and kwargs.get("softcap") is None
        and kwargs.get("position_bias") is None
        and getattr(call.module, "expand_kv", None) is None
        and call.query.dtype == torch.float32
        and call.new_keys.dtype == torch.float32
        and call.new_values.dtype == torch.float32
    )


def _in_place_prompt_rows(call: LayerAttention, i: int) -> torch.Tensor:
    """[1, n, H, dv]: a sequence feeding several tokens that sees every key before each (a prompt's chunk) by the
    CPU prefill kernel (``cpu_prefill_attention``), where it builds and the values' width suits it; any other by
    the model's own attention. Called where ``_in_place_computes`` holds."""
    rows, step = call.step.sequences[i], call.step
    if (
        rows.n > 1
        and step.plainly_causal(rows, call.kind)
        and call.new_values.shape[-1] % cpu_prefill_attention.VALUE_TILE == 0
        and cpu_prefill_attention.load()
    ):
        keys, values = _past(call, i, 0)  # [1, h, L, d], [1, h, L, dv]
        q = call.query[:, :, rows.offset : rows.offset + rows.n]  # [1, H, n, d]
        scale = call.kwargs.get("scaling")
        return cpu_prefill_attention.causal_attention(q, keys, values, q.shape[-1] ** -0.5 if scale is None else scale)
    return _own_attention(call, i)


def _in_place_rows(call: LayerAttention, batch: "DecodeBatch") -> torch.Tensor:
    """[B, H, dv]: the decode rows by the CPU kernel, over their positions in the layer's pool (through their
    block tables)."""
    query, step = call.query[0], call.step  # [H, T, d]
    keys, values = step.cache.layer_pool(call.module.layer_idx)  # [S, h, d], [S, h, dv]
    if step.decode_only:
        q = query.transpose(0, 1)  # [T, H, d]: the rows are the step's tokens, in order
    else:
        q = query[:, batch.rows].transpose(0, 1)  # [B, H, d]
    if q.stride(-1) != 1:
        q = q.contiguous()
    scale = call.kwargs.get("scaling")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    size = step.cache.block_size
    with all_threads_for(q.shape[0] * q.shape[1] * values.shape[-1], step.threads):  # [B, H, dv] out
        return cpu_paged_decode.paged_decode(
            q, keys, values, batch.tables, batch.first_positions, batch.lengths, size, scale
        )


@functools.cache
def flash_varlen() -> Callable | None:
    """flash-attn's ``flash_attn_varlen_func`` when it is installed, else None."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def flash_varlen_attend(call: LayerAttention) -> torch.Tensor:
    """[1, T, H, d]: one varlen call for all sequences (its causal mask is bottom-right aligned: each chunk's
    queries are the last of its keys)."""
    query, step, kind, kwargs = call.query, call.step, call.kind, call.kwargs
    keys, values = step.cache.pasts(call.module.layer_idx)  # [1, h, ΣL, d] each
    cu_q = torch.tensor(
        [*(r.offset for r in step.sequences), query.shape[2]], dtype=torch.int32, device=query.device
    )  # [B+1]
    cu_k = torch.tensor(step.cache.past_offsets(), dtype=torch.int32, device=query.device)  # [B+1]
    out = flash_varlen()(
        query[0].transpose(0, 1).contiguous(),  # [T, H, d]
        keys[0].transpose(0, 1).contiguous(),  # [ΣL, h, d]
        values[0].transpose(0, 1).contiguous(),
        cu_q,
        cu_k,
        max(r.n for r in step.sequences),
        max(r.end for r in step.sequences),
        softmax_scale=kwargs.get("scaling"),
        causal=True,
        window_size=(step.window - 1, 0) if kind == SLIDING else (-1, -1),
    )  # [T, H, d]
    return out[None]


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, d]
    key: torch.Tensor,  # [1, h, T, d] the step's new keys (already in the cache too)
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """[1, T, H, dv]: each sequence's queries attended over its own past (see the module docstring)."""
    step: StepAttention | None = kwargs.pop(STEP, None)
    if step is None:  # another forward of the model while a step runs would get no causal mask: refuse it
        raise RuntimeError(f"the {IMPLEMENTATION!r} attention runs only inside the serving engine's step")
    return step.attend(LayerAttention(module, query, key, value, step, step.kinds[module.layer_idx], kwargs)), None


AttentionInterface.register(IMPLEMENTATION, paged_attention_forward)
