"""The output processor: what a step's logits mean for each request of it. It chooses each next token (the
request's controls, grammar and sampler; the greedy requests together, in one pass), checks it with the
consistency guard, applies stops, reports log-probabilities, a Score request's scores and an echo's prompt
log-probabilities, and puts the request's events on its stream. It tells the scheduler what became of each chunk
(``scheduler.ChunkOutcome``); it never touches the KV cache or the model.

Per request it keeps an ``OutputState``: the text stream (detokenizing, stop strings), the grammar's matcher,
the seeded sampler (kept across a preemption: the samples go on where they were), the guard's count of tokens
computed again, the scores of the prompt so far, and its expert choices for the load window (recorded when it
finishes: relative positions, experts per token by query length).

A request whose own logits or sampling fail, fails alone (its error event); the others of its step keep their
tokens. A consistency-guard rollback discards the new token: the position that predicted it goes through the
next step again (``Request.widen``: with its MoE layers widened). A canary's sample (``serving.canary``) takes the
same way twice (a shadow recompute): the position with the stock gate, the two rows' top-1 tokens compared, then
with the arm's own policy again, so that its KV is the arm's; the token the arm chose is the one kept.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from expertmesh.contracts.errors import ExpertMeshError
from expertmesh.infra.telemetry.setup import meter
from expertmesh.router.dispatch import step_choices
from expertmesh.router.policy.routing_policy import STOCK
from expertmesh.router.reporting.routing_dynamics import RoutingDynamics
from expertmesh.serving.consistency_guard import Check, Scorers
from expertmesh.serving.events import (
    ErrorEvent,
    Failure,
    FinishEvent,
    PromptLogprobsEvent,
    ScoreEvent,
    TokenEvent,
    TokenLogprob,
)
from expertmesh.serving.grammar import TokenMatcher
from expertmesh.serving.model_runner import ModelRunnerOutput
from expertmesh.serving.request import Request, request_span
from expertmesh.serving.routing_trace import TokenRouting
from expertmesh.serving.sampling import controlled, greedy_tokens, make_generator, next_token, require_finite
from expertmesh.serving.scheduler import ChunkOutcome, ScheduledChunk, SchedulerOutput
from expertmesh.serving.text_stream import TextStream

__all__ = ["GuardStats", "OutputProcessor", "OutputState"]

log = logging.getLogger(__name__)


@dataclass
class OutputState:
    """The output processor's state of one request (see the module)."""

    stream: TextStream
    matcher: TokenMatcher | None = None
    generator: torch.Generator | None = None
    #: the consistency guard: tokens computed again so far, and the answer's text so far (scorers that read text)
    rollbacks: int = 0
    answer_text: str = ""
    prompt_text: str | None = None
    #: Score and an echo's prompt logprobs: what the prompt's chunks reported of their rows so far (never the rows
    #: themselves, but for a full distribution asked for): token scores, [rows, V] rows, log-probabilities
    scored: list[float] = field(default_factory=list)
    distribution: list[torch.Tensor] = field(default_factory=list)
    prompt_scores: list[TokenLogprob] = field(default_factory=list)
    #: its expert choices so far, one [L, n, K] array per step, from position ``routed_from`` on: kept only while
    #: it runs, for the load window's per-sequence statistics at its end (``LoadWindow.record_sequence``)
    routed: list[np.ndarray] = field(default_factory=list)
    routed_from: int = 0
    routed_layers: tuple[int, ...] = ()
    #: the routing of the forward that chose its next token (a routing trace's next entry)
    next_routing: tuple = ()
    #: a canary sample being computed again: the arm's logits row [V] that chose the token, the token, its routing
    #: (kept at the end), and whether the exact recompute was compared already (then the arm's own is under way)
    shadow: tuple[torch.Tensor, int, tuple, bool] | None = None


@dataclass
class GuardStats:
    """The consistency guard's totals since start (for benchmarks in this process)."""

    checks: int = 0
    rollbacks: int = 0


