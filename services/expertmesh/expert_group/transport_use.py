"""Which transports reach a group: those it offers, and open connections and calls carried per transport.

Describe reports both, so an operator sees whether routers got the same-host fast
path (``shm``, ``cuda-ipc``) or the portable one (``grpc-stream``, ``grpc-unary``).
"""

from __future__ import annotations

import threading
from collections import Counter

from expertmesh.v1 import experts_pb2 as pb


class TransportUse:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: Counter[str] = Counter()
        self._calls: Counter[str] = Counter()

    def opened(self, transport: str) -> None:
        with self._lock:
            self._open[transport] += 1

    def closed(self, transport: str) -> None:
        with self._lock:
            self._open[transport] -= 1

    def called(self, transport: str) -> None:
        with self._lock:
            self._calls[transport] += 1

    def report(self) -> list[pb.TransportUse]:
        with self._lock:
            names = sorted(t for t in {*self._open, *self._calls} if self._open[t] or self._calls[t])
            return [pb.TransportUse(transport=t, connections=self._open[t], calls=self._calls[t]) for t in names]


def offered(info: pb.TransportsResponse) -> list[str]:
    """The transports a group whose Transports answer is ``info`` serves, fastest first."""
    same_host = ["cuda-ipc", "shm"] if info.gpu_uuid else ["shm"]
    return [*(same_host if info.shm_socket else []), "grpc-stream", "grpc-unary"]
