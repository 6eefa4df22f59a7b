"""Continuous batching over the router's model.

Glossary
- *sequence*: one request being served: its prompt, its KV cache, its sampler,
  the tokens generated so far and a queue of events for the caller.
- *step*: one forward pass for every active sequence at once: a chunk of its
  prompt for each sequence still reading one, one token for each of the rest
  (``serving.schedule``), side by side in a single packed forward
  (``serving.forward``). Each MoE layer therefore calls the experts function,
  and so dispatches to the expert groups, once per step with all their tokens,
  from the engine's one thread.
- *step boundary*: between steps. Queued sequences join, finished, cancelled
  and expired ones leave, and the routing table may switch version, only here.
- *routing*: each request's routing policy and query domain
  (``GenerationRequest.routing``) ride with its tokens through the packed
  forward (``routing_policy.StepRouting``, per token), so one step serves
  requests of different policies; a step of plain requests carries none and
  runs the stock gates untouched.

The step's attention (``serving.paged_attention``) lets each query see only
its own sequence's past, and every other layer works row by row, so a sequence's tokens are what they
would be if it were served alone: in float32 greedy output is token-identical
(checked on every architecture we verify); in bfloat16 a batch moves logits by
a rounding step at most, as batched expert dispatch always did, which can turn
an exact near-tie. Sampling is the engine's own, per sequence, with its own
seeded generator. A model the packed forward cannot take is served one forward
per sequence instead (``Batching``, reported by ListModels).

A step that fails (its forward raised: an expert group down, a deadline passed
in a dispatch) fails the requests that were in it, each with the error's gRPC
code; a request whose own logits or sampling fail fails alone. The engine goes
on with the next step either way.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Union

import grpc
import torch
from opentelemetry import context as otel_context
from opentelemetry import trace
from transformers import DynamicCache

from expertmesh.errors import ExpertMeshError, Overloaded, ShuttingDown
from expertmesh.router import degraded
from expertmesh.router.dispatch import ExpertDispatcher
from expertmesh.router.routing_policy import RequestRouting, step_routing
from expertmesh.serving.forward import Chunk, MaskSpec, Rows, forward_alone, forward_packed, pack
from expertmesh.serving.kv_cache import SequenceKV
from expertmesh.serving.sampling import SamplingParams, greedy_tokens, make_generator, next_token, require_finite
from expertmesh.serving.schedule import step_tokens
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
    #: its routing policy and domain (None: the stock gate, no domain)
    routing: RequestRouting | None = None


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
    #: its past: a SequenceKV under the packed step, a DynamicCache under the per-sequence one
    cache: SequenceKV | DynamicCache | None = None
    #: tokens of prompt + generated already in the cache (the position of the next one to feed)
    fed: int = 0
    #: Score: the prompt's logits so far, one [rows, V] tensor per chunk
    score_logits: list[torch.Tensor] = field(default_factory=list)
    generator: torch.Generator | None = None
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

    @property
    def pending(self) -> int:
        """Tokens not fed yet: the rest of the prompt, or the newest generated token."""
        return len(self.request.prompt_ids) + len(self.generated) - self.fed

    @property
    def decoding(self) -> bool:
        return self.fed >= len(self.request.prompt_ids)


def _request_span(seq: Sequence) -> trace.Span | None:
    """The span of ``seq``'s request (the parent of its step spans), when it is one in this process."""
    return trace.get_current_span(seq.trace_context) if seq.trace_context is not None else None


@dataclass(frozen=True)
class EngineLimits:
    max_active: int = 32
    max_queued: int = 128
    #: tokens one step feeds at most, decoding sequences' tokens first; prompts beyond it are chunked
    max_step_tokens: int = 512


@dataclass(frozen=True)
class Batching:
    """How the engine runs a step (reported by ListModels)."""

    packed: bool  # one forward for all sequences; else the per-sequence fallback
    note: str = ""  # why the fallback, when it is used


