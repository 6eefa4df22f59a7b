"""A request as the engine serves it: what was asked (``GenerationRequest``, immutable, built by the APIs'
request builder) and how far it has got (``Request``: the scheduler's, the KV cache manager's and the output
processor's shared vocabulary, vLLM v1's names).

Glossary
- *computed tokens* (``Request.num_computed_tokens``): tokens of prompt + output whose keys and values are in
  the KV cache; the next step feeds the ones after them. A preempted request has none left.
- *tokens to compute* (``num_tokens_to_compute``): the rest of the prompt, or the newest output token.
- *decoding*: past its prompt, feeding one token a step (a preempted request computing its output tokens
  again reads them like prompt).
- *prompt rows* (``needs_prompt_rows``): a request that needs every prompt position's logits (Score, or an
  echo's prompt logprobs not yet sent) never reuses cached prompt blocks and asks the model for all its rows.

The request is also its caller's handle: ``events`` (iterated until the final one) and ``cancel``.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from opentelemetry import context as otel_context
from opentelemetry import trace

from expertmesh.router.policy.routing_policy import RequestRouting
from expertmesh.router.policy.token_rules import RoutingState
from expertmesh.serving.canary import CanaryTicket
from expertmesh.serving.consistency_guard import GuardSpec
from expertmesh.serving.events import FINAL_EVENTS, Event
from expertmesh.serving.grammar import CompiledGrammar
from expertmesh.serving.sampling import SamplingParams

if TYPE_CHECKING:  # the output processor's, opaque here
    from expertmesh.serving.output_processor import OutputState

__all__ = ["GenerationRequest", "Request", "RequestStatus", "ScoreSpec", "request_span"]


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
    #: report each new token's routing (``serving.routing_trace``); only such requests pay for it
    routing_trace: bool = False
    #: shares prefix-cached KV blocks only with requests of the same salt (vLLM's ``cache_salt``; "": unsalted)
    cache_salt: str = ""
    #: who asked (the APIs' client key): sequence slots are shared fairly between clients
    client: str = ""
    #: its arm of the running canary (``serving.canary``: latency, and its sampled tokens computed again with
    #: exact routing); None: in none
    canary: CanaryTicket | None = None

    @property
    def score_only(self) -> bool:
        return self.score is not None


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, never scheduled
    RUNNING = "running"
    PREEMPTED = "preempted"  # queued again, its blocks given back: computed again when it fits
    FINISHED = "finished"  # its final event went out (finish, score, or an error)

    @property
    def queued(self) -> bool:
        return self in (RequestStatus.WAITING, RequestStatus.PREEMPTED)


@dataclass(eq=False)
class Request:
    """One request being served (see the module's glossary)."""

    params: GenerationRequest
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    #: time.monotonic() at submit, and when it first joined a step (its queue time ends then)
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    #: its prompt's log-probabilities went out (an echo's): computed again after a preemption, not sent twice
    prompt_logprobs_sent: bool = False
    #: experts its next step's tokens choose (the consistency guard's widening after a rollback; 0: its rules')
    widen: int = 0
    #: its routing across steps (sticky's trace), read and written by each step through its StepRouting
    routing_state: RoutingState = field(default_factory=RoutingState)
    #: the output processor's state of it (its sampler, grammar, text, guard, scores so far)
    output: "OutputState | Any" = None
    #: the caller's trace context: this request's step spans belong to its trace
    trace_context: otel_context.Context | None = None
    events: "queue.Queue[Event]" = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def request_id(self) -> str:
        return self.params.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.params.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.params.prompt_ids) + len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def decoding(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens and self.num_tokens_to_compute <= 1

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def greedy_only(self) -> bool:
        """Its next token is its logits' argmax and nothing else reads them (no controls, grammar, log-probabilities,
        guard, canary sample or prompt rows): the model runner may choose it where the logits are (on the device)."""
        params = self.params
        return (
            params.sampling.temperature == 0
            and not params.sampling.controls
            and params.grammar is None
            and params.logprobs is None
            and params.consistency_guard is None
            and not (params.canary is not None and params.canary.samples(len(self.output_token_ids)))
            and not self.needs_prompt_rows
        )

    @property
    def needs_prompt_rows(self) -> bool:
        """It needs every prompt position's logits (Score, or an echo's prompt logprobs not yet sent)."""
        params = self.params
        return params.score is not None or (params.prompt_logprobs is not None and not self.prompt_logprobs_sent)

    def all_token_ids(self) -> tuple[int, ...]:
        return (*self.params.prompt_ids, *self.output_token_ids)

    # -- the caller's handle -------------------------------------------------------------------

    def cancel(self) -> None:
        """Free this request at the next step boundary (the caller went away)."""
        self.cancelled.set()

    def __iter__(self) -> Iterator[Event]:
        """Events until the final one (FinishEvent, ScoreEvent or ErrorEvent)."""
        while True:
            event = self.events.get()
            yield event
            if isinstance(event, FINAL_EVENTS):
                return


def request_span(request: Request) -> trace.Span | None:
    """The span of ``request``'s call (the parent of its step spans), when it is one in this process."""
    return trace.get_current_span(request.trace_context) if request.trace_context is not None else None
