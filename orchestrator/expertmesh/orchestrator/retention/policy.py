"""Which finished records go (``retention``'s glossary): plain ids and times in, ids out.

Example::

    >>> expired([("a", 10.0), ("b", 500.0), ("c", 990.0)], now=1000.0, keep_s=600.0, keep_at_most=5, protect_s=60.0)
    ['a']
    >>> expired([("a", 10.0), ("b", 500.0), ("c", 990.0)], now=1000.0, keep_s=9e9, keep_at_most=1, protect_s=60.0)
    ['a', 'b']
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["expired", "routers_gone"]


def expired(
    finished: Iterable[tuple[str, float]], now: float, keep_s: float, keep_at_most: int, protect_s: float
) -> list[str]:
    """The ids of ``finished`` records (id, wall-clock second it finished) to delete at ``now``, oldest first:
    those finished more than ``keep_s`` ago, and the oldest beyond the newest ``keep_at_most``, except any finished
    within ``protect_s``."""
    ordered = sorted(finished, key=lambda entry: (entry[1], entry[0]))  # oldest first
    surplus = max(0, len(ordered) - keep_at_most)
    return [
        record
        for rank, (record, at) in enumerate(ordered)
        if now - at > keep_s or (rank < surplus and now - at > protect_s)
    ]


def routers_gone(heartbeats: Iterable[tuple[str, float]], now: float, gone_s: float) -> list[str]:
    """The routers (id, wall-clock second of its last heartbeat) silent for more than ``gone_s`` at ``now``, sorted.

    >>> routers_gone([("a", 0.0), ("b", 990.0)], now=1000.0, gone_s=600.0)
    ['a']
    """
    return sorted(router for router, at in heartbeats if now - at > gone_s)
