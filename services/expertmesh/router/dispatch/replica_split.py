"""Splitting one expert's tokens of a step across its replicas. Pure.

Each replica gets ``floor(n * share)`` tokens; the few left over go one each to
the replicas with the largest remainders, and among equal remainders to the
replica with the fewest calls in flight (the less loaded one), then the first.
"""

from __future__ import annotations

import math
from typing import Sequence


def split_by_share(n: int, shares: Sequence[float], in_flight: Sequence[int]) -> list[int]:
    """Token counts per replica, summing to ``n``."""
    exact = [n * s / sum(shares) for s in shares]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(len(shares)), key=lambda i: (-(exact[i] - counts[i]), in_flight[i], i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    return counts
