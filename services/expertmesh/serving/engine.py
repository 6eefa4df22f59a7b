"""Continuous batching over the router's model.

Glossary
- *sequence*: one request being served: its prompt, its KV cache, its sampler,
  the tokens generated so far and a queue of events for the caller.
- *step*: one forward pass of every active sequence (prefill for those just
  admitted, one token for the rest), with one expert dispatch per MoE layer
  carrying all their tokens (see ``router.step_gather``).
- *step boundary*: between steps. Queued sequences join, finished, cancelled
  and expired ones leave, and the routing table may switch version, only here.

Each sequence keeps its own ``DynamicCache`` and runs its own forward (in a
worker thread), so its attention is exactly what it would be alone; only the
MoE dispatch is shared. Greedy output is therefore the same as serving the
request by itself.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Union

import grpc
import torch
from opentelemetry import context as otel_context
from transformers import DynamicCache

from expertmesh.errors import ExpertMeshError, Overloaded, ShuttingDown
from expertmesh.router.dispatch import ExpertDispatcher
from expertmesh.router.step_gather import StepGather
from expertmesh.serving.sampling import SamplingParams, make_generator, next_token, require_finite
from expertmesh.serving.text_stream import TextStream
from expertmesh.telemetry.setup import tracer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 16
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    stop_at_eos: bool = True
    #: time.monotonic() after which the request fails with DEADLINE_EXCEEDED
    deadline: float | None = None
    #: run the prompt only and report its logits (the Score API)
    score_only: bool = False


@dataclass(frozen=True)
class TokenEvent:
    token_ids: list[int]
    text: str


@dataclass(frozen=True)
class FinishEvent:
    reason: str  # "length" | "stop" | "eos" | "context"
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class ScoreEvent:
    logits: torch.Tensor  # [prompt_tokens, vocab] float32


@dataclass(frozen=True)
class ErrorEvent:
    code: grpc.StatusCode
    message: str


Event = Union[TokenEvent, FinishEvent, ScoreEvent, ErrorEvent]
_FINAL = (FinishEvent, ScoreEvent, ErrorEvent)


@dataclass
class Sequence:
    request: GenerationRequest
    stream: TextStream
    events: "queue.Queue[Event]" = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    generated: list[int] = field(default_factory=list)
    cache: DynamicCache | None = None
    generator: torch.Generator | None = None
    next_input: list[int] = field(default_factory=list)
    done: bool = False
    #: the caller's trace context: this sequence's step spans belong to its request's trace
    trace_context: otel_context.Context | None = None

    def cancel(self) -> None:
        """Free this sequence at the next step boundary (the caller went away)."""
        self.cancelled.set()

    def __iter__(self) -> Iterator[Event]:
        """Events until the final one (FinishEvent, ScoreEvent or ErrorEvent)."""
        while True:
            event = self.events.get()
            yield event
            if isinstance(event, _FINAL):
                return


@dataclass(frozen=True)
class EngineLimits:
    max_active: int = 32
    max_queued: int = 128


class Engine:
    def __init__(self, model, tokenizer, dispatcher: ExpertDispatcher, limits: EngineLimits, max_context: int):
        self._model = model
        self._tokenizer = tokenizer
        self._dispatcher = dispatcher
        self.limits = limits
        self.max_context = max_context
        eos = model.generation_config.eos_token_id
        self._eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self._cond = threading.Condition()
        self._queued: deque[Sequence] = deque()
        self._active: list[Sequence] = []
        self._accepting = True
        self._stopping = False
        self._pool = ThreadPoolExecutor(max_workers=limits.max_active, thread_name_prefix="expertmesh-seq")
        self._thread = threading.Thread(target=self._loop, name="expertmesh-engine", daemon=True)
        self.steps = 0

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> "Engine":
        self._thread.start()
        return self

    def drain(self, timeout: float | None = None) -> bool:
        """Refuse new requests, let the in-flight ones finish. True if all did within ``timeout``."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._accepting = False
            while self._queued or self._active:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stop(self) -> None:
        with self._cond:
            self._accepting = False
            self._stopping = True
            for seq in [*self._queued, *self._active]:
                self._fail(seq, grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
            self._queued.clear()
            self._active.clear()
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()
        self._pool.shutdown(wait=True)

    # -- requests --------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> Sequence:
        seq = Sequence(request, TextStream(self._tokenizer, request.stop), trace_context=otel_context.get_current())
        with self._cond:
            if not self._accepting:
                raise ShuttingDown("the server is draining and takes no new requests")
            if len(self._active) + len(self._queued) >= self.limits.max_active + self.limits.max_queued:
                raise Overloaded(
                    f"the server is at its limits ({self.limits.max_active} active sequences, "
                    f"{self.limits.max_queued} queued); retry later"
                )
            self._queued.append(seq)
            self._cond.notify_all()
        return seq

    def load(self) -> tuple[int, int]:
        """(active, queued) sequences right now."""
        with self._cond:
            return len(self._active), len(self._queued)

    # -- the loop ----------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._queued or self._active or self._stopping):
                    self._cond.wait()
                if self._stopping:
                    return
                self._retire_finished()
                while self._queued and len(self._active) < self.limits.max_active:
                    self._active.append(self._admit(self._queued.popleft()))
                batch = list(self._active)
            if batch:
                try:
                    self._step(batch)
                except Exception as err:  # the loop must outlive any one step, or every later request hangs
                    log.exception("decode step failed")
                    for seq in batch:
                        if not seq.done:
                            self._fail(seq, grpc.StatusCode.INTERNAL, f"decode step failed: {type(err).__name__}: {err}")
            with self._cond:
                self._retire_finished()
                self._cond.notify_all()

    def _admit(self, seq: Sequence) -> Sequence:
        seq.cache = DynamicCache(config=self._model.config)
        seq.generator = make_generator(seq.request.sampling)
        seq.next_input = list(seq.request.prompt_ids)
        return seq

    def _retire_finished(self) -> None:
        now = time.monotonic()
        for seq in self._active:
            if seq.done:
                continue
            if seq.cancelled.is_set():
                self._fail(seq, grpc.StatusCode.CANCELLED, "the client cancelled the request")
                log.info("request %s cancelled after %d tokens", seq.request.request_id, len(seq.generated))
            elif seq.request.deadline is not None and now >= seq.request.deadline:
                self._fail(seq, grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
        self._active = [s for s in self._active if not s.done]

    def _step(self, batch: list[Sequence]) -> None:
        try:
            self._dispatcher.refresh()
        except ExpertMeshError as err:
            for seq in batch:
                self._fail(seq, err.code, str(err))
            return
        except ConnectionError as err:  # the state store is unreachable: the groups may be fine, retry next step
            for seq in batch:
                self._fail(seq, grpc.StatusCode.UNAVAILABLE, f"cannot read the routing table: {err}")
            return
        gather = StepGather(self._dispatcher.dispatch, len(batch))
        futures = [self._pool.submit(self._forward, seq, gather) for seq in batch]
        for seq, future in zip(batch, futures):
            with self._failing_alone(seq):
                self._advance(seq, future.result())  # logits [n, V]
        self.steps += 1

    @contextmanager
    def _failing_alone(self, seq: Sequence) -> Iterator[None]:
        """A failure of one sequence's forward or sampling fails that sequence only: the
        others of its step keep their tokens, as if the failed one had never joined."""
        rid = seq.request.request_id
        try:
            yield
        except ExpertMeshError as err:
            log.warning("request %s failed: %s", rid, err)
            self._fail(seq, err.code, f"request {rid}: {err}")
        except Exception as err:
            log.exception("request %s failed", rid)
            self._fail(seq, grpc.StatusCode.INTERNAL, f"request {rid}: {type(err).__name__}: {err}")

    def _forward(self, seq: Sequence, gather: StepGather) -> torch.Tensor:
        ids = torch.tensor([seq.next_input], dtype=torch.long)  # [1, n]
        start = seq.cache.get_seq_length()
        positions = torch.arange(start, start + ids.shape[1])  # [n]
        with (
            tracer().start_as_current_span(
                "expertmesh.step",
                context=seq.trace_context,
                attributes={"expertmesh.step": self.steps, "expertmesh.tokens": ids.shape[1], "expertmesh.batch": gather.size},
            ),
            self._dispatcher.gathering(gather, positions),
            torch.no_grad(),
        ):
            out = self._model(input_ids=ids, cache=seq.cache, use_cache=True)
        return out.logits[0].float()  # [n, V]

    def _advance(self, seq: Sequence, logits: torch.Tensor) -> None:
        request = seq.request
        if request.score_only:
            require_finite(logits)
            seq.events.put(ScoreEvent(logits))
            seq.done = True
            return
        token = next_token(logits[-1], request.sampling, seq.generator)
        seq.generated.append(token)
        seq.next_input = [token]
        reason = None
        if request.stop_at_eos and token in self._eos:
            reason = "eos"
            delta = TokenEvent([], "")
        else:
            delta = TokenEvent([token], seq.stream.push(token))
            if seq.stream.stopped:
                reason = "stop"
            elif len(seq.generated) >= request.max_new_tokens:
                reason = "length"
            elif len(request.prompt_ids) + len(seq.generated) >= self.max_context:
                reason = "context"
        if reason is not None:
            delta = TokenEvent(delta.token_ids, delta.text + seq.stream.flush())
        if delta.token_ids or delta.text:
            seq.events.put(delta)
        if reason is not None:
            seq.events.put(FinishEvent(reason, len(request.prompt_ids), len(seq.generated)))
            seq.done = True

    def _fail(self, seq: Sequence, code: grpc.StatusCode, message: str) -> None:
        seq.events.put(ErrorEvent(code, message))
        seq.done = True
