"""How many tokens each active sequence feeds into the next step. Pure.

Every decoding sequence feeds its one new token, whatever the budget: a step
never makes a sequence that is streaming wait. Sequences still reading their
prompt share what is left of ``max_step_tokens`` in admission order, the
oldest first (chunked prefill), and at least one prompt token goes in per step,
so a long prompt makes progress even when decoders fill the budget. A long
prompt therefore costs the streams beside it a few longer steps rather than
one very long one.
"""

from __future__ import annotations


def step_tokens(pending: list[int], decoding: list[bool], max_step_tokens: int) -> list[int]:
    """pending[i]: tokens sequence i has not fed yet (its remaining prompt, or 1 when decoding);
    decoding[i]: it is past its prompt. Returns the tokens each feeds this step (0: waits)."""
    out = [1 if d else 0 for d in decoding]
    left = max(max_step_tokens - sum(out), 1)
    for i, (n, d) in enumerate(zip(pending, decoding)):
        if d or left <= 0:
            continue
        out[i] = min(n, left)
        left -= out[i]
    return out
