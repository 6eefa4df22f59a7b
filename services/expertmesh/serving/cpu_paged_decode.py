"""The CPU decode-attention kernel that reads the KV pool in place (``cpu_paged_decode.cpp``): built once per
machine, called by the ``cpu-paged-decode`` attention backend (``paged_attention.cpu_paged_decode_attend``).

Why: on a CPU, a decode step's attention is bound by memory. The ``batched-decode`` backend gathers every decode
row's past into a padded copy and hands that to torch's SDPA: each layer's keys and values are read, written, and
read again. This kernel reads each sequence's keys and values where they lie in the pool, once, found through its
block table (as vLLM's CPU paged attention does): the step builds no list of every past position's slot. Measured
on this project's 2-core host (8 layers of 64 decode rows of 256 positions, 8 query and 2 key heads of 64, caches
cold): 10.1 ms against 23.2 for the gather and SDPA on two
threads, 18.9 against 30.1 on one (docs/how-it-works.md has the serving figures).

Built once per machine for the host's vector unit (``infra.native_kernels``: ~25 s, logged; later processes load
it in well under a second). Where it cannot be built (no compiler), ``load`` says why once and returns False, and
the model keeps ``batched-decode``: slower, the same answers.

Shapes: B decode rows, H query heads, h key heads, d / dv key / value width, S pool slots, M the widest block table.
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path

import torch

from expertmesh.infra.native_kernels import load_cpu_kernel

__all__ = ["load", "paged_decode"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_suffix(".cpp")
_NAME = "expertmesh_cpu_paged_decode"
_lock = threading.Lock()


@functools.cache
def load() -> bool:
    """Whether the kernel is built and registered (``torch.ops.expertmesh_cpu.paged_decode``); builds it on the
    first call of a machine. Never raises: a failed build is logged once and gives False."""
    with _lock:
        return load_cpu_kernel(
            _NAME,
            _SOURCE,
            "CPU paged-decode attention kernel",
            "decode attention gathers instead",
            lambda: torch.ops.expertmesh_cpu.paged_decode,
            log,
        )


def paged_decode(
    query: torch.Tensor,  # [B, H, d] float32, its last dimension contiguous
    keys: torch.Tensor,  # [S, h, d] the layer's pool, S a whole number of blocks
    values: torch.Tensor,  # [S, h, dv]
    block_tables: torch.Tensor,  # [B, M] int64, each row's blocks in position order (-1: none)
    firsts: torch.Tensor,  # [B] int64, the first position each row attends to
    lengths: torch.Tensor,  # [B] int64, how many positions from there
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """[B, H, dv]: each row's softmax(scale * q . k) . v over its positions ``firsts[b]`` .. ``firsts[b] +
    lengths[b] - 1``, read where its block table puts them (``load()`` first)."""
    return torch.ops.expertmesh_cpu.paged_decode(query, keys, values, block_tables, firsts, lengths, block_size, scale)
