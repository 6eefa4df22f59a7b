"""Writes a router's load window to the shared state store every few seconds, where the orchestrator and
``expertmesh stats export`` add up all routers: its pulse each time, its whole window (the detail) the first
time, every ``DETAIL_EVERY``-th and on stop (``contracts.load_report``)."""

from __future__ import annotations

import logging
import os
import socket
import threading

from expertmesh.contracts.load_report import DETAIL_EVERY, LoadPulse
from expertmesh.contracts.load_window import LoadWindow
from expertmesh.store import StateStore

log = logging.getLogger(__name__)


def router_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class LoadPublisher:
    def __init__(self, store: StateStore, window: LoadWindow, interval_s: float, detail_every: int = DETAIL_EVERY):
        if detail_every < 1:
            raise ValueError(f"detail_every must be at least 1, got {detail_every}")
        self._store = store
        self._window = window
        self._interval = interval_s
        self._detail_every = detail_every
        self._published = 0  # pulses written so far
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
            self._store.publish_load_detail(self._id, self._window.snapshot().to_bytes())
        self._store.publish_load(self._id, LoadPulse.of(self._window).to_bytes())
        self._published += 1

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
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
