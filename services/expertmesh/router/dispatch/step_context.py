"""One serving step as the router's dispatch sees it (vLLM's forward context): built by the serving engine's model
runner and handed explicitly to ``LayerDispatcher.step``, which every MoE layer of the step's forward then reads.
Nothing of a step lives in thread-locals: a forward outside any step (``verify``, ``bench dispatch``) has none.

Shapes: ``positions`` [T], each of the forward's T tokens' position in its own sequence; the collectors slice the
step's T tokens by sequence (``tokens_per_sequence``, in the order the step packs them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import torch
from opentelemetry.trace import Link, SpanContext

from expertmesh.router.dispatch.degraded import DegradedTokens
from expertmesh.router.dispatch.routing_view import RoutingView
from expertmesh.router.dispatch.step_choices import StepChoices
from expertmesh.router.policy.routing_policy import StepRouting

__all__ = ["StepContext"]


@dataclass
class StepContext:
    """What every MoE layer of one step dispatches with (see the module)."""

    #: [T] the position of each token of the step in its own sequence (the load statistics)
    positions: torch.Tensor
    #: the tokens each sequence of the step packs, in order
    tokens_per_sequence: Sequence[int]
    #: the trace contexts of the step's requests (a group call links to them)
    links: tuple[SpanContext, ...] = ()
    #: the tokens' routing policies and domains (None: the stock gate for every token)
    routing: StepRouting | None = None
    #: time.monotonic() after which no request of the step wants its tokens (None: no deadline)
    deadline: float | None = None
    #: which sequence's tokens a quarantine fallback served (``degraded``)
    degraded: DegradedTokens = field(init=False)
    #: the step's expert choices by sequence (None: nobody needs them: no load window, no routing trace)
    choices: StepChoices | None = None
    #: set by ``LayerDispatcher.step``: the routing view every layer of the step dispatches on, and the routing
    #: epoch it was built in (None: no view yet)
    view: RoutingView | None = None
    epoch: int | None = None
    #: each MoE layer's expert choices [T, K] as the step dispatched them, in order: the load window counts a
    #: step's layers together once its forward is done (``LayerDispatcher.step``), one pass instead of one a layer
    routed: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.degraded = DegradedTokens(self.tokens_per_sequence)

    @functools.cached_property
    def span_links(self) -> list[Link]:
        """The links each group call's span carries to the step's requests (their valid contexts): the same for every
        layer of the step, made once (a step of 64 sequences made 64 a layer)."""
        return [Link(c) for c in self.links if c.is_valid]
