"""The router's table watcher: the routing table, endpoints and quarantined replicas, read from the
state store on a thread of its own, so that no serving step ever waits on the store.

Every ``poll_s`` it asks the store whether the table version changed (one GET) and which replicas are
quarantined (one HGETALL), and swaps a new view into the dispatcher when either did
(``ExpertDispatcher.refresh`` / ``refresh_quarantine``); steps take whatever view is current at their
boundary. A store that does not answer (refused, or frozen until the client's socket timeout) costs this
thread its wait, never a step: the watcher backs off, doubling its interval up to ``max_backoff_s``, and
the dispatcher serves on its last good view. Nothing here can stop the thread: every failure is logged
and the next round retries.
"""

from __future__ import annotations

import logging
import threading

from expertmesh.contracts.errors import ExpertMeshError
from expertmesh.router.dispatch.dispatcher import ExpertDispatcher

log = logging.getLogger(__name__)


class TableWatcher:
    def __init__(self, dispatcher: ExpertDispatcher, poll_s: float = 0.25, max_backoff_s: float = 5.0):
        self._dispatcher = dispatcher
        self._poll_s = poll_s
        self._max_backoff_s = max(max_backoff_s, poll_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: rounds in a row the store did not answer
        self.failures = 0
        self._last_problem: str | None = None

    def start(self) -> "TableWatcher":
        self._dispatcher.watched = True
        self._thread = threading.Thread(target=self._run, name="expertmesh-table-watcher", daemon=True)
        self._thread.start()
        return self

    def poll_once(self) -> bool:
        """One round; True when the store answered."""
        try:
            self._dispatcher.refresh_quarantine()
            self._dispatcher.refresh()
        except ConnectionError as err:
            self.failures += 1
            if self.failures == 1:
                log.warning("state store not answering; steps serve on the routing table they have: %s", err)
            return False
        except Exception as err:  # the store answered, but: a refused table without a view to keep, or a bug
            if str(err) != self._last_problem:  # once per problem, not four times a second
                log.warning("routing-table watch round failed: %s", err, exc_info=not isinstance(err, ExpertMeshError))
                self._last_problem = str(err)
        else:
            self._last_problem = None
        if self.failures:
            log.info("state store answering again after %d failed rounds", self.failures)
        self.failures = 0
        return True

    def next_wait(self) -> float:
        """Seconds until the next round: ``poll_s``, doubled per failed round up to ``max_backoff_s``."""
        return min(self._poll_s * 2 ** min(self.failures, 30), self._max_backoff_s) if self.failures else self._poll_s

    def _run(self) -> None:
        while not self._stop.wait(self.next_wait()):
            self.poll_once()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._dispatcher.watched = False
