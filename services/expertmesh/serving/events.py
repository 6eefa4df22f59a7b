"""What the engine tells a request's caller, in the order it happens: new tokens, the prompt's scores, its end
or its failure. Protocol-neutral: the gRPC and HTTP APIs map them to their messages, and a failure's ``Failure``
(the canonical status names) to their codes.

Example: a greedy request of 2 new tokens yields ``TokenEvent([17], "Hi")``, ``TokenEvent([5], "!")``,
``FinishEvent("length", prompt_tokens=3, completion_tokens=2)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Union

import torch

from expertmesh.serving.routing_trace import TokenRouting

__all__ = [
    "ErrorEvent",
    "Event",
    "FINAL_EVENTS",
    "Failure",
    "FinishEvent",
    "PromptLogprobsEvent",
    "ScoreEvent",
    "TokenEvent",
    "TokenLogprob",
]


class Failure(StrEnum):
    """Why a request ended without its whole answer: the canonical status names (gRPC's codes by name; the HTTP
    API's statuses by ``openai_errors``)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    CANCELLED = "CANCELLED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    NOT_FOUND = "NOT_FOUND"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"

    @classmethod
    def of(cls, err: Exception) -> "Failure":
        """The failure of an error: our own errors name their status (``ExpertMeshError.code``); anything else
        is INTERNAL."""
        name = getattr(getattr(err, "code", None), "name", "")
        return cls.__members__.get(name, cls.INTERNAL)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model (its logits' log-softmax, before any control or temperature:
    vLLM's default), and the most likely tokens', most likely first. None: a prompt's first token, which nothing
    predicts."""

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
    failure: Failure
    message: str


Event = Union[TokenEvent, FinishEvent, ScoreEvent, PromptLogprobsEvent, ErrorEvent]
#: the events that end a request's stream
FINAL_EVENTS = (FinishEvent, ScoreEvent, ErrorEvent)