class Engine:
    def __init__(
        self,
        model,
        tokenizer,
        dispatcher: ExpertDispatcher,
        limits: EngineLimits,
        max_context: int,
        packed: bool = True,
    ):
        """``packed=False`` runs the per-sequence fallback even for a model the packed step can take."""
        self._model = model
        self._tokenizer = tokenizer
        self._dispatcher = dispatcher
        self.limits = limits
        self.max_context = max_context
        self._mask_spec = MaskSpec.of(model)
        unsupported = self._mask_spec.unsupported() if packed else "the packed step is switched off"
        self.batching = Batching(packed=unsupported is None, note=unsupported or "")
        if unsupported is not None:
            log.warning("%s serves one forward per sequence: %s", type(model).__name__, unsupported)
        eos = model.generation_config.eos_token_id
        self._eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self._cond = threading.Condition()
        self._queued: deque[Sequence] = deque()
        self._active: list[Sequence] = []
        self._accepting = True
        self._stopping = False
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
                    log.exception("step failed")
                    for seq in batch:
                        if not seq.done:
                            self._fail(seq, grpc.StatusCode.INTERNAL, f"step failed: {type(err).__name__}: {err}")
            with self._cond:
                self._retire_finished()
                self._cond.notify_all()

    def _admit(self, seq: Sequence) -> Sequence:
        seq.cache = SequenceKV() if self.batching.packed else DynamicCache(config=self._model.config)
        seq.generator = make_generator(seq.request.sampling)
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
        tokens = step_tokens([s.pending for s in batch], [s.decoding for s in batch], self.limits.max_step_tokens)
        work = [(seq, self._chunk(seq, n)) for seq, n in zip(batch, tokens) if n]
        if not work:
            return
        try:
            self._dispatcher.refresh()
        except ExpertMeshError as err:
            for seq, _ in work:
                self._fail(seq, err.code, str(err))
            return
        except ConnectionError as err:  # the state store is unreachable: the groups may be fine, retry next step
            for seq, _ in work:
                self._fail(seq, grpc.StatusCode.UNAVAILABLE, f"cannot read the routing table: {err}")
            return
        deadlines = [seq.request.deadline for seq, _ in work]
        # The group calls need not outlive the last request that still wants their answer.
        self._dispatcher.step_deadline = None if None in deadlines else max(deadlines)
        self.steps += 1  # before any of its tokens go out: whoever saw them sees the step counted
        if self.batching.packed:
            self._packed_step(work)
        else:
            for seq, chunk in work:
                with self._failing_alone(seq):
                    self._advance_step([(seq, chunk)], [self._forward_alone(seq, chunk, len(work))])

    def _chunk(self, seq: Sequence, n: int) -> Chunk:
        """Sequence ``seq``'s next ``n`` tokens, and which of their logits it needs."""
        tokens = (*seq.request.prompt_ids, *seq.generated)
        end = seq.fed + n
        rows = Rows.ALL if seq.request.score_only else Rows.LAST if end == len(tokens) else Rows.NONE
        return Chunk(seq.cache, tokens[seq.fed : end], seq.fed, rows)

    def _packed_step(self, work: list[tuple[Sequence, Chunk]]) -> None:
        """One forward for all of ``work``; if it fails, so do all of its requests (and no others)."""
        spans = [self._step_span(seq, chunk, len(work)) for seq, chunk in work]
        try:
            batch = pack([chunk for _, chunk in work], self._mask_spec)
            # The forward's spans nest under the first request's step; the other requests' steps are linked.
            links = [span.get_span_context() for span in spans[1:]]
            routing = step_routing([(seq.request.routing, len(chunk.token_ids)) for seq, chunk in work])
            with (
                trace.use_span(spans[0]),
                self._dispatcher.serving_step(batch.positions, links, routing),
                degraded.collecting([len(chunk.token_ids) for _, chunk in work]) as marks,
                torch.no_grad(),
            ):
                logits = forward_packed(self._model, batch)  # per sequence: [rows, V] or None
            marks.mark([(span, _request_span(seq)) for span, (seq, _) in zip(spans, work)])
        except Exception as err:
            log.log(
                logging.WARNING if isinstance(err, ExpertMeshError) else logging.ERROR,
                "step %d failed for its %d requests: %s", self.steps, len(work), err,
                exc_info=not isinstance(err, ExpertMeshError),
            )
            for seq, _ in work:
                self._fail_with(seq, err)
            return
        finally:
            for span in spans:
                span.end()
        self._advance_step(work, logits)

    def _forward_alone(self, seq: Sequence, chunk: Chunk, step_size: int) -> torch.Tensor | None:
        """The per-sequence fallback: this sequence's own forward."""
        span = self._step_span(seq, chunk, step_size)
        with (
            trace.use_span(span, end_on_exit=True),
            self._dispatcher.serving_step(
                chunk.positions(), routing=step_routing([(seq.request.routing, len(chunk.token_ids))])
            ),
            degraded.collecting([len(chunk.token_ids)]) as marks,
            torch.no_grad(),
        ):
            logits = forward_alone(self._model, chunk)
            marks.mark([(span, _request_span(seq))])
            return logits

    def _step_span(self, seq: Sequence, chunk: Chunk, step_size: int) -> trace.Span:
        """This sequence's share of the step, in its request's trace."""
        return tracer().start_span(
            "expertmesh.step",
            context=seq.trace_context,
            attributes={
                "expertmesh.step": self.steps,
                "expertmesh.tokens": len(chunk.token_ids),
                "expertmesh.batch": step_size,
            },
        )

    @contextmanager
    def _failing_alone(self, seq: Sequence) -> Iterator[None]:
        """A failure of one sequence's logits or sampling (or of its own forward, under the
        per-sequence fallback) fails that sequence only: the others of its step keep their tokens,
        as if the failed one had never joined."""
        try:
            yield
        except Exception as err:
            if isinstance(err, ExpertMeshError):
                log.warning("request %s failed: %s", seq.request.request_id, err)
            else:
                log.exception("request %s failed", seq.request.request_id)
            self._fail_with(seq, err)

    def _advance_step(self, work: list[tuple[Sequence, Chunk]], logits: list[torch.Tensor | None]) -> None:
        """Each of ``work``'s chunks went through the model; ``logits[i]`` [rows, V] (or None) are the rows
        chunk ``i`` asked for. The greedy sequences' next tokens are chosen together, in one pass."""
        greedy = [
            i
            for i, ((seq, _), rows) in enumerate(zip(work, logits))
            if rows is not None and not seq.request.score_only and seq.request.sampling.temperature == 0
        ]
        picks: list[int | None] = [None] * len(work)
        for i, token in zip(greedy, greedy_tokens([logits[i][-1] for i in greedy]) or ()):
            picks[i] = token
        for (seq, chunk), rows, token in zip(work, logits, picks):
            with self._failing_alone(seq):
                self._advance(seq, chunk, rows, token)

    def _advance(self, seq: Sequence, chunk: Chunk, logits: torch.Tensor | None, token: int | None = None) -> None:
        """``chunk`` went through the model; ``logits`` [rows, V] are the rows it asked for. ``token``: the
        next token when it was chosen already (``_advance_step``'s greedy pass)."""
        request = seq.request
        seq.fed += len(chunk.token_ids)
        if logits is None:  # a prompt chunk with more prompt to come
            return
        if request.score_only:
            seq.score_logits.append(logits)
            if seq.fed < len(request.prompt_ids):
                return
            scores = torch.cat(seq.score_logits)  # [prompt_tokens, V]
            require_finite(scores)
            seq.events.put(ScoreEvent(scores))
            seq.done = True
            return
        if token is None:
            token = next_token(logits[-1], request.sampling, seq.generator)
        seq.generated.append(token)
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

    def _fail_with(self, seq: Sequence, err: Exception) -> None:
        """Fail ``seq`` with ``err``'s gRPC code (INTERNAL for anything but our own errors)."""
        rid = seq.request.request_id
        if isinstance(err, ExpertMeshError):
            self._fail(seq, err.code, f"request {rid}: {err}")
        else:
            self._fail(seq, grpc.StatusCode.INTERNAL, f"request {rid}: {type(err).__name__}: {err}")

    def _fail(self, seq: Sequence, code: grpc.StatusCode, message: str) -> None:
        seq.events.put(ErrorEvent(code, message))
        seq.done = True
