"""The router's heartbeat: which routing-table version it serves, in the state store.

A migration unloads an expert from its old group only once every live router
serves a table without that replica, so each router reports its version on every
switch and every ``interval_s``. An idle router takes no steps, so it would never
switch; the heartbeat refreshes it itself when it has not dispatched for a
whole interval (its next step would have switched anyway). Each beat also picks
up the health monitor's quarantined replicas, which change without a new table
version. Races with a step
that starts meanwhile are harmless: a view is swapped in one assignment, and
migrations keep both replicas serving until every router has acknowledged.
"""

from __future__ import annotations

import logging
import threading
import time

from expertmesh.router.dispatch import ExpertDispatcher
from expertmesh.state import RouterHeartbeat, StateStore

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, store: StateStore, router_id: str, interval_s: float):
        self._store = store
        self.router_id = router_id
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, version: int) -> None:
        """Report ``version`` now; a store hiccup is logged, the next beat retries."""
        try:
            self._store.publish_router_heartbeat(RouterHeartbeat(self.router_id, version, time.time()))
        except ConnectionError as err:
            log.debug("heartbeat not published: %s", err)

    def start(self, dispatcher: ExpertDispatcher) -> "Heartbeat":
        self._thread = threading.Thread(
            target=self._run, args=(dispatcher,), name="expertmesh-heartbeat", daemon=True
        )
        self._thread.start()
        return self

    def _run(self, dispatcher: ExpertDispatcher) -> None:
        while not self._stop.wait(self._interval):
            try:
                if time.monotonic() - dispatcher.last_dispatch > self._interval:
                    dispatcher.refresh()
                dispatcher.refresh_quarantine()
                if dispatcher.view is not None:
                    self.beat(dispatcher.view.version)
            except ConnectionError as err:  # the store is down: the dispatcher serves on, and says so once
                log.debug("heartbeat round skipped: %s", err)
            except Exception:  # the heartbeat must outlive any one failure; the next round retries
                log.warning("heartbeat round failed", exc_info=True)

    def stop(self) -> None:
        """Stop beating and leave the store's list of routers (a migration then stops waiting for us)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self._store.remove_router_heartbeat(self.router_id)
        except ConnectionError:
            log.warning("could not remove this router's heartbeat; it expires by age")
