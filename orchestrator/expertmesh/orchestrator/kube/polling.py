"""The thread of a level-triggered controller that lists its objects every few seconds (the ExpertQuarantine and
ExpertGroup controllers): ``sync_once`` every ``poll_s``, an API or store error logged and retried at the next pass,
and no error ever ending the thread."""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod

from expertmesh.orchestrator.kube.api import KubeApiError

log = logging.getLogger(__name__)


class PollingController(ABC):
    #: the objects' kind in the plural, for the log ("ExpertGroups")
    kinds: str

    def __init__(self, namespace: str, poll_s: float, thread_name: str):
        self.namespace = namespace
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=thread_name, daemon=True)

    @abstractmethod
    def sync_once(self) -> None:
        """One pass over the namespace's objects."""

    def start(self):
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self.sync_once()
            except (KubeApiError, ConnectionError) as err:  # the API or the store: the next pass tries again
                log.warning("%s in %s: %s", self.kinds, self.namespace, err)
            except Exception:  # a bug must not end the thread: the objects would stop acting for good
                log.exception("syncing %s in %s failed", self.kinds, self.namespace)
