"""The router's heartbeat: which routing-table version it serves, in the state store.

A migration unloads an expert from its old group only once every live router
serves a table without that replica, so each router reports its version on every
switch and every ``interval_s``. The table itself is kept current by the
router's ``TableWatcher``, idle or not, so an idle router switches too. Races
with a step that starts meanwhile are harmless: a step keeps the view it began
with, and migrations keep both replicas serving until every router has
acknowledged. A store that does not answer delays this thread only.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from expertmesh.store import RouterHeartbeat, StateStore

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, store: StateStore, router_id: str, interval_s: float):
        self._store = store
        self.router_id = router_id
        self._interval = interval_s
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, version: int) -> None:
        """Report ``version`` as soon as this heartbeat's thread can (the table watcher calls this on a switch,
        maybe from the serving step's thread, which must not wait on the store); before ``start``, report it now."""
        if self._thread is None:
            self.publish(version)
        else:
            self._wake.set()

    def publish(self, version: int) -> None:
        """Report ``version`` now; a store hiccup is logged, the next beat retries."""
        try:
            self._store.publish_router_heartbeat(RouterHeartbeat(self.router_id, version, time.time()))
        except ConnectionError as err:
            log.debug("heartbeat not published: %s", err)

    def start(self, serving_version: Callable[[], int | None]) -> "Heartbeat":
        """Beat every interval with ``serving_version()`` (the table watcher's; None: nothing to report yet)."""
        self._thread = threading.Thread(
            target=self._run, args=(serving_version,), name="expertmesh-heartbeat", daemon=True
        )
        self._thread.start()
        return self

    def _run(self, serving_version: Callable[[], int | None]) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval)  # every interval, or at once after a switch
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                version = serving_version()
                if version is not None:
                    self.publish(version)
            except Exception:  # the heartbeat must outlive any one failure; the next round retries
                log.warning("heartbeat round failed", exc_info=True)

    def stop(self) -> None:
        """Stop beating and leave the store's list of routers (a migration then stops waiting for us)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self._store.remove_router_heartbeat(self.router_id)
        except ConnectionError:
            log.warning("could not remove this router's heartbeat; it expires by age")
