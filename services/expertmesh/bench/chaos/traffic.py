"""Steady streaming load: N clients, each sending its own prompt for a greedy completion of
exactly M tokens, one request after another, from start to stop. Every request is kept (when
it was sent and ended, what it returned or how it failed) and every streamed token's arrival
time, for ``measure``."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    client: int
    #: time.monotonic() when it was sent and when it ended (last token, or the error)
    sent: float
    ended: float
    tokens: tuple[int, ...]
    #: "CODE: details" when the call failed, else None
    error: str | None = None
    #: time.monotonic() of each streamed chunk
    arrivals: tuple[float, ...] = ()

    @property
    def ok(self) -> bool:
        return self.error is None


def complete(client, prompt: list[int], max_new_tokens: int, arrived=None) -> list[int]:
    """One greedy completion of exactly ``max_new_tokens`` tokens; ``arrived(n)`` per streamed chunk."""
    tokens: list[int] = []
    for chunk in client.generate(prompt, max_new_tokens=max_new_tokens, stop_at_eos=False):
        tokens += chunk.token_ids
        if arrived is not None and chunk.token_ids:
            arrived(len(chunk.token_ids))
    return tokens


class Traffic:
    def __init__(self, target: str, prompts: list[list[int]], max_new_tokens: int, deadline_s: float):
        self._target = target
        self._prompts = prompts
        self._m = max_new_tokens
        self._deadline = deadline_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.requests: list[Request] = []
        #: (time.monotonic(), tokens) per streamed chunk
        self.arrivals: list[tuple[float, int]] = []
        self._threads = [
            threading.Thread(target=self._client, args=(i,), name=f"chaos-client-{i}", daemon=True)
            for i in range(len(prompts))
        ]

    def start(self) -> "Traffic":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        """Let every client finish the request it is in, then return."""
        self._stop.set()
        for t in self._threads:
            t.join()

    def _arrived(self, n: int) -> None:
        with self._lock:
            self.arrivals.append((time.monotonic(), n))

    def _client(self, i: int) -> None:
        import grpc

        from expertmesh.client import Client

        with Client(self._target, timeout=self._deadline) as client:
            while not self._stop.is_set():
                sent, error, tokens, times = time.monotonic(), None, [], []

                def arrived(n: int) -> None:
                    times.append(time.monotonic())
                    self._arrived(n)

                try:
                    tokens = complete(client, self._prompts[i], self._m, arrived)
                except grpc.RpcError as err:
                    error = f"{err.code().name}: {err.details()}"
                with self._lock:
                    self.requests.append(Request(i, sent, time.monotonic(), tuple(tokens), error, tuple(times)))
                if error is not None:
                    self._stop.wait(0.2)  # a client that keeps failing does not spin
