"""The scheduler: which requests join the next step, with how many tokens, and which give their blocks back.
It touches no tensor and no model: it keeps the waiting and running queues, asks the KV cache manager whether a
request fits, and returns a plain plan (``SchedulerOutput``); after the step, ``update_from_output`` takes what
the step did (``ChunkOutcome`` per chunk) into the requests' computed tokens and the prefix cache.

One step boundary (``schedule``), in order:
1. cancelled and expired requests end (``SchedulerOutput.aborted``), finished ones left at the last update;
2. waiting requests are admitted while slots and blocks allow, fairly between clients (``schedule.next_admission``):
   the one chosen waits for blocks rather than being passed over, so a long prompt is never starved;
3. a sliding-window model's requests give back the blocks behind their window;
4. every running request gets the blocks its next tokens need, the newest ones preempted while none is free
   (``SchedulerOutput.preempted``: their blocks back, queued first, to be computed again);
5. the token budget is shared (``schedule.step_tokens``): a decoding request's one token, then prompt chunks.

Shape of the plan: ``chunks[i]`` = (request, its ``token_ids`` at positions ``start`` .., which logits it needs).
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from expertmesh.contracts.errors import Overloaded
from expertmesh.router.policy.token_rules import QueueSignal
from expertmesh.serving.events import Failure
from expertmesh.serving.kv_cache_manager import KVCacheManager
from expertmesh.serving.request import Request, RequestStatus
from expertmesh.serving.schedule import next_admission, step_tokens
from expertmesh.serving.step_tally import StepKind, step_kind

__all__ = ["ChunkOutcome", "Rows", "ScheduledChunk", "Scheduler", "SchedulerLimits", "SchedulerOutput"]

log = logging.getLogger(__name__)


class Rows(enum.Enum):
    """Which of a chunk's positions need logits."""

    NONE = "none"  # a prompt chunk with more prompt after it
    LAST = "last"  # the next token is chosen from the last position
    ALL = "all"  # Score, an echo's prompt logprobs: every prompt position


