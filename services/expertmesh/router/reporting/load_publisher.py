"""Writes a router's load window to the shared state store every few seconds, where the orchestrator and
``expertmesh stats export`` add up all routers: its pulse each time, its whole window (the detail) the first
time, every ``DETAIL_EVERY``-th and on stop (``contracts.load_report``). The seconds between publishes are
``interval_s`` while the routers heartbeating in the store write within the fleet's inflow budget together, longer
when they would not (``load_report.publish_interval_s``)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from expertmesh.contracts.load_report import DETAIL_EVERY, LoadPulse, publish_interval_s
from expertmesh.contracts.load_window import LoadWindow
from expertmesh.store import StateStore

log = logging.getLogger(__name__)


def router_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class LoadPublisher:
    def __init__(
        self,
        store: StateStore,
        window: LoadWindow,
        interval_s: float,
        detail_every: int = DETAIL_EVERY,
        budget_bytes_s: float = 0.0,
        clock: Callable[[], float] = time.time,
    ):
        if detail_every < 1:
            raise ValueError(f"detail_every must be at least 1, got {detail_every}")
        self._store = store
        self._window = window
        self._interval = interval_s
        self._detail_every = detail_every
        self._budget = budget_bytes_s
        self._clock = clock
        self._published = 0  # pulses written so far
        self._pulse_bytes = 0  # the latest pulse's size, and the latest detail's
        self._detail_bytes = 0
        self._id = router_id()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="expertmesh-load-publisher", daemon=True)

    def start(self) -> "LoadPublisher":
        self._thread.start()
        return self

    def publish(self, detail: bool = False) -> None:
        """The pulse; the detail before it on the first publish, every ``detail_every``-th, or when ``detail``
        (a failed write raises, and the next call writes the same kind again)."""
        if detail or self._published % self._detail_every == 0:
            data = self._window.snapshot().to_bytes()
            self._store.publish_load_detail(self._id, data)
            self._detail_bytes = len(data)
        data = LoadPulse.of(self._window, self._clock()).to_bytes()
        self._store.publish_load(self._id, data)
        self._pulse_bytes = len(data)
        self._published += 1

    def next_interval_s(self) -> float:
        """Seconds to the next publish: ``interval_s``, or longer when the fleet would exceed its budget (a store
        that cannot count its routers now leaves the interval as it is)."""
        if self._budget <= 0:
            return self._interval
        try:
            routers = self._store.router_count()
        except Exception:
            log.debug("could not count the routers; publishing at the base interval", exc_info=True)
            return self._interval
        per_publish = self._pulse_bytes + self._detail_bytes / self._detail_every
        return publish_interval_s(self._interval, routers, per_publish, self._budget, self._window.window_s)

    def _run(self) -> None:
        while not self._stop.wait(self.next_interval_s()):
            try:
                self.publish()
            except Exception:  # a store hiccup must not kill the router; the next round retries
                log.warning("could not publish the load window", exc_info=True)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.publish(detail=True)
        except Exception:
            log.warning("could not publish the final load window", exc_info=True)
