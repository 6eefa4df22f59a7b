"""The streaming clients every side of `bench serve` uses (``bench.serve.clients``): which prompt each request of
each client sends, that connections open before a common start, and that the first failure fails the run without
leaving the others waiting; on threads and on one asyncio loop. A made-up stream; never how fast anything was."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from expertmesh.bench.report import BenchError
from expertmesh.bench.serve.clients import stream_clients, stream_clients_async


def test_request_r_of_client_c_sends_prompt_r_n_plus_c_after_every_client_connected():
    connected, sent = [], []
    lock = threading.Lock()

    @contextlib.contextmanager
    def connect():
        with lock:
            connected.append(threading.current_thread().name)
        yield threading.current_thread().name

    def stream(name, i, timed):
        with lock:
            sent.append((name, i, len(connected)))  # every client had connected before any request was sent
        timed.arrivals.append((timed.sent + 0.01, 2))
        timed.ids.extend([i, i])

    done = []
    requests = stream_clients(3, 2, stream, connect=connect, finished=lambda: done.append(1))
    assert [r.prompt for r in requests] == [0, 3, 1, 4, 2, 5]  # client order, then request order
    assert all(r.ids == [r.prompt] * 2 and r.tokens == 2 for r in requests) and len(done) == 6
    assert {n for _, _, n in sent} == {3}
    by_client = {name: [i for n, i, _ in sent if n == name] for name, _, _ in sent}
    assert sorted(by_client.values()) == [[0, 3], [1, 4], [2, 5]]


def test_the_first_failure_fails_the_run_and_a_client_that_cannot_connect_frees_the_others():
    def stream(_, i, timed):
        if i == 4:
            raise BenchError("request 4 was refused")

    with pytest.raises(BenchError, match="request 4 was refused"):
        stream_clients(3, 2, stream)

    @contextlib.contextmanager
    def connect():
        if threading.current_thread().name.endswith("-1"):
            raise BenchError("client 1 cannot connect")
        yield None

    with pytest.raises(BenchError, match="client 1 cannot connect"):  # and the run returns: nobody waits forever
        stream_clients(3, 1, lambda *_: None, connect=connect)


def test_on_one_loop_request_r_of_client_c_sends_prompt_r_n_plus_c_after_every_client_connected():
    """``stream_clients_async``: the same load as the threads' (the prompts, their order, connections before the
    start), its clients interleaved on one loop: every client's first request is sent before any client's second."""
    connected, sent = [], []

    @contextlib.asynccontextmanager
    async def connect():
        name = f"client-{len(connected)}"
        connected.append(name)
        yield name

    async def stream(name, i, timed):
        sent.append((name, i, len(connected)))
        await asyncio.sleep(0)  # a streamed token: the other clients run meanwhile
        timed.arrivals.append((timed.sent + 0.01, 2))
        timed.ids.extend([i, i])

    done = []
    requests = asyncio.run(stream_clients_async(3, 2, stream, connect=connect, finished=lambda: done.append(1)))
    assert [r.prompt for r in requests] == [0, 3, 1, 4, 2, 5]
    assert all(r.ids == [r.prompt] * 2 and r.tokens == 2 for r in requests) and len(done) == 6
    assert {n for _, _, n in sent} == {3}
    assert sorted(i for _, i, _ in sent[:3]) == [0, 1, 2], "side by side, not one client after another"
    by_client = {name: [i for n, i, _ in sent if n == name] for name, _, _ in sent}
    assert sorted(by_client.values()) == [[0, 3], [1, 4], [2, 5]]


def test_on_one_loop_the_first_failure_cancels_the_others_and_closes_every_connection():
    closed, finished_streams = [], []

    @contextlib.asynccontextmanager
    async def connect():
        try:
            yield None
        finally:
            closed.append(1)

    async def stream(_, i, timed):
        if i == 1:
            raise BenchError("request 1 was refused")
        await asyncio.sleep(30)  # cancelled, never waited out
        finished_streams.append(i)

    with pytest.raises(BenchError, match="request 1 was refused"):
        asyncio.run(asyncio.wait_for(stream_clients_async(3, 2, stream, connect=connect), 10))
    assert len(closed) == 3 and not finished_streams
