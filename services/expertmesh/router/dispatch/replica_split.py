"""Splitting a step's rows of replicated experts across their replicas so the groups' work levels. Pure.

A group's work in one MoE layer of one step is, per expert it computes, a fixed cost (reading the
expert's weights: ``EXPERT_FIXED_ROWS`` rows' worth) plus its rows. Experts with one replica fix part
of it (``loads``); each replicated expert's rows then go, largest expert first, where they raise the
highest group the least: all to the least loaded replica, or split across the least loaded ones down
to one level when the rows are many enough to pay for a second weight read. One token's expert thus
goes to whichever replica has less to do in this step: the two experts of a decode token land on two
groups when they can, and a prefill step's hot expert is shared out. The routing table's shares are
the planner's expected split of an expert's tokens; levelling the step's actual rows reaches the same
balance in expectation and a better one in every step.

Ties go to the replica with fewer calls in flight, then to the one listed first.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["EXPERT_FIXED_ROWS", "level_rows"]

#: What a group pays per expert it computes in a step, beyond its rows, in rows: one read of the expert's
#: weights (on the dev VM's CPU one 512x1792 expert's read costs what ~6 rows of its products do).
EXPERT_FIXED_ROWS = 8.0


def level_rows(
    n: int, groups: Sequence[int], loads: list[float], in_flight: Sequence[int], fixed: float = EXPERT_FIXED_ROWS
) -> list[int]:
    """Rows of one expert per replica in ``groups`` (indices into ``loads``), summing to ``n``; ``loads``
    is updated with them (``fixed`` added for each replica that gets any)."""
    order = sorted(range(len(groups)), key=lambda i: (loads[groups[i]], in_flight[groups[i]], i))
    best_level, used = None, 1
    for k in range(1, len(order) + 1):  # over the k least loaded, each paying ``fixed``, to one level
        level = (n + sum(loads[groups[i]] + fixed for i in order[:k])) / k
        if any(loads[groups[i]] + fixed > level for i in order[:k]):
            break  # the k-th would end above the level even with no rows
        if best_level is None or level < best_level:
            best_level, used = level, k
    counts = [0] * len(groups)
    if n == 0:
        return counts
    for i in order[:used]:
        counts[i] = max(0, int(best_level - loads[groups[i]] - fixed))
    for i in sorted(order[:used], key=lambda i: (loads[groups[i]] + counts[i], in_flight[groups[i]], i)):
        if sum(counts) >= n:
            break
        counts[i] += 1  # the remainder, one row each, to the lowest first
    for i, c in enumerate(counts):
        if c:
            loads[groups[i]] += fixed + c
    return counts
