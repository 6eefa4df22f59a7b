"""The streaming clients of a ``bench serve`` run, one load for every side (the platform, vLLM): N clients started
together, client c sending its R requests in turn, request r of client c being prompt ``r * N + c``, each a
``TimedRequest``. What a side differs in is how a client connects (``connect``: a gRPC channel, nothing) and how
one request is streamed (``stream``); the load's shape and its timing are the same for all.

Two drivers of that one load: ``stream_clients``, a thread a client (vLLM's HTTP clients: urllib reading each
server-sent event, ~37 us of CPU a token), and ``stream_clients_async``, every client a task of one asyncio loop
(the platform's gRPC clients, ``grpc.aio``). The clients share the host's cores with the server they measure, so
what a token costs them is taken from the server: 64 synchronous gRPC client threads spent ~130 us of CPU a token
(each message a wake-up of its thread through gRPC's completion queue), the same streams on one loop ~65
(64 streams of 300 tokens against `expertmesh up` on this project's 2-core host, the client process's CPU time).

Glossary (as ``baselines.base``): N clients, R requests per client, M new tokens per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from typing import AsyncContextManager, ContextManager, TypeVar

from expertmesh.bench.report import BenchError
from expertmesh.bench.serve.stats import TimedRequest

__all__ = ["stream_clients", "stream_clients_async"]

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


@contextlib.asynccontextmanager
async def _no_connection():
    yield None


async def stream_clients_async(
    clients: int,
    requests_per_client: int,
    stream: Callable[[Connection, int, TimedRequest], Awaitable[None]],
    connect: Callable[[], AsyncContextManager[Connection]] = _no_connection,
    finished: Callable[[], None] = lambda: None,
) -> list[TimedRequest]:
    """``stream_clients`` with every client a task of the running loop: ``connect()`` an async context manager,
    opened for every client before the common start; ``await stream(connection, i, timed)`` streams request ``i``.
    The first failure (a ``BenchError``) cancels the other clients and fails the run, with its message."""
    records: list[list[TimedRequest]] = [[] for _ in range(clients)]
    start = asyncio.Event()

    async def client(c: int, connection: Connection) -> None:
        await start.wait()
        for r in range(requests_per_client):
            timed = TimedRequest(time.perf_counter(), r * clients + c)
            records[c].append(timed)
            await stream(connection, timed.prompt, timed)
            finished()

    async with contextlib.AsyncExitStack() as opened:
        connections = [await opened.enter_async_context(connect()) for _ in range(clients)]
        tasks = [asyncio.create_task(client(c, connection)) for c, connection in enumerate(connections)]
        start.set()
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()  # a no-op for the ones that finished
            await asyncio.gather(*tasks, return_exceptions=True)
    return [r for rs in records for r in rs]
