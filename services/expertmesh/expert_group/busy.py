"""Busy time of an expert group: cumulative seconds during which at least one
Dispatch was computing, like a disk's ``%util`` (time with I/O in flight).

Overlapping calls count once, so busy seconds never outrun wall seconds and the
drift controller's busy fraction (Δ busy / Δ wall between two Describe answers)
stays in [0, 1] however many calls a group runs at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class BusyClock:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._running = 0
        #: when the running count last went from 0 to 1
        self._since = 0.0
        #: busy seconds of the periods that ended
        self._done = 0.0

    @contextmanager
    def running(self) -> Iterator[None]:
        """Count the block as busy time, however it exits."""
        with self._lock:
            if self._running == 0:
                self._since = self._clock()
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0:
                    self._done += self._clock() - self._since

    def seconds(self) -> float:
        """Busy seconds so far, the period still running included."""
        with self._lock:
            return self._done + (self._clock() - self._since if self._running else 0.0)
