"""Causal attention of a prompt's queries on the CPU in float32 (``cpu_prefill_attention.cpp``): built once per
machine, called by the ``cpu-paged-decode`` attention backend for each sequence of a step that feeds more than one
token and sees every key before it (``paged_attention.cpu_paged_decode_attend``).

Why: torch's SDPA on the CPU (its flash kernel) takes the keys in blocks of 512 and so computes the whole [n, L]
square of a prompt up to 512 tokens, masked half and all: a 480-token prompt's layer (8 query and 2 key heads of
64) 2.74 ms causal against 2.73 without the mask, two threads, this project's 2-core AVX-512 host. vLLM's CPU
attention (its ``cpu_attention_with_kv_cache``, called in its own venv on the same rows) takes 0.70 ms. This kernel
computes a block of 16 query positions (with the heads that share their keys) over blocks of 32 keys up to the
block's last position only, the scores and the values' products in registers (8 rows of 32 columns with
AVX-512), an online softmax with Sleef's exp between them: 1.05 ms (at 16 positions a block 1.14), a 480-token
prompt's serving step 182.9 -> 167.4 ms (``up --groups-as in-process``, one server switching every 5 steps).

A row's result depends only on its query, the keys it sees and the fixed key blocks from position 0: the same bits
whether the sequence is alone or batched, and for a prompt's later chunk as for the whole prompt. They are not
SDPA's bits (another order of the same sums): ``expertmesh verify`` and the engine's tests check the tokens stay
stock transformers'.

Where it cannot be built (no compiler), ``load`` says why once and returns False, and prompts keep SDPA.

Shapes: H query heads, h key heads, n queries at the last n of L positions, d / dv key / value width.
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path

import torch

from expertmesh.infra.native_kernels import load_cpu_kernel

__all__ = ["VALUE_TILE", "causal_attention", "load"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_suffix(".cpp")
_lock = threading.Lock()
#: the value width must be a multiple of this (the kernel's tile of value columns)
VALUE_TILE = 32


@functools.cache
def load() -> bool:
    """Whether the kernel is built and registered (``torch.ops.expertmesh_prefill.causal_attention``); builds it
    on the first call of a machine. Never raises: a failed build is logged once and gives False."""
    with _lock:
        return load_cpu_kernel(
            "expertmesh_cpu_prefill_attention",
            _SOURCE,
            "CPU prefill attention kernel",
            "prompts attend with torch's SDPA",
            lambda: torch.ops.expertmesh_prefill.causal_attention,
            log,
        )


def causal_attention(
    query: torch.Tensor,  # [1, H, n, d] float32, its last dimension contiguous
    keys: torch.Tensor,  # [1, h, L, d]
    values: torch.Tensor,  # [1, h, L, dv], dv a multiple of VALUE_TILE
    scale: float,
) -> torch.Tensor:
    """[1, n, H, dv]: each query (at positions L - n .. L - 1) over the keys at or before its position."""
    return torch.ops.expertmesh_prefill.causal_attention(query, keys, values, scale)
