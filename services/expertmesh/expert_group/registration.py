"""A group's address in the shared state store, kept there.

Registering once at start is not enough: a flushed or replaced store (a Redis
restart without persistence, say) would leave every router without the group's
address until the group restarted. So the group writes its endpoint again every
``interval_s``; the write is idempotent, and a store that cannot be reached is
retried at the next round.
"""

from __future__ import annotations

import logging
import threading

from expertmesh.store import StateStore

log = logging.getLogger(__name__)

INTERVAL_S = 5.0


class EndpointRegistration:
    def __init__(self, store: StateStore, group: str, address: str, interval_s: float = INTERVAL_S):
        self._store = store
        self._group = group
        self._address = address
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"expertmesh-register-{group}", daemon=True)

    def start(self) -> "EndpointRegistration":
        """Register now (an unreachable store fails here, at start) and keep doing so."""
        self._store.set_endpoint(self._group, self._address)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._store.set_endpoint(self._group, self._address)
            except ConnectionError as err:
                log.warning("could not re-register expert group %s: %s", self._group, err)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._store.close()
