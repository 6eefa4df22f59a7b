"""The streaming clients of a ``bench serve`` run, one driver for every side (the platform, vLLM): N client threads
started together, client c sending its R requests in turn, request r of client c being prompt ``r * N + c``, each
a ``TimedRequest``. What a side differs in is how a client connects (``connect``: a gRPC channel, nothing) and how
one request is streamed (``stream``); the load's shape and its timing are the same for all.

Glossary (as ``baselines.base``): N clients, R requests per client, M new tokens per request.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import ContextManager, TypeVar

from expertmesh.bench.report import BenchError
from expertmesh.bench.serve.stats import TimedRequest

__all__ = ["stream_clients"]

Connection = TypeVar("Connection")


def stream_clients(
    clients: int,
    requests_per_client: int,
    stream: Callable[[Connection, int, TimedRequest], None],
    connect: Callable[[], ContextManager[Connection]] = contextlib.nullcontext,
    finished: Callable[[], None] = lambda: None,
) -> list[TimedRequest]:
    """The run's requests, in client order. ``connect()`` opens a client's connection before the start barrier
    (so no client's dialling is timed); ``stream(connection, i, timed)`` streams request ``i``, appending each
    chunk to ``timed`` (``arrivals``, ``ids``), and raises ``BenchError`` when it fails; ``finished()`` runs after
    each request (a progress bar). The first failure fails the run, with its message."""
    records: list[list[TimedRequest]] = [[] for _ in range(clients)]
    errors: list[str] = []
    barrier = threading.Barrier(clients)

    def client(c: int) -> None:
        try:
            with connect() as connection:
                barrier.wait()
                for r in range(requests_per_client):
                    timed = TimedRequest(time.perf_counter(), r * clients + c)
                    records[c].append(timed)
                    stream(connection, timed.prompt, timed)
                    finished()
        except BenchError as err:
            errors.append(str(err))
            barrier.abort()  # the others are not left waiting for a client that will never start
        except threading.BrokenBarrierError:
            pass

    threads = [
        threading.Thread(target=client, args=(c,), name=f"bench-client-{c}", daemon=True) for c in range(clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise BenchError(errors[0])
    return [r for rs in records for r in rs]