@dataclass(frozen=True)
class SchedulerLimits:
    max_active: int = 32
    max_queued: int = 128
    #: tokens one step feeds at most, decoding requests' tokens first; prompts beyond it are chunked
    max_step_tokens: int = 1024


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step: ``token_ids`` at positions ``start`` .. ``start + n - 1``."""

    request: Request
    token_ids: tuple[int, ...]
    start: int
    rows: Rows

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    #: decode (every chunk a decoding request's one token), prefill, or mixed: as scheduled
    kind: StepKind
    #: requests that gave their blocks back this boundary (to be computed again)
    preempted: list[Request] = field(default_factory=list)
    #: requests that ended at this boundary without their answer: (request, why, message)
    aborted: list[tuple[Request, Failure, str]] = field(default_factory=list)
    #: requests scheduled for the first time (their queue time ends now)
    first_scheduled: list[Request] = field(default_factory=list)
    #: the queue after admission: what adaptive_k narrows by
    queue: QueueSignal = QueueSignal()

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass(frozen=True)
class ChunkOutcome:
    """What a step did with one chunk (the output processor's word): ``computed``: the forward ran it (its tokens
    are in the cache); ``rolled_back``: its last token is to be computed again (the consistency guard);
    ``finished``: its request's final event went out; ``failed``: that event is an error (what its step computed
    may be broken: never cached)."""

    computed: bool
    rolled_back: bool = False
    finished: bool = False
    failed: bool = False


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        limits: SchedulerLimits,
        routing_epoch: Callable[[], int] = lambda: 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``routing_epoch``: the newest routing epoch the router knows (a request admitted now is served in it)."""
        self.kv = kv
        self.limits = limits
        self._routing_epoch = routing_epoch
        self._clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # -- requests --------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue ``request``; Overloaded past the slots and the queue."""
        limits = self.limits
        if len(self.running) + len(self.waiting) >= limits.max_active + limits.max_queued:
            raise Overloaded(
                f"the server is at its limits ({limits.max_active} active sequences, {limits.max_queued} queued); "
                "retry later"
            )
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def drop_all(self) -> list[Request]:
        """Every request still queued or running, let go of (the engine is stopping)."""
        dropped = [*self.waiting, *self.running]
        for request in self.running:
            self.kv.free(request)
        for request in dropped:
            request.status = RequestStatus.FINISHED
        self.waiting.clear()
        self.running.clear()
        return dropped

    # -- one boundary -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        aborted = self._abort_cancelled_and_expired()
        first = self._admit()
        for request in self.running:
            self.kv.slide(request)
        preempted = self._grow()
        tokens = step_tokens(
            [r.num_tokens_to_compute for r in self.running],
            [r.decoding for r in self.running],
            self.limits.max_step_tokens,
        )
        chunks = [self._chunk(r, n) for r, n in zip(self.running, tokens) if n]
        kind = step_kind([c.request.decoding for c in chunks])
        now = self._clock()
        queue = QueueSignal(len(self.waiting), max((now - r.arrival_time for r in self.waiting), default=0.0))
        return SchedulerOutput(chunks, kind, preempted, aborted, first, queue)

    def _abort_cancelled_and_expired(self) -> list[tuple[Request, Failure, str]]:
        now, out = self._clock(), []
        for request in [*self.running, *self.waiting]:
            if request.cancelled.is_set():
                out.append((request, Failure.CANCELLED, "the client cancelled the request"))
            elif request.params.deadline is not None and now >= request.params.deadline:
                out.append((request, Failure.DEADLINE_EXCEEDED, "the request's deadline passed"))
        for request, _, _ in out:
            self.finish(request)
        return out

    def _admit(self) -> list[Request]:
        first = []
        while len(self.running) < self.limits.max_active:
            pick = next_admission(
                [(r.params.client, r.status is RequestStatus.PREEMPTED) for r in self.waiting],
                [r.params.client for r in self.running],
            )
            if pick is None or not self.kv.admit(self.waiting[pick], self._routing_epoch()):
                break
            request = self.waiting[pick]
            del self.waiting[pick]
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = self._clock()
                first.append(request)
        return first

    def _grow(self) -> list[Request]:
        """Give each running request the blocks its next tokens need, preempting the newest while none is free."""
        preempted = []
        for request in list(self.running):
            if request not in self.running:  # preempted for an older one's block
                continue
            need = self.kv.blocks_needed(request)
            while need > self.kv.available():
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                if need:
                    self.kv.grow(request, need)
        return preempted

    def _preempt(self, request: Request) -> None:
        log.info(
            "request %s preempted after %d tokens: the KV pool is full",
            request.request_id,
            len(request.output_token_ids),
        )
        self.kv.free(request, preempted=True)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.running.remove(request)
        self.waiting.appendleft(request)

    def _chunk(self, request: Request, n: int) -> ScheduledChunk:
        tokens = request.all_token_ids()
        start = request.num_computed_tokens
        end = start + n
        rows = Rows.ALL if request.needs_prompt_rows else Rows.LAST if end == len(tokens) else Rows.NONE
        return ScheduledChunk(request, tokens[start:end], start, rows)

    # -- after the step -----------------------------------------------------------------------

    def update_from_output(
        self, output: SchedulerOutput, outcomes: list[ChunkOutcome], step_epoch: int | None, degraded: frozenset[int]
    ) -> None:
        """``outcomes[i]``: what the step did with ``output.chunks[i]``, in routing epoch ``step_epoch`` (None:
        unknown); ``degraded``: the chunks a quarantine fallback served tokens of."""
        for i, (chunk, outcome) in enumerate(zip(output.chunks, outcomes)):
            request = chunk.request
            if outcome.computed:
                request.num_computed_tokens = chunk.end
                if outcome.rolled_back:
                    request.num_computed_tokens -= 1
                    self.kv.rollback(request)
                if not outcome.failed:
                    self.kv.cache_computed(request, step_epoch, i in degraded)
            if outcome.finished:
                self.finish(request)

    def finish(self, request: Request) -> None:
        """``request`` is over (its final event went out): its blocks back, out of the queues."""
        if request.status is RequestStatus.RUNNING:
            self.kv.free(request)
            self.running.remove(request)
        elif request.status.queued:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
