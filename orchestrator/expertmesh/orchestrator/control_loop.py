"""The orchestrator's control loop: one thread stepping every manager in turn.

Like Ray Serve's controller: each step calls ``update()`` of every manager whose
interval has passed (applying the placement file, drift scans, health rounds),
one after another, each guarded so that one manager's failure is logged and
never stops the loop or the others. Migrations themselves run on the
``MigrationRunner``'s workers, so a long move never holds the loop.

Managers' state lives in the managers (and the state store); the loop only
keeps when each is due next.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Manager:
    name: str
    interval_s: float
    #: one round of the manager's work; what it returns is ignored
    update: Callable[[], object]


class ControlLoop:
    def __init__(self, managers: Sequence[Manager], tick_s: float = 0.1, clock: Callable[[], float] = time.monotonic):
        self.managers = tuple(managers)
        self._tick = tick_s
        self._clock = clock
        self._due = {m.name: clock() + m.interval_s for m in self.managers}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self) -> list[str]:
        """Run every manager that is due; returns the names of those that ran."""
        ran = []
        for manager in self.managers:
            now = self._clock()
            if now < self._due[manager.name]:
                continue
            self._due[manager.name] = now + manager.interval_s
            ran.append(manager.name)
            try:
                manager.update()
            except Exception:  # the loop must outlive any one manager's round; its next round retries
                log.exception("%s round failed; next in %g s", manager.name, manager.interval_s)
        return ran

    def start(self) -> "ControlLoop":
        if self.managers:
            self._thread = threading.Thread(target=self._run, name="expertmesh-control-loop", daemon=True)
            self._thread.start()
            log.info("control loop: %s", ", ".join(f"{m.name} every {m.interval_s:g} s" for m in self.managers))
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            self.step()

    def stop(self) -> None:
        """Stop after the round under way."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
