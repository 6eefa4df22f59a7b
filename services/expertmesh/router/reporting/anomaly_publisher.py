"""Writes a router's anomaly records (``anomaly_action`` health_round) to the state store, off the engine's thread.

The router keeps its last ``keep`` records and rewrites its field of the store's ``anomalies`` hash whole with them
(bounded: a router never holds more than ``keep`` there); the health monitor acts on each (router, seq) once.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import replace

from expertmesh.router.reporting.load_publisher import router_id
from expertmesh.store import AnomalyRecord, StateStore

__all__ = ["AnomalyPublisher"]

log = logging.getLogger(__name__)


class AnomalyPublisher:
    """``submit`` (the engine's thread) numbers a record and queues it; a thread writes the list. A store that
    fails is retried at the next record or ``flush``."""

    def __init__(self, store: StateStore, keep: int = 16, router: str | None = None):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self._store = store
        self.router_id = router or router_id()
        self._records: deque[AnomalyRecord] = deque(maxlen=keep)
        self._seq = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="expertmesh-anomaly-publisher", daemon=True)

    def start(self) -> "AnomalyPublisher":
        self._thread.start()
        return self

    def submit(self, record: AnomalyRecord) -> None:
        with self._lock:
            self._seq += 1
            self._records.append(replace(record, router_id=self.router_id, seq=self._seq))
        self._wake.set()

    def records(self) -> list[AnomalyRecord]:
        with self._lock:
            return list(self._records)

    def flush(self) -> None:
        """Write the records now (raises what the store raises)."""
        self._store.publish_anomalies(self.router_id, self.records())

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.flush()
            except Exception:  # a store hiccup must not kill the router; the next record retries
                log.warning("could not publish the anomaly records", exc_info=True)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
