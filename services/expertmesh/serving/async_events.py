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

from expertmesh.serving.engine import ErrorEvent, Event, FinishEvent, ScoreEvent, Sequence

_FINAL = (FinishEvent, ScoreEvent, ErrorEvent)


async def sequence_events(seq: Sequence) -> AsyncIterator[Event]:
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
            finished = isinstance(event, _FINAL)
            yield event
    finally:
        if not finished:
            seq.cancel()
