"""Streaming clients that loop until stopped (``bench migration``, ``bench elastic``): client i streams
greedy prompt i over and over, each answer checked against its reference; every token's arrival, every
completion and every failure is kept with its time, so a run can be cut into windows afterwards. Clients
join and leave while it runs (a load step: ``grow``, ``shrink``).

Example: ``LoopingClients(target, prompts, reference, 16).grow(4)`` starts clients 0-3; ``shrink(2)``
stops clients 3 and 2 once their request in flight has finished.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

__all__ = ["Completion", "LoopingClients"]


@dataclass(frozen=True)
class Completion:
    """One request that finished: its client, when it was sent and ended (``perf_counter`` seconds), and
    whether its tokens differ from the reference."""

    client: int
    sent: float
    ended: float
    differs: bool


class LoopingClients:
    """Up to ``len(prompts)`` clients of the Inference API at ``target``; client i streams ``prompts[i]``
    with ``max_new_tokens`` and ``stop_at_eos=False``, again and again, and compares with ``reference[i]``."""

    def __init__(self, target: str, prompts: list[list[int]], reference: list[list[int]], max_new_tokens: int):
        if len(prompts) != len(reference):
            raise ValueError(f"{len(prompts)} prompts and {len(reference)} references")
        self._target = target
        self._prompts = prompts
        self._reference = reference
        self._m = max_new_tokens
        self._lock = threading.Lock()
        self._running: list[tuple[threading.Thread, threading.Event]] = []
        #: (arrival time, gap to the previous token of the same request), per streamed token after the first
        self.gaps: list[tuple[float, float]] = []
        self.completed: list[Completion] = []
        #: (time, client, "CODE: details") per failed request
        self.failed: list[tuple[float, int, str]] = []

    @property
    def active(self) -> int:
        """Clients running now."""
        return len(self._running)

    @property
    def requests(self) -> int:
        return len(self.completed)

    @property
    def differing(self) -> int:
        return sum(c.differs for c in self.completed)

    def request_figures(self, differing_key: str) -> dict:
        """The run's requests for a report: completed, failed, those whose tokens differ from the reference (under
        ``differing_key``), and the first failure's message when there was one."""
        figures = {"completed": self.requests, "failed": len(self.failed), differing_key: self.differing}
        if self.failed:
            figures["first_failure"] = self.failed[0][2]
        return figures

    def grow(self, n: int) -> LoopingClients:
        """Start the next ``n`` clients."""
        first = len(self._running)
        if first + n > len(self._prompts):
            raise ValueError(f"{first + n} clients, {len(self._prompts)} prompts")
        for i in range(first, first + n):
            stop = threading.Event()
            thread = threading.Thread(target=self._client, args=(i, stop), name=f"bench-client-{i}", daemon=True)
            self._running.append((thread, stop))
            thread.start()
        return self

    def shrink(self, n: int) -> None:
        """Stop the last ``n`` clients started; returns once their requests in flight have finished."""
        leaving, self._running = self._running[len(self._running) - n :], self._running[: len(self._running) - n]
        for _, stop in leaving:
            stop.set()
        for thread, _ in leaving:
            thread.join()

    def stop(self) -> None:
        self.shrink(len(self._running))

    def completions_since(self, t: float) -> dict[int, int]:
        """Client -> requests it sent at or after ``t`` (``perf_counter``) that have completed."""
        with self._lock:
            done = [c.client for c in self.completed if c.sent >= t]
        return {i: done.count(i) for i in set(done)}

    def _client(self, i: int, stop: threading.Event) -> None:
        import grpc

        from expertmesh.client import Client

        with Client(self._target, timeout=600) as client:
            while not stop.is_set():
                tokens, last, gaps = [], None, []
                sent = time.perf_counter()
                try:
                    for chunk in client.generate(self._prompts[i], max_new_tokens=self._m, stop_at_eos=False):
                        now = time.perf_counter()
                        if chunk.token_ids and last is not None:
                            gaps.append((now, (now - last) / len(chunk.token_ids)))
                        if chunk.token_ids:
                            last = now
                        tokens += chunk.token_ids
                except grpc.RpcError as err:
                    with self._lock:
                        self.failed.append((time.perf_counter(), i, f"{err.code().name}: {err.details()}"))
                    stop.wait(0.1)  # a platform that is down is not asked again in a busy loop
                    continue
                with self._lock:
                    self.gaps += gaps
                    self.completed.append(Completion(i, sent, time.perf_counter(), tokens != self._reference[i]))
