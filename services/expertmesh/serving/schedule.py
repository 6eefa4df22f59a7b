"""Who joins the next step, and how many tokens each active sequence feeds into it. Pure.

Admission shares the sequence slots fairly between clients (``next_admission``): a
sequence given back its blocks (preempted) is taken back first; otherwise the queue
is served by client, the client with the fewest active sequences first, each
client's own requests in their order. One client's burst (say two requests of
``n`` = 16 choices) so takes the free slots only while no other client waits, and
every slot freed goes to a waiting client below its share.

Every decoding sequence feeds its one new token, whatever the budget: a step
never makes a sequence that is streaming wait. Sequences still reading their
prompt share what is left of ``max_step_tokens`` in admission order, the
oldest first (chunked prefill), and at least one prompt token goes in per step,
so a long prompt makes progress even when decoders fill the budget. A long
prompt therefore costs the streams beside it a few longer steps rather than
one very long one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


def next_admission(queued: Sequence[tuple[str, bool]], active_clients: Sequence[str]) -> int | None:
    """queued[i]: (client, preempted) of the i-th queued sequence, oldest first; active_clients: the client of
    each active sequence. Returns the index of the queued sequence to admit next (None: the queue is empty)."""
    if not queued:
        return None
    active = Counter(active_clients)
    return min(range(len(queued)), key=lambda i: (not queued[i][1], active[queued[i][0]], i))


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