class OutputProcessor:
    def __init__(self, tokenizer, eos: set[int], max_context: int, load_window=None):
        """``load_window``: the router's (``LoadWindow``; None: none kept)."""
        self._tokenizer = tokenizer
        self._eos = eos
        self.max_context = max_context
        self._load_window = load_window
        self._dynamics = RoutingDynamics(load_window.num_experts) if load_window is not None else None
        self._scorers = Scorers()
        self.guard_stats = GuardStats()
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

    # -- a request's life --------------------------------------------------------------------

    def start(self, request: Request) -> None:
        """Its state, at submit."""
        params = request.params
        request.output = OutputState(
            TextStream(self._tokenizer, params.stop),
            matcher=params.grammar.matcher() if params.grammar is not None else None,
            generator=make_generator(params.sampling),
        )

    def preempted(self, request: Request) -> None:
        """It gave its blocks back: its whole past is computed again, with its own rules (a token the guard
        discarded is checked anew), and its prompt's scores and expert choices from position 0."""
        state: OutputState = request.output
        state.scored, state.distribution, state.prompt_scores = [], [], []
        state.routed, state.next_routing, state.shadow = [], (), None
        request.widen = 0

    def fail(self, request: Request, failure: Failure, message: str) -> None:
        """Its final event is an error; it adds nothing to the statistics."""
        state: OutputState | None = request.output
        if state is not None:
            state.routed, state.next_routing = [], ()
        request.events.put(ErrorEvent(failure, message))

    def fail_with(self, request: Request, err: Exception) -> None:
        """Fail ``request`` with ``err`` (our own errors name their status; anything else is INTERNAL)."""
        rid = request.request_id
        detail = str(err) if isinstance(err, ExpertMeshError) else f"{type(err).__name__}: {err}"
        self.fail(request, Failure.of(err), f"request {rid}: {detail}")

    # -- one step ------------------------------------------------------------------------------

    def process(self, plan: SchedulerOutput, step: ModelRunnerOutput) -> list[ChunkOutcome]:
        """Each chunk of ``plan`` went through the model (or failed, ``step.errors``): its request's next token,
        events and outcome. The greedy requests' next tokens are chosen together, in one pass."""
        self._keep_choices(plan, step)
        chunks, logits = plan.chunks, step.logits
        picks: list[int | None] = list(step.sampled) or [None] * len(chunks)  # the device's choices first
        greedy = [
            i
            for i, (chunk, rows) in enumerate(zip(chunks, logits))
            if rows is not None and picks[i] is None and i not in step.errors and self._greedy(chunk.request)
        ]
        for i, token in zip(greedy, greedy_tokens([logits[i][-1] for i in greedy]) or ()):
            picks[i] = token
        outcomes = []
        for i, (chunk, rows, token) in enumerate(zip(chunks, logits, picks)):
            if i in step.errors:
                self.fail_with(chunk.request, step.errors[i])
                outcomes.append(ChunkOutcome(computed=False, finished=True, failed=True))
                continue
            with self._failing_alone(chunk.request, outcomes):
                outcomes.append(self._advance(chunk, rows, token))
        return outcomes

    @staticmethod
    def _greedy(request: Request) -> bool:
        params, state = request.params, request.output
        return (
            not request.needs_prompt_rows
            and params.sampling.temperature == 0
            and not params.sampling.controls  # chosen one by one, from their controlled logits
            and state.matcher is None  # and from their grammar's mask
        )

    @contextmanager
    def _failing_alone(self, request: Request, outcomes: list[ChunkOutcome]) -> Iterator[None]:
        """A failure of one request's logits or sampling fails that request only: the others of its step keep
        their tokens, as if the failed one had never joined."""
        try:
            yield
        except Exception as err:
            if isinstance(err, ExpertMeshError):
                log.warning("request %s failed: %s", request.request_id, err)
            else:
                log.exception("request %s failed", request.request_id)
            self.fail_with(request, err)
            outcomes.append(ChunkOutcome(computed=True, finished=True, failed=True))

    def _advance(self, chunk: ScheduledChunk, logits: torch.Tensor | None, token: int | None) -> ChunkOutcome:
        """``chunk`` went through the model; ``logits`` [rows, V] are the rows it asked for (None: none, or its token
        was chosen already and nothing else reads them). ``token``: the next token when it was chosen already (on
        the device, or ``process``'s greedy pass)."""
        request, state = chunk.request, chunk.request.output
        params = request.params
        if logits is None and token is None:  # a prompt chunk with more prompt to come
            return ChunkOutcome(computed=True)
        if request.needs_prompt_rows:
            self._score_chunk(request, chunk, logits)
            if chunk.end < request.num_prompt_tokens:
                return ChunkOutcome(computed=True)
        if params.score is not None:
            distribution = torch.cat(state.distribution) if params.score.full_distribution else None
            self._record_sequence(request)
            request.events.put(ScoreEvent((0.0, *state.scored), distribution))
            return ChunkOutcome(computed=True, finished=True)
        if request.needs_prompt_rows:  # an echo's prompt logprobs: the prompt's first, then its first token as usual
            first = TokenLogprob(params.prompt_ids[0], None)
            request.events.put(PromptLogprobsEvent((first, *state.prompt_scores)))
            state.prompt_scores, request.prompt_logprobs_sent = [], True
        row = logits[-1] if logits is not None else None  # [V]
        if state.shadow is not None:  # a canary sample's recompute: exact's, compared, then the arm's own again
            arm_row, arm_token, arm_routing, compared = state.shadow
            if not compared:
                params.canary.sample(int(row.argmax()) == int(arm_row.argmax()))
                state.shadow = (arm_row, arm_token, arm_routing, True)
                self._recompute(request, 0)
                return ChunkOutcome(computed=True, rolled_back=True)
            state.shadow, state.next_routing = None, arm_routing
            return self._append(request, arm_row, arm_token)
        if token is None:
            token = self._choose(request, row)
        if request.widen:  # computed again after a rollback: kept as it is
            request.widen = 0
        elif params.consistency_guard is not None and self._rolls_back(request, row, token):
            return ChunkOutcome(computed=True, rolled_back=True)
        elif params.canary is not None and params.canary.samples(len(request.output_token_ids)):
            state.shadow = (row, token, state.next_routing, False)
            self._recompute(request, STOCK)
            return ChunkOutcome(computed=True, rolled_back=True)
        return self._append(request, row, token)

    def _append(self, request: Request, row: torch.Tensor | None, token: int) -> ChunkOutcome:
        """``token`` (chosen from ``row`` [V]; None when nothing but its choice read it) is the request's next: its
        events, and its end when it is one."""
        params, state = request.params, request.output
        request.output_token_ids.append(token)
        if state.matcher is not None:
            state.matcher.accept(token)
        count = len(request.output_token_ids)
        routing = (TokenRouting(token, count - 1, state.next_routing),) if params.routing_trace else ()
        state.next_routing = ()
        reason, unlisted, unlisted_routing = None, (), ()
        if (params.stop_at_eos and token in self._eos) or token in params.stop_token_ids:
            reason = "eos" if params.stop_at_eos and token in self._eos else "stop"
            unlisted, unlisted_routing = _logprobs(row, token, params.logprobs), routing
            delta = TokenEvent([], "")
        else:
            delta = TokenEvent([token], state.stream.push(token), _logprobs(row, token, params.logprobs), routing)
            if state.stream.stopped or (state.matcher is not None and state.matcher.finished):
                reason = "stop"
            elif count >= params.max_new_tokens:
                reason = "length"
            elif request.num_tokens >= self.max_context:
                reason = "context"
        if reason is not None:
            delta = TokenEvent(delta.token_ids, delta.text + state.stream.flush(), delta.logprobs, delta.routing)
        if delta.token_ids or delta.text:
            state.answer_text += delta.text if params.consistency_guard is not None else ""
            request.events.put(delta)
        if reason is None:
            return ChunkOutcome(computed=True)
        if params.canary is not None:
            params.canary.finished(time.monotonic() - request.arrival_time)
        self._record_sequence(request)
        request.events.put(FinishEvent(reason, request.num_prompt_tokens, count, unlisted, unlisted_routing))
        return ChunkOutcome(computed=True, finished=True)

    def _choose(self, request: Request, row: torch.Tensor) -> int:
        """The next token of ``request`` from its logits ``row`` [V]: its controls (``sampling.controlled``), then
        its grammar's mask, then its sampler."""
        params, state = request.params, request.output
        scores = row
        if params.sampling.controls:  # checks the model's logits are finite
            ends = {*params.stop_token_ids, *(self._eos if params.stop_at_eos else ())}
            scores = controlled(row, params.sampling, params.prompt_ids, request.output_token_ids, ends)
        if state.matcher is None:
            return next_token(scores, params.sampling, state.generator)
        if not params.sampling.controls:
            require_finite(scores)  # before the mask's -inf, which are on purpose
        return next_token(state.matcher.mask(scores), params.sampling, state.generator, masked=True)

    @staticmethod
    def _score_chunk(request: Request, chunk: ScheduledChunk, logits: torch.Tensor) -> None:
        """What a Score request or an echo's prompt logprobs report of a prompt chunk's rows ``logits`` [rows, V]
        (row i predicts prompt token ``chunk.start + i + 1``), kept in place of the rows: a long prompt must not
        hold [prompt_tokens, V] floats (gigabytes on a large vocabulary)."""
        params, state = request.params, request.output
        require_finite(logits)
        predicted = params.prompt_ids[chunk.start + 1 : chunk.start + 1 + logits.shape[0]]  # the last row: none
        rows = logits.float()
        if params.score is None or not params.score.raw_logits:
            rows = rows.log_softmax(-1)  # [rows, V]
        if params.score is not None:
            state.scored += rows[torch.arange(len(predicted)), torch.tensor(predicted, dtype=torch.long)].tolist()
            if params.score.full_distribution:
                state.distribution.append(rows)
            return
        state.prompt_scores += [_token_logprob(rows[i], t, params.prompt_logprobs) for i, t in enumerate(predicted)]

    def _rolls_back(self, request: Request, row: torch.Tensor, token: int) -> bool:
        """The consistency guard's check of ``request``'s new ``token`` (chosen from the model's logits ``row``
        [V]); True if it was discarded: the position that predicted it goes through the next step again, its MoE
        layers widened."""
        state, guard = request.output, request.params.consistency_guard
        if state.rollbacks >= guard.max_regenerations:
            return False
        scorer = self._scorers.get(guard.scorer)
        started = time.perf_counter()
        texts = ("", "", "")
        if scorer.needs_text and self._tokenizer is not None:
            if state.prompt_text is None:  # decoded once per request, not at every check
                state.prompt_text = self._tokenizer.decode(request.params.prompt_ids)
            texts = (state.prompt_text, state.answer_text, self._tokenizer.decode([token]))
        score = scorer.score(Check(row, token, *texts))
        labels = {"scorer": guard.scorer}
        self._guard_time.record((time.perf_counter() - started) * 1e3, labels)
        if score is None:
            return False
        self._guard_checks.add(1, labels)
        self.guard_stats.checks += 1
        if score >= guard.threshold:
            return False
        self._guard_rollbacks.add(1, labels)
        self.guard_stats.rollbacks += 1
        state.rollbacks += 1
        span = request_span(request)
        if span is not None:
            span.add_event(
                "expertmesh.consistency.rollback",
                {"token": token, "score": score, "position": request.num_tokens, "widen_to": guard.widen_to},
            )
        self._recompute(request, guard.widen_to)
        return True

    @staticmethod
    def _recompute(request: Request, widen: int) -> None:
        """The position that predicted ``request``'s discarded token goes through its next step again, its experts
        per token ``widen`` (``STOCK``: the stock gate)."""
        state = request.output
        if state.routed:  # the load window's record of that position: its recomputation replaces it
            state.routed[-1] = state.routed[-1][:, :-1]
        request.widen = widen

    # -- the expert choices ------------------------------------------------------------------------

    def _keep_choices(self, plan: SchedulerOutput, step: ModelRunnerOutput) -> None:
        """Each request's share of the step's choices: appended to its own (for the load window at its end), and
        the detail of the row that chose its next token (for its trace)."""
        per_forward = [c.experts() if c is not None and self._load_window is not None else [] for c in step.choices]
        for i, (chunk, (f, j)) in enumerate(zip(plan.chunks, step.forward_of)):
            choices = step.choices[f]
            if choices is None or i in step.errors:
                continue
            state = chunk.request.output
            if per_forward[f]:
                layers = choices.layers
                if not state.routed or state.routed_layers != layers:  # (the same MoE layers every step)
                    state.routed, state.routed_from, state.routed_layers = [], chunk.start, layers
                state.routed.append(per_forward[f][j])
            if choices.detail[j]:
                state.next_routing = choices.token_routing(j)

    def _record_sequence(self, request: Request) -> None:
        """At the end of ``request``: its choices into the load window (relative positions, experts per token by
        query length), then let them go."""
        state, window = request.output, self._load_window
        if window is not None and state.routed:
            experts = step_choices.concat_steps(state.routed, window.num_experts)  # [L, T, K]
            window.record_sequence(
                state.routed_layers, experts, state.routed_from, request.num_tokens, request.num_prompt_tokens
            )
            self._dynamics.record(state.routed_layers, experts, state.routed_from, request.num_tokens)
        state.routed = []


def _logprobs(row: torch.Tensor, token: int, top: int | None) -> tuple[TokenLogprob, ...]:
    """``token``'s log-probability under the model's logits ``row`` [V], with the ``top`` most likely (none when
    ``top`` is None)."""
    if top is None:
        return ()
    return (_token_logprob(row.float().log_softmax(-1), token, top),)


def _token_logprob(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s entry from the log-probabilities ``logprobs`` [V], with the ``top`` most likely (0: none)."""
    best = torch.topk(logprobs, min(top, logprobs.numel())) if top else None
    pairs = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
    return TokenLogprob(token, float(logprobs[token]), pairs)
