"""Writes a router's load window to the shared state store every few seconds,
where the orchestrator and ``expertmesh stats export`` add up all routers."""

from __future__ import annotations

import logging
import os
import socket
import threading

from expertmesh.contracts.load_window import LoadWindow
from expertmesh.store import StateStore

log = logging.getLogger(__name__)


def router_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class LoadPublisher:
    def __init__(self, store: StateStore, window: LoadWindow, interval_s: float):
        self._store = store
        self._window = window
        self._interval = interval_s
        self._id = router_id()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="expertmesh-load-publisher", daemon=True)

    def start(self) -> "LoadPublisher":
        self._thread.start()
        return self

    def publish(self) -> None:
        self._store.publish_load(self._id, self._window.snapshot().to_bytes())

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
            self.publish()
        except Exception:
            log.warning("could not publish the final load window", exc_info=True)
