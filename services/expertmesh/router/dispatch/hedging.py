"""When a slow group call is hedged: each group's recent call durations, and the hedge delays they give.

A group call that has not answered within its *hedge delay*, while every expert it computes has a
replica on another group its breaker trusts, is *hedged*: the dispatcher re-plans its slots onto
those replicas, sends them, and sums whichever complete answer comes first, the group's or the
replicas' (never both: the other is cancelled and its answer, whenever it comes, is never read).
A hung group (stopped, swapped out, wedged: it accepts calls and never answers) then costs a step
one hedge delay instead of the group-call deadline, and its breaker keeps it out at once
(``circuit.CircuitBreakers.slow``). A call of experts with no other replica is never hedged.

Glossary
- *size class*: a call's rows rounded down to a power of two (1, 2-3, 4-7, ...): a group's calls of
  one class take about as long; a decode step's few rows and a prefill chunk's hundreds do not.
- *hedge delay*: how long one group's call of one size class may take before it is hedged
  (``hedge_delay``): ``HEDGE_MULTIPLE`` x the p99 of that group's recent calls of its class, within
  the configured [min, max], and never under ``LATE_MULTIPLE`` x that p99.

Example: a group whose last decode calls (1-3 rows) took 2-9 ms with a p99 of 30 ms is hedged
after 90 ms (with the default min 50 ms and max 500 ms); one that has not answered 20 calls of the
class yet, after the max.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

__all__ = ["CallDurations", "HedgePolicy", "hedge_delay", "p99", "size_class"]

#: A call is hedged once it has taken this many times the p99 of its group's calls of its size class.
#: Measured on the 2-core dev VM under `expertmesh bench chaos` (8 streaming clients, 3 groups on Ray, the
#: tiny Mixtral; 6053 answered calls): p50 1.7-3.2 ms and p99 8-20 ms in every size class of 1-63 rows,
#: the slowest call 50 ms, from CPU contention alone. 3x the p99 is then 25-60 ms: with the 50 ms
#: minimum, a loaded but healthy group was hedged at none of those calls, and a stopped one is given
#: up in a twentieth of the 1 s a stream may stall (docs/benchmarks.md, Chaos).
HEDGE_MULTIPLE = 3.0
#: However low the configured max, a call is never hedged before this many times its class's p99: a
#: class that normally takes about the max (a long prefill chunk on a CPU) would otherwise be hedged
#: at nearly every call, each doubling its work and opening a healthy group's breaker.
LATE_MULTIPLE = 1.5
#: the recent calls kept per group and size class
WINDOW = 256
#: fewer answered calls of a class than this say nothing yet: the max delay applies
MIN_SAMPLES = 20
#: a class's p99 is computed again after this many new calls (not at every call: it sorts the window)
RECOMPUTE_EVERY = 16


@dataclass(frozen=True)
class HedgePolicy:
    """The router's hedging settings (``DataPlaneConfig.hedge_*``)."""

    enabled: bool = True
    #: the shortest hedge delay: below it a healthy group's jitter would be hedged
    min_delay_s: float = 0.05
    #: the longest hedge delay (unless ``LATE_MULTIPLE`` x the class's p99 is longer), and the delay of
    #: a group and size class with too few answered calls to say
    max_delay_s: float = 0.5


def size_class(rows: int) -> int:
    """1 for 1 row, 2 for 2-3, 3 for 4-7, ...: calls of one class cost about the same."""
    return max(rows, 1).bit_length()


def p99(samples: list[float]) -> float:
    """The 99th percentile of ``samples`` (not empty), the nearest rank below."""
    ordered = sorted(samples)
    return ordered[int(0.99 * (len(ordered) - 1))]


def hedge_delay(policy: HedgePolicy, class_p99: float | None) -> float:
    """Seconds a call may take before it is hedged, given its group's p99 for calls of its size class
    (None: not known yet)."""
    if class_p99 is None:
        return policy.max_delay_s
    capped = min(max(HEDGE_MULTIPLE * class_p99, policy.min_delay_s), policy.max_delay_s)
    return max(capped, LATE_MULTIPLE * class_p99)


class _Durations:
    """One group's recent calls of one size class."""

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=WINDOW)
        self.p99: float | None = None
        self.fresh = 0  # calls recorded since ``p99`` was computed


class CallDurations:
    """Each group's recent answered call durations by size class (seconds), and the hedge delay of a new
    call (``delay``). Thread-safe: dispatches on several threads share it.

    A group's own calls decide its delay: a group on a slower host is given its own pace. A class the
    group has too few answered calls of takes the largest p99 any other group has for it (the same
    experts' work on a replica), else the max."""

    def __init__(self, policy: HedgePolicy):
        self.policy = policy
        self._lock = threading.Lock()
        self._by: dict[tuple[str, int], _Durations] = {}

    def record(self, group: str, rows: int, seconds: float) -> None:
        """An answered call of ``group`` with ``rows`` rows took ``seconds``."""
        with self._lock:
            durations = self._by.setdefault((group, size_class(rows)), _Durations())
            durations.samples.append(seconds)
            durations.fresh += 1

    def delay(self, group: str, rows: int) -> float:
        """Seconds ``group``'s call of ``rows`` rows may take before it is hedged."""
        klass = size_class(rows)
        with self._lock:
            own = self._p99(self._by.get((group, klass)))
            if own is None:
                known = [q for (g, c), d in self._by.items() if c == klass and (q := self._p99(d)) is not None]
                own = max(known, default=None)
        return hedge_delay(self.policy, own)

    @staticmethod
    def _p99(durations: _Durations | None) -> float | None:
        if durations is None or len(durations.samples) < MIN_SAMPLES:
            return None
        if durations.p99 is None or durations.fresh >= RECOMPUTE_EVERY:
            durations.p99, durations.fresh = p99(list(durations.samples)), 0
        return durations.p99
