"""The engine's warm-up: what it runs (``plan_warm_up``, plain data) and where it stands (``WarmUpState``).

Before the engine serves its first request, its thread runs the model once at a prefill size and once at a
decode size through the model runner's own path (``ModelRunner.warm_up``: the input buffers, the attention
backend's plan, the packed forward, the logits to the host), so the first requests do not pay for first-call
allocation and kernel selection. The MoE layers' experts calls are answered with zeros on the router
(``router.model.ZeroExperts``): no expert group is called (each group warms itself up before it serves), and
nothing any request, metric or statistic counts changes: no request, step, load window, hidden-state sample or
traffic count, no prefix-cache entry, and the KV blocks it writes are taken from the pool and given back.

Shapes (packed): one sequence's prompt chunk of P tokens at positions 0 .. P-1 (P a multiple of the block size,
at most the step budget, the context less one and what the pool holds), then a decode step of D sequences, one
token each at position P, each reading the chunk's P // block_size blocks and writing its token into a block of
its own. The per-sequence fallback: the same prompt chunk and one decode token on a cache of its own.

Example: budget 512, block 16, context 4096, 32 active, a pool of 1000 blocks -> P 512, D 16, 48 blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from expertmesh.serving.input_buffers import MIN_BUCKET

__all__ = ["WarmUpPlan", "WarmUpState", "WarmUpStatus", "plan_warm_up"]

#: pending: the engine has not begun it; running; done; failed (the engine serves anyway, cold); off (the setting)
WarmUpStatus = Literal["pending", "running", "done", "failed", "off"]


@dataclass(frozen=True)
class WarmUpPlan:
    """What the warm-up runs: a prompt chunk of ``prefill_tokens``, then ``decode_sequences`` one-token steps
    after it; ``blocks``: the KV blocks it takes for that while (0: the per-sequence fallback's own cache)."""

    prefill_tokens: int
    decode_sequences: int
    blocks: int


def plan_warm_up(
    max_step_tokens: int, max_active: int, max_context: int, block_size: int, free_blocks: int | None
) -> WarmUpPlan | None:
    """The warm-up of an engine of these limits. ``block_size`` 0 and ``free_blocks`` None: the per-sequence
    fallback (one decode sequence, no pool). None: no warm-up fits (a context of one token, a pool of fewer than
    two blocks)."""
    longest = min(max_step_tokens, max_context - 1)  # the chunk and one decode token fit the context
    if free_blocks is None:
        return WarmUpPlan(longest, 1, 0) if longest >= 1 else None
    decode = max(1, min(max_active, max_step_tokens, MIN_BUCKET))
    chunk_blocks = longest // block_size
    while chunk_blocks >= 1:
        fitting = min(decode, free_blocks - chunk_blocks)
        if fitting >= 1:
            return WarmUpPlan(chunk_blocks * block_size, fitting, chunk_blocks + fitting)
        chunk_blocks //= 2
    return None


@dataclass(frozen=True)
class WarmUpState:
    """Where the engine's warm-up stands (``Engine.warm_up_state``): /health reports it, readiness waits for it."""

    status: WarmUpStatus = "pending"
    #: seconds it took (None: not finished, or off)
    seconds: float | None = None
    #: what it ran, in words ("prefill 512 tokens, decode 16 sequences"), or why it ran nothing
    detail: str = ""
    #: why it failed ("" unless failed)
    error: str = ""

    @property
    def finished(self) -> bool:
        """Whether the engine is past it (done, failed or off): readiness no longer waits."""
        return self.status in ("done", "failed", "off")
