"""A sequence's engine events on an asyncio event loop.

The engine hands events to a thread-safe queue that blocks its reader; an
ASGI handler must not block its loop. One small thread per request forwards
the events onto the loop (as gRPC's streams hold a thread each). Leaving the
iteration early — the client hung up and the handler was cancelled, or it
stopped reading — cancels the sequence, so its slot frees at the next step
boundary instead of decoding for nobody.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from expertmesh.serving.events import FINAL_EVENTS, Event
from expertmesh.serving.request import Request


async def sequence_events(seq: Request) -> AsyncIterator[Event]:
    """The events of ``seq`` until its final one; leaving before that cancels ``seq``."""
    loop = asyncio.get_running_loop()
    arrived: asyncio.Queue[Event] = asyncio.Queue()

    def forward() -> None:
        for event in seq:
            try:
                loop.call_soon_threadsafe(arrived.put_nowait, event)
            except RuntimeError:  # the loop is closed: the server stopped and nobody is listening
                seq.cancel()
                return

    threading.Thread(target=forward, name="expertmesh-http-events", daemon=True).start()
    finished = False
    try:
        while not finished:
            event = await arrived.get()
            finished = isinstance(event, FINAL_EVENTS)
            yield event
    finally:
        if not finished:
            seq.cancel()


class ChoiceEvents:
    """The events of one request's choices (an engine sequence each, in the order ``add``ed), merged onto one
    async iterator of (choice index, event). It ends after every choice's final event; ``aclose`` cancels
    the sequences that have not ended."""

    def __init__(self) -> None:
        self._arrived: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self._forwarders: list[asyncio.Task] = []
        self._open = 0

    def add(self, seq: Request) -> None:
        index = len(self._forwarders)
        self._forwarders.append(asyncio.ensure_future(self._forward(index, seq)))
        self._open += 1

    async def _forward(self, index: int, seq: Request) -> None:
        async for event in sequence_events(seq):  # cancelling this task cancels ``seq`` unless it ended
            self._arrived.put_nowait((index, event))

    def __aiter__(self) -> ChoiceEvents:
        return self

    async def __anext__(self) -> tuple[int, Event]:
        if self._open == 0:
            raise StopAsyncIteration
        index, event = await self._arrived.get()
        if isinstance(event, FINAL_EVENTS):
            self._open -= 1
        return index, event

    async def aclose(self) -> None:
        for task in self._forwarders:
            task.cancel()
        await asyncio.gather(*self._forwarders, return_exceptions=True)
