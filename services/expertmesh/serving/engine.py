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
- *KV blocks* (``serving.kv_blocks``): under the packed step every sequence's
  past lives in blocks of one preallocated pool (``EngineLimits.kv_cache_bytes``).
  A queued sequence joins only when its whole prompt's blocks fit (taking them
  then, and first any cached blocks of its prompt's prefix); a decoding one takes
  one more block each ``kv_block_size`` tokens; finished, failed and cancelled
  ones give theirs back. On a model whose every layer is sliding-window, a
  sequence also gives back each block once every key its next tokens see lies
  past it.
- *preemption*: when a decoding sequence needs a block and none is free, the
  newest active sequence gives its blocks back and goes to the front of the
  queue with its prompt and generated tokens, to be computed again when it fits:
  its stream just pauses (the same tokens, its sampler's state kept).
- *routing*: each request's routing policy and query domain
  (``GenerationRequest.routing``) ride with its tokens through the packed
  forward (``routing_policy.StepRouting``, per token), so one step serves
  requests of different policies; a step of plain requests carries none and
  runs the stock gates untouched.
- *choices*: each MoE layer's expert choice of a step, sliced per sequence
  (``router.dispatch.step_choices``): a sequence keeps its own until it finishes,
  when they go to the load window (relative positions, experts per token by
  query length); a request that asked for its routing trace also gets, with each
  new token, the experts, weights and groups of the row that chose it. A step no
  one needs them for (no load window, no trace) collects nothing.

The step's attention (``serving.paged_attention``) lets each query see only
its own sequence's past, and every other layer works row by row, so a
sequence's tokens are what they would be if it were served alone: in float32 greedy output is token-identical
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
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Iterator, Union

import grpc
import numpy as np
import torch
from opentelemetry import context as otel_context
from opentelemetry import trace
from transformers import DynamicCache

from expertmesh.contracts.errors import ExpertMeshError, InvalidRequest, Overloaded, ShuttingDown
from expertmesh.infra.telemetry.setup import meter, tracer
from expertmesh.router.dispatch import degraded, step_choices
from expertmesh.router.dispatch.dispatcher import LayerDispatcher
from expertmesh.router.policy.routing_policy import RequestRouting, step_routing
from expertmesh.serving.consistency_guard import Check, GuardSpec, Scorers
from expertmesh.serving.forward import SLIDING, Chunk, MaskSpec, Rows, forward_alone, forward_packed, pack
from expertmesh.serving.grammar import CompiledGrammar, Grammars, TokenMatcher
from expertmesh.serving.kv_blocks import FREED, BlockPool, PoolExhausted, PrefixScope, blocks_for, prefix_hashes
from expertmesh.serving.kv_cache import KVPool, auto_cache_bytes, token_bytes
from expertmesh.serving.routing_trace import TokenRouting
from expertmesh.serving.sampling import (
    SamplingParams,
    controlled,
    greedy_tokens,
    make_generator,
    next_token,
    require_finite,
)
from expertmesh.serving.schedule import next_admission, step_tokens
from expertmesh.serving.step_tally import StepTally, step_kind
from expertmesh.serving.text_stream import TextStream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScoreSpec:
    """What a Score request reports of each prompt position: the next prompt token's log-probability (or, with
    ``raw_logits``, its logit), and with ``full_distribution`` the whole row (bounded by the request builder)."""

    raw_logits: bool = False
    full_distribution: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 16
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    stop_at_eos: bool = True
    #: token ids that end the sequence as its EOS does (not returned; vLLM's ``stop_token_ids``)
    stop_token_ids: tuple[int, ...] = ()
    #: time.monotonic() after which the request fails with DEADLINE_EXCEEDED
    deadline: float | None = None
    #: run the prompt only and report its scores (the Score API; None: generate)
    score: ScoreSpec | None = None
    #: its routing policy and domain (None: the stock gate, no domain)
    routing: RequestRouting | None = None
    #: report each new token's log-probability and the ``logprobs`` most likely tokens' (None: none)
    logprobs: int | None = None
    #: also report each prompt token's log-probability and this many most likely tokens' (None: none), from
    #: the same prefill (vLLM's ``prompt_logprobs``; an echo with logprobs)
    prompt_logprobs: int | None = None
    #: the grammar its output must follow (``Engine.grammars.compile``; None: free text)
    grammar: CompiledGrammar | None = None
    #: its consistency guard (``serving.consistency_guard``; None: unchecked)
    consistency_guard: GuardSpec | None = None
    #: report each new token's routing (``serving.routing_trace``); only such sequences pay for it
    routing_trace: bool = False
    #: shares prefix-cached KV blocks only with requests of the same salt (vLLM's ``cache_salt``; "": unsalted)
    cache_salt: str = ""
    #: who asked (the APIs' client key): sequence slots are shared fairly between clients
    client: str = ""

    @property
    def score_only(self) -> bool:
        return self.score is not None


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model (its logits' log-softmax, before any control or
    temperature: vLLM's default), and the most likely tokens', most likely first. None: a prompt's first
    token, which nothing predicts."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    token_ids: list[int]
    text: str
    #: one per token of ``token_ids`` when the request asked for them
    logprobs: tuple[TokenLogprob, ...] = ()
    #: one per token of ``token_ids`` when the request asked for its routing trace
    routing: tuple[TokenRouting, ...] = ()


@dataclass(frozen=True)
class FinishEvent:
    reason: str  # "length" | "stop" | "eos" | "context"
    prompt_tokens: int
    completion_tokens: int
    #: the log-probability of the token that ended the sequence when no TokenEvent carries it (EOS, a stop
    #: token id) and the request asked for them; counted in ``completion_tokens``, listed by OpenAI's logprobs
    final_logprobs: tuple[TokenLogprob, ...] = ()
    #: that token's routing, when the request asked for its routing trace
    final_routing: tuple[TokenRouting, ...] = ()


@dataclass(frozen=True)
class ScoreEvent:
    """A Score request's answer: for position i >= 1, log p(token_i | tokens_<i) (or the raw logit); 0.0 at
    position 0. ``distribution``: [prompt_tokens, vocab] float32 rows (log-probabilities, or the logits), when
    asked for (row i predicts token i + 1)."""

    token_scores: tuple[float, ...]
    distribution: torch.Tensor | None = None


@dataclass(frozen=True)
class PromptLogprobsEvent:
    """The prompt's tokens' log-probabilities (``GenerationRequest.prompt_logprobs``), before its first token."""

    logprobs: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class ErrorEvent:
    code: grpc.StatusCode
    message: str


Event = Union[TokenEvent, FinishEvent, ScoreEvent, PromptLogprobsEvent, ErrorEvent]
_FINAL = (FinishEvent, ScoreEvent, ErrorEvent)


@dataclass
class Sequence:
    request: GenerationRequest
    stream: TextStream
    events: "queue.Queue[Event]" = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    generated: list[int] = field(default_factory=list)
    #: its past under the per-sequence fallback (under the packed step: ``blocks``)
    cache: DynamicCache | None = None
    #: its block table in the packed step's KV pool, and how many of its first entries it gave back
    blocks: list[int] = field(default_factory=list)
    dropped: int = 0
    #: the prefix hash of each full block of its prompt, the routing epoch they were computed for, and how many
    #: of its blocks are in the prefix cache
    prefix: list[bytes] = field(default_factory=list)
    prefix_epoch: int | None = None
    published: int = 0
    #: its blocks may still be offered to the prefix cache: no step of it since it joined ran in another routing
    #: epoch than its prefix hashes name, or served one of its tokens by a quarantine fallback (degraded)
    cacheable: bool = True
    #: tokens of prompt + generated already in the cache (the position of the next one to feed)
    fed: int = 0
    #: Score and prompt_logprobs: what the prompt's chunks so far reported of their rows (never the rows
    #: themselves, but for a full distribution asked for): token scores, [rows, V] rows, log-probabilities
    scored: list[float] = field(default_factory=list)
    distribution: list[torch.Tensor] = field(default_factory=list)
    prompt_scores: list[TokenLogprob] = field(default_factory=list)
    #: its prompt's log-probabilities went out (prompt_logprobs): a preempted sequence computed again
    #: does not score it twice
    prompt_scored: bool = False
    generator: torch.Generator | None = None
    #: its place in its request's grammar (None: free text)
    matcher: TokenMatcher | None = None
    #: the consistency guard: experts its next step's tokens choose (0: its rules decide), the tokens it
    #: computed again so far, and the answer's text so far (for scorers that read text)
    widen: int = 0
    rollbacks: int = 0
    answer_text: str = ""
    prompt_text: str | None = None
    done: bool = False
    #: it ended with an error (its blocks may hold what a broken step computed: never cached)
    failed: bool = False
    #: the caller's trace context: this sequence's step spans belong to its request's trace
    trace_context: otel_context.Context | None = None
    #: time.monotonic() at submit, and whether it has joined the steps yet (its queue time ends then)
    submitted: float = field(default_factory=time.monotonic)
    joined: bool = False
    #: its expert choices so far, one [L, n, K] array per step, from position ``routed_from`` on: kept only
    #: while it is active, for the load window's per-sequence statistics at its end (``LoadWindow.record_sequence``)
    routed: list[np.ndarray] = field(default_factory=list)
    routed_from: int = 0
    routed_layers: tuple[int, ...] = ()
    #: the routing of the forward that chose its next token (a routing trace's next entry)
    next_routing: tuple = ()

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
        """Past its prompt and feeding one token a step (a preempted sequence computing its generated
        tokens again reads them like prompt)."""
        return self.fed >= len(self.request.prompt_ids) and self.pending <= 1

    def tokens(self) -> tuple[int, ...]:
        return (*self.request.prompt_ids, *self.generated)

    @property
    def scoring_prompt(self) -> bool:
        """It needs every prompt position's logits (Score, or prompt_logprobs not yet reported)."""
        request = self.request
        return request.score_only or (request.prompt_logprobs is not None and not self.prompt_scored)


def _request_span(seq: Sequence) -> trace.Span | None:
    """The span of ``seq``'s request (the parent of its step spans), when it is one in this process."""
    return trace.get_current_span(seq.trace_context) if seq.trace_context is not None else None


@dataclass(frozen=True)
class EngineLimits:
    max_active: int = 32
    max_queued: int = 128
    #: tokens one step feeds at most, decoding sequences' tokens first; prompts beyond it are chunked
    max_step_tokens: int = 512
    #: the KV pool's size (None: ``kv_cache.auto_cache_bytes``, at most what max_active sequences of the
    #: whole context need); the packed step only
    kv_cache_bytes: int | None = None
    #: token positions per KV block
    kv_block_size: int = 16
    #: share the KV blocks of equal prompt prefixes between requests
    prefix_caching: bool = True


@dataclass(frozen=True)
class KVUsage:
    """The KV pool at the latest step boundary (``Engine.kv_usage``)."""

    blocks_total: int
    blocks_used: int
    block_size: int
    #: allocated slots no token fills yet (the rest of each sequence's last block, reserved prompt) / allocated
    fragmentation: float
    blocks_used_peak: int = 0
    preemptions: int = 0
    #: prompt tokens looked up in the prefix cache, and those found there
    prefix_queries: int = 0
    prefix_hits: int = 0

    @property
    def usage(self) -> float:
        return self.blocks_used / self.blocks_total if self.blocks_total else 0.0


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
        dispatcher: LayerDispatcher,
        limits: EngineLimits,
        max_context: int,
        packed: bool = True,
        model_fingerprint: str = "",
    ):
        """``packed=False`` runs the per-sequence fallback even for a model the packed step can take.
        ``model_fingerprint``: the checkpoint's, part of every prefix-cache key (``kv_blocks.PrefixScope``)."""
        self._model = model
        self._model_fingerprint = model_fingerprint
        self._tokenizer = tokenizer
        self._dispatcher = dispatcher
        self.limits = limits
        self.max_context = max_context
        self._mask_spec = MaskSpec.of(model)
        unsupported = self._mask_spec.unsupported() if packed else "the packed step is switched off"
        self.batching = Batching(packed=unsupported is None, note=unsupported or "")
        if unsupported is not None:
            log.warning("%s serves one forward per sequence: %s", type(model).__name__, unsupported)
        self._blocks, self._pool = self._kv_pool(model, limits, max_context) if self.batching.packed else (None, None)
        #: tokens every layer sees, when every layer is sliding-window (blocks before them are given back)
        self._window = self._mask_spec.window if set(self._mask_spec.kinds) == {SLIDING} else None
        self._kv_counts = {"preemptions": 0, "prefix_queries": 0, "prefix_hits": 0, "peak": 0}
        eos = model.generation_config.eos_token_id
        self._eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self._vocab_size = model.config.get_text_config().vocab_size
        #: structured output's compiler and cache, for the APIs to compile a request's grammar with
        self.grammars = Grammars(tokenizer, self._vocab_size, self._eos)
        self._cond = threading.Condition()
        self._queued: deque[Sequence] = deque()
        self._active: list[Sequence] = []
        self._accepting = True
        self._stopping = False
        self._resets = [0, 0, 0]  # prefix-cache resets asked, done, and the prefixes the latest forgot
        self._thread = threading.Thread(target=self._loop, name="expertmesh-engine", daemon=True)
        self.steps = 0
        #: every step's kind, tokens and wall time: the step histograms, and totals for benchmarks in this process
        self.step_tally = StepTally()
        self._queue_time = meter().create_histogram(
            "expertmesh.request.queue_time",
            unit="s",
            description="submit to first joining a step (waiting for a slot or KV blocks)",
        )
        self._kv_usage: KVUsage | None = None
        self._note_kv()  # the empty pool, reported before the first step
        self._scorers = Scorers()
        self._guard_checks = meter().create_counter(
            "expertmesh.consistency.checks", description="new tokens the consistency guard scored, by scorer"
        )
        self._guard_rollbacks = meter().create_counter(
            "expertmesh.consistency.rollbacks",
            description="new tokens the consistency guard discarded and computed again widened, by scorer",
        )
        self._guard_time = meter().create_histogram(
            "expertmesh.consistency.scorer_time", unit="ms", description="time of one consistency check, by scorer"
        )
        self._guard_tally = [0, 0]  # checks, rollbacks: the metrics' totals, for benchmarks in this process

    @staticmethod
    def _kv_pool(model, limits: EngineLimits, max_context: int) -> tuple[BlockPool, KVPool]:
        size = limits.kv_block_size
        block_bytes = token_bytes(model.config.get_text_config(), model.dtype) * size
        if limits.kv_cache_bytes:
            num_blocks = limits.kv_cache_bytes // block_bytes
        else:  # no more than the count admission could ever fill
            num_blocks = min(
                auto_cache_bytes(model.device) // block_bytes, limits.max_active * blocks_for(max_context, size)
            )
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes {limits.kv_cache_bytes} holds no KV block: "
                f"one block of {size} tokens takes {block_bytes} bytes"
            )
        log.info("KV pool: %d blocks of %d tokens (%.1f MiB)", num_blocks, size, num_blocks * block_bytes / 2**20)
        return BlockPool(num_blocks), KVPool(num_blocks, size, model.device)

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
        """Queue ``request``, which the APIs' request builder (``serving.request_builder``) has checked against
        every bound; only what needs the engine's own state is checked here (the KV pool, the queue)."""
        self._check_fits(request)
        seq = Sequence(request, TextStream(self._tokenizer, request.stop), trace_context=otel_context.get_current())
        if request.grammar is not None:
            seq.matcher = request.grammar.matcher()
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

    def _end_ids(self, request: GenerationRequest) -> set[int]:
        """The token ids that end ``request``'s sequence."""
        return {*request.stop_token_ids, *(self._eos if request.stop_at_eos else ())}

    def _choose(self, seq: Sequence, row: torch.Tensor) -> int:
        """The next token of ``seq`` from its logits ``row`` [V]: its request's controls
        (``sampling.controlled``), then its grammar's mask, then its sampler."""
        request = seq.request
        scores = row
        if request.sampling.controls:  # checks the model's logits are finite
            scores = controlled(row, request.sampling, request.prompt_ids, seq.generated, self._end_ids(request))
        if seq.matcher is None:
            return next_token(scores, request.sampling, seq.generator)
        if not request.sampling.controls:
            require_finite(scores)  # before the mask's -inf, which are on purpose
        return next_token(seq.matcher.mask(scores), request.sampling, seq.generator, masked=True)

    def _check_fits(self, request: GenerationRequest) -> None:
        """A request the whole KV pool could not hold would wait for ever: refuse it now."""
        if self._blocks is None:
            return
        tokens = len(request.prompt_ids) + (0 if request.score_only else request.max_new_tokens)
        tokens = min(tokens, self.max_context)
        size = self._pool.block_size
        if blocks_for(tokens, size) > self._blocks.num_blocks:
            raise InvalidRequest(
                f"the prompt ({len(request.prompt_ids)} tokens) and its new tokens need {blocks_for(tokens, size)} "
                f"KV blocks of {size} tokens; the KV pool (kv_cache_bytes) holds {self._blocks.num_blocks} "
                f"({self._blocks.num_blocks * size} tokens)"
            )

    def kv_usage(self) -> KVUsage | None:
        """The KV pool's use at the latest step boundary (None under the per-sequence fallback, which has no pool)."""
        return self._kv_usage

    def guard_tally(self) -> tuple[int, int]:
        """(checks, rollbacks) of the consistency guard since the engine started."""
        return self._guard_tally[0], self._guard_tally[1]

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt prefix (vLLM's ``reset_prefix_cache``): later requests prefill their prompts
        again. Blocks that running sequences hold stay theirs. Done at the next step boundary; returns the
        prefixes forgotten (0 under the per-sequence fallback, which caches none)."""
        with self._cond:
            if not self._thread.is_alive():  # not started (or stopped): no step runs, nothing to wait for
                return self._blocks.reset_prefix_cache() if self._blocks is not None else 0
            self._resets[0] += 1
            asked = self._resets[0]
            self._cond.notify_all()
            while self._resets[1] < asked and not self._stopping:
                self._cond.wait()
            return self._resets[2]

    def load(self) -> tuple[int, int]:
        """(active, queued) sequences right now."""
        with self._cond:
            return len(self._active), len(self._queued)

    # -- the loop ----------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._queued or self._active or self._stopping or self._resets[0] > self._resets[1]):
                    self._cond.wait()
                if self._stopping:
                    self._cond.notify_all()  # a reset waiting for this loop waits no more
                    return
                if self._resets[0] > self._resets[1]:  # at a step boundary, on this thread: no step holds a block
                    self._resets[2] = self._blocks.reset_prefix_cache() if self._blocks is not None else 0
                    self._resets[1] = self._resets[0]
                    self._cond.notify_all()
                self._retire_finished()
                self._admit_fairly()
                self._slide()
                self._grow()
                self._note_kv()
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
                self._note_kv()
                self._cond.notify_all()

    def _admit_fairly(self) -> None:
        """Admit queued sequences while slots and blocks allow, fairly between clients (``next_admission``); the
        one chosen waits for blocks rather than being passed over, so a long prompt is never starved."""
        while len(self._active) < self.limits.max_active:
            pick = next_admission(
                [(s.request.client, s.joined) for s in self._queued], [s.request.client for s in self._active]
            )
            if pick is None or not self._admit(self._queued[pick]):
                return
            seq = self._queued[pick]
            del self._queued[pick]
            self._join(seq)

    def _admit(self, seq: Sequence) -> bool:
        """Give ``seq`` what it needs to join the step (under the packed step: the blocks of all its
        tokens so far, cached prefix blocks first); False if they do not fit now."""
        if seq.generator is None:  # kept across a preemption: the samples go on where they were
            seq.generator = make_generator(seq.request.sampling)
        if self._blocks is None:
            seq.cache = DynamicCache(config=self._model.config)
            return True
        size, tokens = self._pool.block_size, len(seq.request.prompt_ids) + len(seq.generated)
        routing = seq.request.routing
        # A routing policy other than exact changes the gates, hence every later layer's keys and values:
        # only stock-routed prompts share blocks.
        stock_routed = routing is None or routing.policy.is_exact
        epoch = self._dispatcher.routing_epoch()
        if self.limits.prefix_caching and stock_routed and seq.prefix_epoch != epoch:
            scope = PrefixScope(self._model_fingerprint, "exact", epoch, seq.request.cache_salt)
            seq.prefix, seq.prefix_epoch = prefix_hashes(seq.request.prompt_ids, size, scope.root()), epoch
        seq.cacheable = True  # its blocks are all computed (or matched) anew from here
        # Score wants every prompt position's logits, and at least one token must go through the model
        reusable = [] if seq.scoring_prompt else seq.prefix[: (tokens - 1) // size]
        shared = self._blocks.match(reusable)
        try:
            own = self._blocks.allocate(blocks_for(tokens, size) - len(shared))
        except PoolExhausted:
            self._blocks.release(shared)
            return False
        self._kv_counts["prefix_queries"] += len(reusable) * size
        self._kv_counts["prefix_hits"] += len(shared) * size
        seq.blocks, seq.fed, seq.published = shared + own, len(shared) * size, len(shared)
        return True

    def _join(self, seq: Sequence) -> None:
        self._active.append(seq)
        if not seq.joined:  # a preempted sequence joining again waited in no client's queue
            seq.joined = True
            self._queue_time.record(time.monotonic() - seq.submitted)

    def _slide(self) -> None:
        """Under a sliding window on every layer, give back the blocks wholly before the first key the
        next token of each sequence sees (position ``fed - window + 1``)."""
        if self._blocks is None or self._window is None:
            return
        size = self._pool.block_size
        for seq in self._active:
            drop = max(0, seq.fed - self._window + 1) // size
            if drop > seq.dropped:
                self._blocks.release(seq.blocks[seq.dropped : drop])
                seq.blocks[seq.dropped : drop] = [FREED] * (drop - seq.dropped)
                seq.dropped = drop

    def _grow(self) -> None:
        """Give each active sequence the block its next token needs, preempting the newest ones while
        none is free."""
        if self._blocks is None:
            return
        for seq in list(self._active):
            if seq not in self._active:  # preempted for an older one's block
                continue
            need = blocks_for(len(seq.request.prompt_ids) + len(seq.generated), self._pool.block_size) - len(seq.blocks)
            while need > self._blocks.available():
                victim = self._active[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                seq.blocks += self._blocks.allocate(max(need, 0))

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and queue it first, to compute its prompt and generated tokens again."""
        log.info(
            "request %s preempted after %d tokens: the KV pool is full", seq.request.request_id, len(seq.generated)
        )
        self._release(seq)
        seq.fed, seq.scored, seq.distribution, seq.prompt_scores = 0, [], [], []
        seq.widen = 0  # its whole past is computed again, with its own rules: the new token is checked anew
        seq.routed, seq.next_routing = [], ()  # computed again from position 0
        self._active.remove(seq)
        self._queued.appendleft(seq)
        self._kv_counts["preemptions"] += 1

    def _release(self, seq: Sequence) -> None:
        if self._blocks is not None:
            self._blocks.release(seq.blocks[seq.dropped :])
            seq.blocks, seq.published, seq.dropped = [], 0, 0

    def _publish(self, work: list[tuple[Sequence, Chunk]]) -> None:
        """Offer the prompt blocks this step filled to the prefix cache."""
        if self._blocks is None or not self.limits.prefix_caching:
            return
        for seq, _ in work:
            if seq.failed or not seq.cacheable:
                continue
            full = min(seq.fed, len(seq.request.prompt_ids)) // self._pool.block_size
            for j in range(max(seq.published, seq.dropped), min(full, len(seq.prefix))):
                self._blocks.publish(seq.blocks[j], seq.prefix[j])
            seq.published = max(seq.published, full)

    def _note_kv(self) -> None:
        """The pool's use at this boundary, for ``kv_usage`` (read by metrics on other threads)."""
        if self._blocks is None:
            return
        used, size = self._blocks.used(), self._pool.block_size
        allocated = sum(len(s.blocks) - s.dropped for s in self._active) * size
        unfilled = sum(len(s.blocks) * size - s.fed for s in self._active)  # given-back blocks were full
        counts = self._kv_counts
        counts["peak"] = max(counts["peak"], used)
        self._kv_usage = KVUsage(
            self._blocks.num_blocks,
            used,
            size,
            unfilled / allocated if allocated else 0.0,
            counts["peak"],
            counts["preemptions"],
            counts["prefix_queries"],
            counts["prefix_hits"],
        )

    def _retire_finished(self) -> None:
        """Fail the cancelled and expired sequences, active or queued (a queued one may wait for KV
        blocks a while), and let the finished ones go with their blocks."""
        now = time.monotonic()
        for seq in [*self._active, *self._queued]:
            if seq.done:
                continue
            if seq.cancelled.is_set():
                self._fail(seq, grpc.StatusCode.CANCELLED, "the client cancelled the request")
                log.info("request %s cancelled after %d tokens", seq.request.request_id, len(seq.generated))
            elif seq.request.deadline is not None and now >= seq.request.deadline:
                self._fail(seq, grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
        self._queued = deque(s for s in self._queued if not s.done)
        for seq in self._active:
            if seq.done:
                self._release(seq)
        self._active = [s for s in self._active if not s.done]

    def _step(self, batch: list[Sequence]) -> None:
        tokens = step_tokens([s.pending for s in batch], [s.decoding for s in batch], self.limits.max_step_tokens)
        work = [(seq, self._chunk(seq, n)) for seq, n in zip(batch, tokens) if n]
        if not work:
            return
        kind = step_kind([seq.decoding for seq, _ in work])
        started, counted = time.perf_counter(), self.steps
        try:
            self._run_step(work)
        finally:
            if self.steps > counted:  # it reached the model (not refused at the routing table)
                tokens = sum(len(chunk.token_ids) for _, chunk in work)
                self.step_tally.record(kind, tokens, time.perf_counter() - started)

    def _run_step(self, work: list[tuple[Sequence, Chunk]]) -> None:
        try:
            self._dispatcher.begin_step()
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
        tokens = seq.tokens()
        end = seq.fed + n
        rows = Rows.ALL if seq.scoring_prompt else Rows.LAST if end == len(tokens) else Rows.NONE
        return Chunk(seq.blocks if self._blocks is not None else seq.cache, tokens[seq.fed : end], seq.fed, rows)

    def _packed_step(self, work: list[tuple[Sequence, Chunk]]) -> None:
        """One forward for all of ``work``; if it fails, so do all of its requests (and no others)."""
        spans = [self._step_span(seq, chunk, len(work)) for seq, chunk in work]
        try:
            batch = pack([chunk for _, chunk in work], self._mask_spec, self._pool)
            # The forward's spans nest under the first request's step; the other requests' steps are linked.
            links = [span.get_span_context() for span in spans[1:]]
            routing = step_routing(
                [(seq.request.routing, len(chunk.token_ids)) for seq, chunk in work],
                [_first_t(seq, chunk) for seq, chunk in work],
                [seq.widen for seq, _ in work],
            )
            with (
                trace.use_span(spans[0]),
                self._dispatcher.serving_step(batch.positions, links, routing) as epoch,
                degraded.collecting([len(chunk.token_ids) for _, chunk in work]) as marks,
                self._collecting(work) as choices,
                torch.no_grad(),
            ):
                logits = forward_packed(self._model, batch)  # per sequence: [rows, V] or None
            marks.mark([(span, _request_span(seq)) for span, (seq, _) in zip(spans, work)])
            for i, (seq, _) in enumerate(work):
                # Keys and values computed around a quarantined expert, or in another epoch than the one its prefix
                # hashes name (the quarantines changed between its admission and this step), are never shared.
                if epoch is None or epoch != seq.prefix_epoch or i in marks.sequences:
                    seq.cacheable = False
            self._keep_choices(work, choices)
        except Exception as err:
            log.log(
                logging.WARNING if isinstance(err, ExpertMeshError) else logging.ERROR,
                "step %d failed for its %d requests: %s",
                self.steps,
                len(work),
                err,
                exc_info=not isinstance(err, ExpertMeshError),
            )
            for seq, _ in work:
                self._fail_with(seq, err)
            return
        finally:
            for span in spans:
                span.end()
        self._advance_step(work, logits)
        self._publish(work)

    def _forward_alone(self, seq: Sequence, chunk: Chunk, step_size: int) -> torch.Tensor | None:
        """The per-sequence fallback: this sequence's own forward."""
        span = self._step_span(seq, chunk, step_size)
        with (
            trace.use_span(span, end_on_exit=True),
            self._dispatcher.serving_step(
                chunk.positions(),
                routing=step_routing(
                    [(seq.request.routing, len(chunk.token_ids))], [_first_t(seq, chunk)], [seq.widen]
                ),
            ),
            degraded.collecting([len(chunk.token_ids)]) as marks,
            self._collecting([(seq, chunk)]) as choices,
            torch.no_grad(),
        ):
            logits = forward_alone(self._model, chunk)
            marks.mark([(span, _request_span(seq))])
            self._keep_choices([(seq, chunk)], choices)
            return logits

    def _load_window(self):
        """The dispatcher's load window (None: it keeps none, or a stand-in dispatcher)."""
        return getattr(self._dispatcher, "load_window", None)

    def _collecting(self, work: list[tuple[Sequence, Chunk]]):
        """The step's expert-choice collector (``step_choices``), or a null context when nobody needs one: a
        load window keeps every sequence's choices until it ends; a routing trace wants the weights and
        groups of the rows that choose a token."""
        detail = [seq.request.routing_trace and chunk.rows is Rows.LAST for seq, chunk in work]
        if self._load_window() is None and not any(detail):
            return nullcontext()
        return step_choices.collecting([len(chunk.token_ids) for _, chunk in work], detail)

    def _keep_choices(self, work: list[tuple[Sequence, Chunk]], choices: step_choices.StepChoices | None) -> None:
        """Each sequence's share of the step's choices: appended to its own (for the load window at its end),
        and the detail of the row that chose its next token (for its trace)."""
        if choices is None:
            return
        if self._load_window() is not None:
            layers = choices.layers
            for (seq, chunk), experts in zip(work, choices.experts()):
                if not seq.routed or seq.routed_layers != layers:  # (the same MoE layers every step)
                    seq.routed, seq.routed_from, seq.routed_layers = [], chunk.start, layers
                seq.routed.append(experts)
        for i, (seq, _) in enumerate(work):
            if choices.detail[i]:
                seq.next_routing = choices.token_routing(i)

    def _record_sequence(self, seq: Sequence) -> None:
        """At the end of ``seq``: its choices into the load window (relative positions, experts per token
        by query length), then let them go."""
        window = self._load_window()
        if window is not None and seq.routed:
            window.record_sequence(
                seq.routed_layers,
                step_choices.concat_steps(seq.routed, window.num_experts),  # [L, T, K]
                seq.routed_from,
                len(seq.request.prompt_ids) + len(seq.generated),
                len(seq.request.prompt_ids),
            )
        seq.routed = []

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
            if rows is not None
            and not seq.scoring_prompt
            and seq.request.sampling.temperature == 0
            and not seq.request.sampling.controls  # chosen one by one, from their controlled logits
            and seq.matcher is None  # and from their grammar's mask
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
        if seq.scoring_prompt:
            self._score_chunk(seq, chunk, logits)
            if seq.fed < len(request.prompt_ids):
                return
        if request.score is not None:
            distribution = torch.cat(seq.distribution) if request.score.full_distribution else None
            self._record_sequence(seq)
            seq.events.put(ScoreEvent((0.0, *seq.scored), distribution))
            seq.done = True
            return
        if seq.scoring_prompt:  # prompt_logprobs: the prompt's first, then its first token as usual
            first = TokenLogprob(request.prompt_ids[0], None)
            seq.events.put(PromptLogprobsEvent((first, *seq.prompt_scores)))
            seq.prompt_scores, seq.prompt_scored = [], True
        if token is None:
            token = self._choose(seq, logits[-1])
        if seq.widen:  # computed again after a rollback: kept as it is
            seq.widen = 0
        elif request.consistency_guard is not None and self._rolls_back(seq, logits[-1], token):
            return
        seq.generated.append(token)
        if seq.matcher is not None:
            seq.matcher.accept(token)
        routing = (TokenRouting(token, len(seq.generated) - 1, seq.next_routing),) if request.routing_trace else ()
        seq.next_routing = ()
        reason, unlisted, unlisted_routing = None, (), ()
        if request.stop_at_eos and token in self._eos:
            reason, unlisted, unlisted_routing = "eos", _logprobs(logits[-1], token, request.logprobs), routing
            delta = TokenEvent([], "")
        elif token in request.stop_token_ids:
            reason, unlisted, unlisted_routing = "stop", _logprobs(logits[-1], token, request.logprobs), routing
            delta = TokenEvent([], "")
        else:
            delta = TokenEvent([token], seq.stream.push(token), _logprobs(logits[-1], token, request.logprobs), routing)
            if seq.stream.stopped or (seq.matcher is not None and seq.matcher.finished):
                reason = "stop"
            elif len(seq.generated) >= request.max_new_tokens:
                reason = "length"
            elif len(request.prompt_ids) + len(seq.generated) >= self.max_context:
                reason = "context"
        if reason is not None:
            delta = TokenEvent(delta.token_ids, delta.text + seq.stream.flush(), delta.logprobs, delta.routing)
        if delta.token_ids or delta.text:
            seq.answer_text += delta.text if request.consistency_guard is not None else ""
            seq.events.put(delta)
        if reason is not None:
            self._record_sequence(seq)
            seq.events.put(FinishEvent(reason, len(request.prompt_ids), len(seq.generated), unlisted, unlisted_routing))
            seq.done = True

    @staticmethod
    def _score_chunk(seq: Sequence, chunk: Chunk, logits: torch.Tensor) -> None:
        """What a Score request or prompt_logprobs reports of a prompt chunk's rows ``logits`` [rows, V] (row i
        predicts prompt token ``chunk.start + i + 1``), kept in place of the rows: a long prompt must not hold
        [prompt_tokens, V] floats (gigabytes on a large vocabulary)."""
        request = seq.request
        require_finite(logits)
        predicted = request.prompt_ids[chunk.start + 1 : chunk.start + 1 + logits.shape[0]]  # the last row: none
        rows = logits.float()
        if request.score is None or not request.score.raw_logits:
            rows = rows.log_softmax(-1)  # [rows, V]
        if request.score is not None:
            seq.scored += rows[torch.arange(len(predicted)), torch.tensor(predicted, dtype=torch.long)].tolist()
            if request.score.full_distribution:
                seq.distribution.append(rows)
            return
        seq.prompt_scores += [_token_logprob(rows[i], t, request.prompt_logprobs) for i, t in enumerate(predicted)]

    def _rolls_back(self, seq: Sequence, row: torch.Tensor, token: int) -> bool:
        """The consistency guard's check of ``seq``'s new ``token`` (chosen from the model's logits ``row``
        [V]); True if it was discarded: then the position that predicted it goes through the next step again,
        its MoE layers widened."""
        guard = seq.request.consistency_guard
        if seq.rollbacks >= guard.max_regenerations:
            return False
        scorer = self._scorers.get(guard.scorer)
        started = time.perf_counter()
        texts = ("", "", "")
        if scorer.needs_text and self._tokenizer is not None:
            if seq.prompt_text is None:  # decoded once per sequence, not at every check
                seq.prompt_text = self._tokenizer.decode(seq.request.prompt_ids)
            texts = (seq.prompt_text, seq.answer_text, self._tokenizer.decode([token]))
        score = scorer.score(Check(row, token, *texts))
        labels = {"scorer": guard.scorer}
        self._guard_time.record((time.perf_counter() - started) * 1e3, labels)
        if score is None:
            return False
        self._guard_checks.add(1, labels)
        self._guard_tally[0] += 1
        if score >= guard.threshold:
            return False
        self._guard_rollbacks.add(1, labels)
        self._guard_tally[1] += 1
        seq.rollbacks += 1
        span = _request_span(seq)
        if span is not None:
            span.add_event(
                "expertmesh.consistency.rollback",
                {"token": token, "score": score, "position": len(seq.tokens()), "widen_to": guard.widen_to},
            )
        seq.fed -= 1  # the last token fed predicted it: computed again (its KV slots are written over)
        if seq.routed:  # the load window's record of that position: its recomputation replaces it
            seq.routed[-1] = seq.routed[-1][:, :-1]
        if seq.cache is not None:  # the per-sequence fallback's cache holds it: cut it off
            seq.cache.crop(seq.fed)
        seq.widen = guard.widen_to
        return True

    def _fail_with(self, seq: Sequence, err: Exception) -> None:
        """Fail ``seq`` with ``err``'s gRPC code (INTERNAL for anything but our own errors)."""
        rid = seq.request.request_id
        if isinstance(err, ExpertMeshError):
            self._fail(seq, err.code, f"request {rid}: {err}")
        else:
            self._fail(seq, grpc.StatusCode.INTERNAL, f"request {rid}: {type(err).__name__}: {err}")

    def _fail(self, seq: Sequence, code: grpc.StatusCode, message: str) -> None:
        seq.routed, seq.next_routing = [], ()  # a sequence that did not finish adds nothing to the statistics
        seq.events.put(ErrorEvent(code, message))
        seq.done = seq.failed = True


def _logprobs(row: torch.Tensor, token: int, top: int | None) -> tuple[TokenLogprob, ...]:
    """``token``'s log-probability under the model's logits ``row`` [V], with the ``top`` most likely (none
    when ``top`` is None)."""
    if top is None:
        return ()
    return (_token_logprob(row.float().log_softmax(-1), token, top),)


def _token_logprob(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s entry from the log-probabilities ``logprobs`` [V], with the ``top`` most likely (0: none)."""
    best = torch.topk(logprobs, min(top, logprobs.numel())) if top else None
    pairs = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
    return TokenLogprob(token, float(logprobs[token]), pairs)


def _first_t(seq: Sequence, chunk: Chunk) -> int:
    """The answer index of ``chunk``'s first token (the answer token it predicts; at most 0 in the
    prompt): what decay_k counts from. A preempted sequence computed again keeps its count."""
    return chunk.start + 1 - len(seq.request.prompt_ids)
