"""Work computed side by side on a host's cores: helper threads ("lanes") and the thread that waits, helping.

Why: a MoE layer's calls to the groups in the router's own process (``up --groups-as in-process``) computed one
after another each spread its products over every intra-op thread, and on a host of a few cores the expert
products are small enough that one call's threads wait on each other more than they compute. Measured on this
project's 2-core host, the 214M Mixtral's 8 layers of 8 experts on the grouped kernel: 16 rows an expert, one
call at two threads 63 ms against two calls of four experts side by side at one thread each 35 ms; 4 rows an
expert 34 against 19 ms. Each row's arithmetic is the same wherever it runs, so the results are the same bits.

Glossary:
- work: a callable ``submit`` queued; its lifecycle is ``WorkState`` (QUEUED -> RUNNING -> DONE, or QUEUED ->
  CANCELLED).
- lane: a helper thread, with its own share of the intra-op threads (``threads_each``), taking queued work in
  the order it came.
- helping: a thread that waits on a work (``wait``) runs queued work itself meanwhile (the work it waits on
  first), at the lanes' share of the threads while a lane computes beside it (or will: work is left queued)
  and at its own otherwise; so the last call of a layer is computed by the thread that sent it, not handed to
  a lane while that thread sleeps.

A lane takes work only while someone else computes too or more than one work is queued: a layer's lone call
is left to its sender, who computes it at all its threads (a lane would compute it at fewer while the sender
sleeps). Work large enough to keep every thread busy on its own is not queued at all: its sender computes it at
once at all the lanes' threads (``run_wide``), one such work after another.
"""

from __future__ import annotations

import collections
import enum
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from expertmesh.infra.cpu_threads import at_threads

__all__ = ["ComputeLanes", "Work", "WorkState", "split_threads"]


class WorkState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"


class Work:
    """One submitted callable: its state and, once DONE, its value or the exception it raised."""

    __slots__ = ("fn", "state", "value", "error")

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.state = WorkState.QUEUED
        self.value: Any = None
        self.error: BaseException | None = None

    def result(self) -> Any:
        """The value (raises what the callable raised); only once DONE."""
        assert self.state is WorkState.DONE, self.state
        if self.error is not None:
            raise self.error
        return self.value


def split_threads(threads: int, parties: int) -> tuple[int, int]:
    """(lanes, intra-op threads each) for ``parties`` calls that can run side by side on ``threads`` intra-op
    threads: one lane fewer than the parties (the sender is the last), each party an equal share.

    Example: (2, 2) -> (1, 1); (16, 2) -> (1, 8); (2, 1) -> (0, 2); (2, 4) -> (1, 1)."""
    side_by_side = max(1, min(parties, threads))
    return side_by_side - 1, max(1, threads // side_by_side)


class ComputeLanes:
    """``lanes`` helper threads at ``threads_each`` intra-op threads each; ``submit`` queues, ``wait`` helps
    until a work is done. ``close`` stops the lanes (work still queued is then run by whoever waits on it)."""

    def __init__(self, lanes: int, threads_each: int, name: str = "expertmesh-lane"):
        self.threads_each = max(1, threads_each)
        self._cond = threading.Condition()
        self._queue: collections.deque[Work] = collections.deque()
        self._computing = 0  # threads running a work now, lanes and helpers alike
        self._lanes_computing = 0
        self._closed = False
        self._threads = [
            threading.Thread(target=self._lane, name=f"{name}-{i}", daemon=True) for i in range(max(0, lanes))
        ]
        self._ready = threading.Barrier(len(self._threads) + 1)
        restore = torch.get_num_threads()
        for thread in self._threads:
            thread.start()
        self._ready.wait()
        # Each lane narrowed its own threads, which also sets torch's process-wide default that threads
        # started later take; the default goes back to what it was (the lanes keep theirs).
        torch.set_num_threads(restore)

    def submit(self, fn: Callable[[], Any]) -> Work:
        work = Work(fn)
        with self._cond:
            self._queue.append(work)
            self._cond.notify_all()
        return work

    def wait(self, work: Work, timeout_s: float | None = None) -> bool:
        """Help until ``work`` is DONE or CANCELLED (True), or ``timeout_s`` passed (False): queued work, ``work``
        itself first, is run on this thread meanwhile."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._cond:
                while True:
                    if work.state in (WorkState.DONE, WorkState.CANCELLED):
                        return True
                    if self._queue:
                        taken = self._take(work)
                        # a lane computes now, or will take what is left queued as soon as it wakes
                        beside = self._lanes_computing > 0 or bool(self._queue and self._threads and not self._closed)
                        break
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(left)
            # (torch's process-wide default follows for the while: a thread started meanwhile takes it)
            narrow = beside and self.threads_each < torch.get_num_threads()
            with at_threads(self.threads_each) if narrow else nullcontext():
                self._run(taken, lane=False)

    def run_wide(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on this thread now, at all the threads the lanes share out (the lanes' and the sender's), even
        from a thread narrowed to fewer; this thread's own setting comes back after."""
        with at_threads(self.threads_each * (len(self._threads) + 1)):
            return fn()

    def cancel(self, work: Work) -> None:
        """Drop ``work`` if no one has started it; one running finishes and its result is not read."""
        with self._cond:
            if work.state is WorkState.QUEUED:
                self._queue.remove(work)
                work.state = WorkState.CANCELLED
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=5.0)

    def _take(self, preferred: Work | None = None, lane: bool = False) -> Work:
        """Under the lock: the preferred work if queued, else the oldest; marked RUNNING and counted."""
        if preferred is not None and preferred.state is WorkState.QUEUED:
            self._queue.remove(preferred)
            work = preferred
        else:
            work = self._queue.popleft()
        work.state = WorkState.RUNNING
        self._computing += 1
        self._lanes_computing += lane
        return work

    def _run(self, work: Work, lane: bool) -> None:
        try:
            work.value = work.fn()
        except BaseException as err:  # handed to whoever reads the result
            work.error = err
        finally:
            with self._cond:
                work.state = WorkState.DONE
                self._computing -= 1
                self._lanes_computing -= lane
                self._cond.notify_all()

    def _lane(self) -> None:
        torch.get_num_threads()  # torch's lazy per-thread set-up first, so it cannot undo the narrowing below
        torch.set_num_threads(self.threads_each)
        self._ready.wait()
        while True:
            with self._cond:
                while not self._closed and not (len(self._queue) > 1 or (self._queue and self._computing > 0)):
                    self._cond.wait()
                if self._closed:
                    return
                work = self._take(lane=True)
            self._run(work, lane=True)
