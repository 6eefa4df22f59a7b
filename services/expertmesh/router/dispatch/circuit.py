"""Per-group circuit breakers: a group that keeps failing is avoided for a while.

Without one, every step sends a hung or broken group its tokens again and waits
for the call's deadline before failing over. A breaker opens after ``threshold``
failures in a row; while open, the plan avoids the group when its experts have
other replicas (a group whose experts have none is still tried: there is nothing
better). After ``cooldown_s`` one step may try it again (half open): a success
closes the breaker, a failure opens it for another cooldown.

A group whose call was hedged away (``slow``: its other replicas answered its slots
first, ``router.dispatch.hedging``) opens its breaker at once, not after ``threshold``
failures: it has already cost its step a hedge delay, every further call to it would cost
its step another, and its experts have other replicas to serve meanwhile (a call is only
hedged then). A group that answered late but before its hedge stays closed.

States per group: CLOSED -> OPEN -> HALF_OPEN -> CLOSED | OPEN.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass
from typing import Callable


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class _Breaker:
    failures: int = 0
    opened_at: float | None = None
    #: when a half-open trial was handed out; a trial whose step sent the group nothing expires after a cooldown
    trial_at: float | None = None


class CircuitBreakers:
    def __init__(self, threshold: int = 3, cooldown_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self._threshold = threshold
        self._cooldown = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._breakers: dict[str, _Breaker] = {}

    def state(self, group: str) -> BreakerState:
        with self._lock:
            return self._state(self._breakers.get(group, _Breaker()))

    def _state(self, breaker: _Breaker) -> BreakerState:
        if breaker.opened_at is None:
            return BreakerState.CLOSED
        if self._clock() - breaker.opened_at < self._cooldown:
            return BreakerState.OPEN
        return BreakerState.HALF_OPEN

    def avoided(self, groups: tuple[str, ...]) -> frozenset[str]:
        """The groups a new step should avoid; a half-open group's first caller gets to try it."""
        out = set()
        with self._lock:
            for group in groups:
                breaker = self._breakers.get(group)
                if breaker is None:
                    continue
                state = self._state(breaker)
                trial_pending = breaker.trial_at is not None and self._clock() - breaker.trial_at < self._cooldown
                if state is BreakerState.OPEN or (state is BreakerState.HALF_OPEN and trial_pending):
                    out.add(group)
                elif state is BreakerState.HALF_OPEN:
                    breaker.trial_at = self._clock()
        return frozenset(out)

    def success(self, group: str) -> None:
        with self._lock:
            self._breakers.pop(group, None)

    def slow(self, group: str) -> None:
        """The group lost a hedge race: open at once (or again, for another cooldown)."""
        with self._lock:
            breaker = self._breakers.setdefault(group, _Breaker())
            breaker.failures += 1
            breaker.opened_at = self._clock()
            breaker.trial_at = None

    def failure(self, group: str) -> None:
        with self._lock:
            breaker = self._breakers.setdefault(group, _Breaker())
            breaker.failures += 1
            if breaker.opened_at is not None or breaker.failures >= self._threshold:
                breaker.opened_at = self._clock()
                breaker.trial_at = None
