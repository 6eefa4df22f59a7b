"""Remote experts: each MoE layer's routed-experts call, sent to the expert groups that hold its experts
(``experts_impl`` registers the call with transformers).

Every MoE block of the router's model keeps its stock gate (and shared
experts); only the routed-experts call lands here. Dispatch has three parts:

1. ``routing_view.RoutingView``: the current routing-table version as tensors,
   validated (no expert left unhosted) and swapped in with one assignment;
2. ``layer_plan.plan_layer``: pure, which tokens with which masked expert ids
   and weights go to which group (replicated experts split by share);
3. ``transport.Transport``: carries one request to one group (shared memory for
   a group on this host, a gRPC stream otherwise; see ``router.transport``).

Above the transport sit replica choice, retries and checks: every call names the
router's checkpoint fingerprint, and a group started from another checkpoint
refuses it (FAILED_PRECONDITION), so its partial sums are never summed; every
response is checked (shape, dtype, finite values) before it is summed; a group
that fails, refuses or answers wrongly has its tokens re-planned onto other
replicas within the same step, and only when none exists does the step fail,
with UNAVAILABLE (the group failed or holds another checkpoint) or INTERNAL (it
answered wrongly), naming the group.

A group call that has not answered within its hedge delay, while its experts have
replicas on other groups, is hedged (``hedging``): its slots are re-planned onto
those replicas and sent, and whichever complete answer comes first, the group's or
the replicas', is summed, exactly once; the other is cancelled and never read. The
group's breaker then keeps it out at once (``CircuitBreakers.slow``). A call to a
group its breaker does not trust is started on a thread of its own
(``_Starting``): starting it may itself wait on a stopped group.

A group that went away (UNAVAILABLE), or whose address now answers with another
checkpoint, may be back at a new address with no new routing table (a Serve
replica restarted on another port, or on a node that returned): the groups'
addresses are looked up again in a thread of their own (``resolve_endpoints``),
never on the step, since the lookup may wait (Serve's directory answers once a
restarting replica serves) or fail with Ray's or the store's own error. The step
its circuit breaker next lets try the group reaches it there. A group that went
away holding experts no other replica has is resent its call for at most
``sole_group_wait_s`` (a blip, or a restart the lookup finds meanwhile), and at
once fails the step with UNAVAILABLE once its breaker is open: the step's
requests fail fast, within their deadline, and the engine goes on to other work.

The view comes from the dispatcher's ``table_watcher.TableWatcher``, which keeps
it current from the store off the step's critical path; a step takes it at its
boundary (``begin_step``, from a forward pre-hook on the whole model or from the
serving engine) and uses it for all its layers.

The serving engine runs each step as one packed forward of all its sequences,
inside ``step`` with the step's ``StepContext``: each MoE layer is then one
dispatch of every token of the step, carrying their positions (load statistics),
trace links to the step's other requests and the step's deadline. Each dispatch
also records its choice into the step's ``StepChoices``, sliced per sequence
there (with the weights applied and the group that served each slot when a
request asked for a routing trace), and its degraded tokens into the step's
``DegradedTokens``.
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Literal

import grpc
import numpy as np
import torch
from opentelemetry import trace
from opentelemetry.trace import Link, Status, StatusCode

from expertmesh.contracts.errors import (
    BadGroupResponse,
    DeadlineExceeded,
    ExpertMeshError,
    GroupUnavailable,
)
from expertmesh.contracts.load_window import LoadWindow
from expertmesh.infra.finite import all_finite
from expertmesh.infra.row_sums import add_rows
from expertmesh.infra.telemetry.setup import meter, tracer
from expertmesh.router.dispatch.circuit import BreakerState, CircuitBreakers
from expertmesh.router.dispatch.degraded import StockChoice
from expertmesh.router.dispatch.hedging import CallDurations, HedgePolicy
from expertmesh.router.dispatch.layer_plan import GroupCall, NoHealthyReplica, plan_layer, restrict_to, slot_groups
from expertmesh.router.dispatch.routing_view import RoutingView
from expertmesh.router.dispatch.step_context import StepContext
from expertmesh.router.dispatch.table_watcher import TableWatcher
from expertmesh.router.policy.gate_hook import GateBias
from expertmesh.router.reporting.hidden_sample import HiddenSampler
from expertmesh.router.reporting.wire_counters import TrafficCounters
from expertmesh.router.transport.base import GroupReply, GroupRequest, PendingCall, Transport, TransportError

log = logging.getLogger(__name__)

#: Serving an expert whose every replica is quarantined: ``next_best`` makes the gate pick the next-best
#: expert in its slot; ``renormalise`` drops the slot and scales the token's other experts up.
Fallback = Literal["next_best", "renormalise"]


@dataclass
class _InFlight:
    """One group call of a layer on its way."""

    call: GroupCall
    group: str
    request: GroupRequest
    pending: PendingCall | None  # None: the transport refused to start it
    error: TransportError | None
    span: trace.Span
    sent_at: float
    timeout_s: float
    received: int = 0  # response bytes


#: In a hedged call's race, the longest wait on the hedges before the slow group's own answer is looked at
#: again: the most that answer, should it come first after all, waits to be taken.
RACE_POLL_S = 0.005


class _Starting:
    """A call started on a thread of its own, for a group its breaker does not trust (a half-open trial, or
    a broken group tried for want of another): starting a call may itself wait on the group (a new
    shared-memory connection to a stopped process waits for its handshake; the auto transport may ask the
    group how to reach it), and the step's thread must stay free to hedge it. The transport bounds that wait
    by the call's deadline."""

    def __init__(self, start: Callable[[], PendingCall]):
        self.transport = ""  # the path's, once started
        self._started: concurrent.futures.Future = concurrent.futures.Future()
        self._lock = threading.Lock()
        self._cancelled = False
        threading.Thread(target=self._start, args=(start,), name="expertmesh-call-start", daemon=True).start()

    def _start(self, start: Callable[[], PendingCall]) -> None:
        try:
            pending = start()
        except BaseException as err:  # TransportError: result() raises it
            self._started.set_exception(err)
            return
        with self._lock:
            self.transport = pending.transport
            self._started.set_result(pending)
            cancelled = self._cancelled
        if cancelled:
            pending.cancel()

    def result(self) -> GroupReply:
        return self._started.result().result()

    def wait(self, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        try:
            pending = self._started.result(timeout=max(timeout_s, 0.0))
        except concurrent.futures.TimeoutError:
            return False
        except BaseException:
            return True  # it did not start: result() raises why at once
        return pending.wait(max(end - time.monotonic(), 0.0))

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True  # a call still starting is cancelled once it has
            started = self._started.done() and self._started.exception() is None
        if started:
            self._started.result().cancel()


class _Failure(enum.Enum):
    """How one group call failed: what the step may still do about it besides other replicas."""

    #: UNAVAILABLE: the group went away and may be back soon, maybe at a new address (a restarting replica):
    #: its address is looked up again, and with no other replica its call is resent for a moment
    GONE = "gone"
    #: FAILED_PRECONDITION: the process at its address holds another checkpoint: its address is looked up
    #: again (the group may have moved), and nothing is ever resent there
    FOREIGN = "foreign"
    #: anything else (a wrong answer, the deadline): no resend, no lookup
    FAILED = "failed"


class _GroupFailed(Exception):
    """One group call of a layer failed; ``error`` is what the step raises if no replica takes over."""

    def __init__(self, flight: _InFlight, error: ExpertMeshError, failure: _Failure):
        super().__init__(str(error))
        self.flight = flight
        self.error = error
        self.failure = failure


class LayerDispatcher:
    """Each MoE layer's tokens sent to the groups its ``TableWatcher``'s view names, and their partial sums
    added. Given at construction everything it uses: the view (``watcher``), the transport, the gate's bias
    and stock choice (quarantine fallback), the load window and the hidden-state sampler."""

    def __init__(
        self,
        watcher: TableWatcher,
        transport: Transport,
        *,
        timeout_s: float = 30.0,
        load_window: LoadWindow | None = None,
        resolve_endpoints: Callable[[], dict[str, str]] | None = None,
        sole_group_wait_s: float = 1.0,
        model_fingerprint: str = "",
        breakers: CircuitBreakers | None = None,
        fallback: Fallback = "next_best",
        gate_bias: GateBias | None = None,
        stock_choice: StockChoice | None = None,
        hidden_sampler: HiddenSampler | None = None,
        hedge: HedgePolicy | None = None,
    ):
        """``resolve_endpoints``: a fresh group -> address map when a group stops answering (None: what the
        watcher's store lists), called off the steps. ``sole_group_wait_s``: how long a step resends to a
        group that went away holding experts no other replica has, before it fails. ``model_fingerprint``:
        the router's checkpoint's, named in every call ("": groups do not check it). ``fallback``: how
        tokens of an expert whose every replica is
        quarantined are served (``Fallback``); ``gate_bias`` and ``stock_choice`` are the router model's
        (None: a bare dispatcher, tokens routed as given). ``hedge``: when slow calls are hedged onto other
        replicas (``hedging``; None: the defaults)."""
        self._watcher = watcher
        self._resolve_endpoints = resolve_endpoints or watcher.endpoints
        self._sole_wait = sole_group_wait_s
        self._model = model_fingerprint
        self.load_window = load_window
        #: keeps a sample of each layer's hidden states for the health monitor (None: off)
        self.hidden_sampler = hidden_sampler
        self._timeout = timeout_s
        self._transport = transport
        self.breakers = breakers or CircuitBreakers()
        self.fallback = fallback
        self._gate_bias = gate_bias
        self._stock_choice = stock_choice
        self._degraded = meter().create_counter(
            "expertmesh.tokens.degraded",
            description="tokens that chose an expert whose every replica is quarantined (served by the fallback)",
        )
        self._in_flight: Counter[str] = Counter()
        self._call_seconds = meter().create_histogram(
            "expertmesh.group.call.duration", unit="s", description="expert-group Dispatch round trip, by group"
        )
        #: each group's answered calls, by size class: their hedge delays
        self.call_durations = CallDurations(hedge or HedgePolicy())
        #: hedged calls so far, by (slow group, whose answer was summed: "group" or "replicas")
        self.hedged: Counter[tuple[str, str]] = Counter()
        self._hedged = meter().create_counter(
            "expertmesh.group.calls.hedged",
            description="group calls hedged onto other replicas, by the slow group and whose answer was summed "
            "(answered: group or replicas)",
        )
        #: the serving step whose forward runs now (``step``; None: a forward outside any step)
        self._step: StepContext | None = None
        self.traffic = TrafficCounters()
        #: the lookup of the groups' addresses running off the steps (``_look_up_later``), if any
        self._lookup: threading.Thread | None = None
        self._lookup_lock = threading.Lock()
        self._closed = False

    @property
    def watcher(self) -> TableWatcher:
        """The routing view's keeper this dispatcher was given."""
        return self._watcher

    @property
    def gate_bias(self) -> GateBias | None:
        """The router model's gate hooks (None: a bare dispatcher without the model)."""
        return self._gate_bias

    def routing_epoch(self) -> int:
        """The newest routing epoch the router knows of (``routing_view``): what a request admitted now is served in."""
        return self._watcher.epoch

    @contextmanager
    def step(self, context: StepContext) -> Iterator[StepContext]:
        """Within this block, the model's forward is one step of the serving engine, which has begun it
        (``begin_step``): every MoE layer dispatches with ``context`` (positions, links, routing, deadline, the
        collectors) on one routing view (``TableWatcher.step``), set into ``context.view`` here. One step at a
        time: the engine's thread is the model's only user while it serves. When the block ends without an error,
        the load window counts the step's choices (a failed step's tokens are routed again when it is retried)."""
        if self._step is not None:
            raise RuntimeError("a serving step is already running on this dispatcher")
        with self._watcher.step() as view:
            context.view, context.epoch = view, view.epoch if view is not None else None
            self._step = context
            try:
                if context.routing is not None and self._gate_bias is not None:
                    with self._gate_bias.routing(context.routing):
                        yield context
                else:
                    yield context
            finally:
                self._step = None
        self._count_load(context)

    def _count_load(self, context: StepContext) -> None:
        """The load window's counts of a step whose forward is done: its MoE layers' choices in one pass (layers
        of another token count, a forward the engine did not pack, one at a time)."""
        routed, context.routed = context.routed, []
        if self.load_window is None or not routed:
            return
        routing = context.routing
        domains = (routing.domain_ids, routing.domains) if routing is not None and routing.domains else None
        tokens = context.positions.shape[0]
        together = [(layer, index) for layer, index in routed if index.shape[0] == tokens]
        if together:
            width = max(index.shape[1] for _, index in together)  # a dynamic-k layer may take one more
            stacked = np.full((len(together), tokens, width), -1, dtype=np.int64)  # [L', T, K]; -1: empty
            for i, (_, index) in enumerate(together):
                stacked[i, :, : index.shape[1]] = index.numpy()
            self.load_window.record_layers(tuple(layer for layer, _ in together), stacked, context.positions, domains)
        for layer, index in routed:
            if index.shape[0] != tokens:
                self.load_window.record(layer, index)

    def on_forward(self) -> None:
        """Forward pre-hook: a new step, unless the serving engine already began this one."""
        if self._step is None:
            self.begin_step()

    def begin_step(self) -> None:
        """At a step boundary (the serving engine's): the watcher's view is made current for it."""
        self._watcher.begin_step()

    # -- one layer -------------------------------------------------------------------------

    def experts(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The experts call of one MoE layer, in the serving step running (``step``) when there is one."""
        with tracer().start_as_current_span("expertmesh.moe_layer", attributes={"expertmesh.layer": layer}):
            return self.dispatch(layer, hidden, top_k_index, top_k_weights, self._step)

    def dispatch(
        self,
        layer: int,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        step: StepContext | None = None,
    ) -> torch.Tensor:
        """hidden [T, H], top_k_index [T, K], top_k_weights [T, K] -> weighted expert sum [T, H].

        ``step``: the serving step the tokens belong to (positions and domains for the load statistics, the
        trace links, the deadline, the collectors; None: a forward outside any step). K may exceed the model's
        top-k by one (a dynamic-k policy); slots a policy left empty hold the skip sentinel.
        """
        started = time.perf_counter()
        view = (step.view if step is not None else None) or self._watcher.view  # the step's, whatever refresh does
        if view is None:
            self._watcher.refresh()
            view = self._watcher.view
        if layer not in view.primary:
            raise GroupUnavailable(f"the routing table has no groups for MoE layer {layer}")
        index = top_k_index.to("cpu", torch.long)  # [T, K]
        weights_cpu = top_k_weights.detach().to("cpu")  # [T, K]
        # [T, H] where the model computes: each transport takes its rows from there (CUDA IPC on the
        # router's GPU, a copy to host memory for the others)
        source = hidden.detach()
        links = step.span_links if step is not None else []
        if layer in view.fallback:
            weights_cpu = self._route_around(view, layer, index, weights_cpu, step)

        calls = self._plan(view, layer, index, weights_cpu)
        deadline = step.deadline if step is not None else None
        timeout = self._call_timeout(layer, deadline)
        flights = [self._send(view, layer, source, call, links, timeout) for call in calls]
        # While the groups compute, what needs none of their answers: off the step's critical path
        if self.load_window is not None:
            if step is not None:  # counted with the step's other layers when its forward is done
                step.routed.append((layer, index))
            else:
                self.load_window.record(layer, index)
        if self.hidden_sampler is not None:
            self.hidden_sampler.offer(layer, source.to("cpu"))
        choices = step.choices if step is not None else None
        detail = choices is not None and choices.wants_detail  # a sequence of this step asked for its routing trace
        if choices is not None and not detail:
            choices.record(layer, view.num_experts, index)
        out = torch.zeros_like(source)  # [T, H]
        failed: list[_GroupFailed] = []
        served: list[GroupCall] = []  # the calls whose partial sums were added
        hedges: list[_InFlight] = []
        for flight in flights:
            try:
                for call, partial in self._answered(view, layer, source, index.shape[0], flight, links, hedges):
                    _add_rows(out, call.tokens, partial)
                    served.append(call)
            except _GroupFailed as failure:
                failed.append(failure)
        flights += hedges
        if failed:
            flights += self._fail_over(view, layer, source, index.shape[0], failed, links, out, timeout, served)
        if detail:  # with the groups that served each slot
            groups = slot_groups(index.shape[0], index.shape[1], served)
            choices.record(layer, view.num_experts, index, weights_cpu, groups, view.groups)
        self.traffic.record(
            layer,
            calls=1,
            tokens=index.shape[0],
            group_calls=len(flights),
            token_group_pairs=sum(f.call.tokens.numel() for f in flights),
            bytes_sent=sum(f.request.nbytes for f in flights),
            bytes_received=sum(f.received for f in flights),
            seconds=time.perf_counter() - started,
        )
        group_tokens: Counter[str] = Counter()
        for f in flights:
            group_tokens[f.group] += f.call.tokens.numel()
        self.traffic.record_groups(layer, group_tokens)
        return out

    def _route_around(
        self, view: RoutingView, layer: int, index: torch.Tensor, weights: torch.Tensor, step: StepContext | None
    ) -> torch.Tensor:
        """Weights [T, K] for a layer with fallback experts, whose slots the plan drops.

        next_best: the gate already chose another expert in their place; a slot left on one (a
        sigmoid gate's weight-0 pick) adds nothing. renormalise: the token's other experts are scaled
        up to the weight it gave all its experts. Either way the tokens whose stock choice fell back are
        counted (``expertmesh.tokens.degraded``) and, in a serving step, marked on their sequences'
        spans (``router.degraded``).
        """
        fallback = torch.tensor(sorted(view.fallback[layer]))
        fell = torch.isin(index, fallback)  # [T, K]
        stock = (
            self._stock_choice.take(layer) if self._stock_choice is not None and self.fallback == "next_best" else None
        )
        if (
            stock is not None and stock.shape[0] == index.shape[0]
        ):  # the gate chose around them: who would have chosen one
            chosen, hit = stock, torch.isin(stock, fallback)  # [T, K]
        else:
            chosen, hit = index, fell & (weights != 0)
        tokens = int(hit.any(dim=1).sum())
        if tokens:
            self._degraded.add(tokens, {"layer": layer, "fallback": self.fallback})
            trace.get_current_span().set_attribute("expertmesh.degraded_tokens", tokens)
            if step is not None:
                step.degraded.record(layer, chosen, hit)
        if self.fallback != "renormalise":
            return weights
        kept = torch.where(fell, 0, weights)
        total, left = weights.sum(dim=1, keepdim=True), kept.sum(dim=1, keepdim=True)  # [T, 1]
        return torch.where(left != 0, kept * (total / left), kept)

    def _plan(self, view: RoutingView, layer: int, index: torch.Tensor, weights: torch.Tensor) -> list[GroupCall]:
        """The layer's calls, around groups whose breaker is open when their experts have other replicas."""
        in_flight = self._in_flight_by_index(view)
        avoided = self.breakers.avoided(view.groups)
        if avoided:
            try:
                return plan_layer(view, layer, index, weights, in_flight, frozenset(map(view.groups.index, avoided)))
            except NoHealthyReplica:
                pass  # a broken group is still better than none: try it
        return plan_layer(view, layer, index, weights, in_flight)

    def _call_timeout(self, layer: int, deadline: float | None) -> float:
        """The group calls' deadline: the configured one, or less when the step's requests expire sooner
        (``deadline``: time.monotonic() after which none wants its tokens; None: no deadline)."""
        if deadline is None:
            return self._timeout
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"every request of this step passed its deadline before MoE layer {layer}")
        return min(self._timeout, left)

    def _in_flight_by_index(self, view: RoutingView) -> list[int]:
        return [self._in_flight[g] for g in view.groups]

    def _send(
        self, view: RoutingView, layer: int, hidden: torch.Tensor, call: GroupCall, links: list[Link], timeout_s: float
    ) -> _InFlight:
        group = view.groups[call.group]
        # hidden [T, H]: the transport gathers the group's rows itself (into shared memory, where it can)
        request = GroupRequest(layer, view.version, hidden, call.tokens, call.expert_ids, call.weights, self._model)
        span = tracer().start_span(
            "expertmesh.group_call",
            links=links,
            attributes={
                "expertmesh.layer": layer,
                "expertmesh.group": group,
                "expertmesh.tokens": call.tokens.numel(),
                "expertmesh.bytes_sent": request.nbytes,
            },
        )
        if span.is_recording():
            span.set_attribute("expertmesh.experts_hit", torch.unique(call.expert_ids[call.expert_ids >= 0]).tolist())
        pending: PendingCall | None = None
        error = None
        if self.breakers.state(group) is not BreakerState.CLOSED:
            pending = _Starting(lambda: self._start(group, request, timeout_s, span))
        else:
            try:
                pending = self._start(group, request, timeout_s, span)
            except TransportError as err:
                error = err
        self._in_flight[group] += 1
        return _InFlight(call, group, request, pending, error, span, time.perf_counter(), timeout_s)

    def _start(self, group: str, request: GroupRequest, timeout_s: float, span: trace.Span) -> PendingCall:
        with trace.use_span(span, end_on_exit=False):  # the gRPC client span nests under it
            return self._transport.send(group, request, timeout_s)

    def _answered(
        self,
        view: RoutingView,
        layer: int,
        hidden: torch.Tensor,
        num_tokens: int,
        flight: _InFlight,
        links: list[Link],
        hedges: list[_InFlight],
    ) -> list[tuple[GroupCall, torch.Tensor]]:
        """The checked partial sums that answer ``flight``'s slots, as (call, [Tg, H]) pairs to add: its own;
        or, when it has not answered within its hedge delay and its experts have replicas elsewhere, those of
        whichever answers every slot first, the group or a hedge of its slots on those replicas (sent then and
        appended to ``hedges``). Raises _GroupFailed when the group failed and no hedge answered for it."""
        if self.call_durations.policy.enabled and flight.pending is not None and layer in view.replicated:
            delay = self.call_durations.delay(flight.group, flight.call.tokens.numel())
            if not flight.pending.wait(flight.sent_at + delay - time.perf_counter()):
                sent = self._hedge(view, layer, hidden, num_tokens, flight, links)
                if sent:
                    hedges += sent
                    return self._race(layer, hidden, flight, sent, delay)
        return [(flight.call, self._collect(layer, hidden, flight))]

    def _hedge(
        self, view: RoutingView, layer: int, hidden: torch.Tensor, num_tokens: int, flight: _InFlight, links: list[Link]
    ) -> list[_InFlight]:
        """``flight``'s slots sent to other replicas of their experts, on groups whose breakers are closed, else
        (some expert's other replicas are all on groups whose breakers are not: a fault before this one, not over
        yet for the breakers) on any other group holding them: such a group may be back already, and one that is
        not fails its hedge at once or never answers it, and the race then waits on the slow group as it would
        have. None when some expert of the call has no other replica at all (its call waits for the group) or the
        step's requests have expired."""
        slow = view.groups.index(flight.group)
        unsure = frozenset(i for i, g in enumerate(view.groups) if self.breakers.state(g) is not BreakerState.CLOSED)
        index, weights = restrict_to(flight.call, num_tokens, view.num_experts)
        in_flight = self._in_flight_by_index(view)
        timeout = flight.sent_at + flight.timeout_s - time.perf_counter()  # no later than the call it hedges
        if timeout <= 0:
            return []
        try:
            try:
                calls = plan_layer(view, layer, index, weights, in_flight, unsure | {slow})
            except NoHealthyReplica:
                calls = plan_layer(view, layer, index, weights, in_flight, frozenset({slow}))
        except NoHealthyReplica:
            return []
        return [self._send(view, layer, hidden, call, links, timeout) for call in calls]

    def _race(
        self, layer: int, hidden: torch.Tensor, flight: _InFlight, hedges: list[_InFlight], delay: float
    ) -> list[tuple[GroupCall, torch.Tensor]]:
        """The partial sums of whichever answers all of ``flight``'s slots first: the group, or every one of
        ``hedges``; the other side is cancelled and never summed. A group that lost is marked slow (its
        breaker opens). Raises the group's _GroupFailed when neither side answers."""
        group_failed: _GroupFailed | None = None
        while True:
            if group_failed is None and flight.pending.wait(0):
                try:
                    partial = self._collect(layer, hidden, flight)
                except _GroupFailed as failure:
                    group_failed = failure
                else:
                    for hedge in hedges:
                        self._abandon(hedge, "the hedged group answered first")
                    self._count_hedge(flight.group, "group")
                    return [(flight.call, partial)]
            # The hedges are due at their groups' usual pace: wait on them, glancing at the group in between
            # (once it has failed there is nothing else to wait for; every wait ends at its call's deadline).
            glance = RACE_POLL_S if group_failed is None else flight.timeout_s
            if all(h.pending is None or h.pending.wait(glance) for h in hedges):
                break
        answers, hedge_failed = [], False
        for hedge in hedges:
            try:
                answers.append((hedge.call, self._collect(layer, hidden, hedge)))
            except _GroupFailed as failure:
                hedge_failed = True
                log.warning("%s (a hedge of expert group %s's call)", failure.error, flight.group)
        if hedge_failed:  # never part of an answer: the group's slots are answered whole or not at all
            if group_failed is not None:
                raise group_failed
            return [(flight.call, self._collect(layer, hidden, flight))]
        if group_failed is not None:
            log.warning("%s; its hedge answered", group_failed.error)
            if group_failed.failure is not _Failure.FAILED:  # it may be back, or be, elsewhere
                self._look_up_later()
        else:
            self._abandon(flight, "its other replicas answered first")
            self.breakers.slow(flight.group)
            log.warning(
                "expert group %s did not answer layer %d within its %.3g s hedge delay; its %d tokens were answered "
                "by %s, and its calls go to other replicas for the breaker's cooldown",
                flight.group,
                layer,
                delay,
                flight.call.tokens.numel(),
                ", ".join(sorted({h.group for h in hedges})),
            )
        self._count_hedge(flight.group, "replicas")
        return answers

    def _count_hedge(self, group: str, answered: str) -> None:
        self.hedged[(group, answered)] += 1
        self._hedged.add(1, {"group": group, "answered": answered})

    def _abandon(self, flight: _InFlight, why: str) -> None:
        """A call whose slots another answer covered: cancelled, its answer never read."""
        if flight.pending is not None:
            flight.pending.cancel()
        self._in_flight[flight.group] -= 1
        flight.span.set_attribute("expertmesh.abandoned", why)
        flight.span.end()

    def _collect(self, layer: int, hidden: torch.Tensor, flight: _InFlight) -> torch.Tensor:
        """The checked [Tg, H] partial sums of one call; raises _GroupFailed."""
        group, span = flight.group, flight.span
        try:
            if flight.error is not None:
                raise flight.error
            reply = flight.pending.result()
            flight.received = reply.nbytes
            span.set_attribute("expertmesh.bytes_received", flight.received)
            partial = self._checked(layer, group, reply, flight.call.tokens.numel(), hidden)
            self.breakers.success(group)
            self.call_durations.record(group, flight.call.tokens.numel(), time.perf_counter() - flight.sent_at)
            return partial
        except TransportError as err:
            self.breakers.failure(group)
            span.set_status(Status(StatusCode.ERROR, err.code.name))
            failure = _Failure.FAILED
            if err.code == grpc.StatusCode.DEADLINE_EXCEEDED and flight.timeout_s < self._timeout:
                error: ExpertMeshError = DeadlineExceeded(
                    f"expert group {group} did not answer layer {layer} before the step's requests expired"
                )
            elif err.code == grpc.StatusCode.FAILED_PRECONDITION:  # the group's ForeignCheckpoint
                error = GroupUnavailable(
                    f"expert group {group} at {self._transport.address(group)} refused layer {layer}: {err.details}"
                )
                failure = _Failure.FOREIGN
            else:
                error = GroupUnavailable(
                    f"expert group {group} at {self._transport.address(group)} failed layer {layer}: {err}"
                )
                failure = _Failure.GONE if err.code == grpc.StatusCode.UNAVAILABLE else _Failure.FAILED
            raise _GroupFailed(flight, error, failure) from None
        except BadGroupResponse as err:
            self.breakers.failure(group)
            span.set_status(Status(StatusCode.ERROR, "bad response"))
            raise _GroupFailed(flight, err, _Failure.FAILED) from None
        finally:
            self._in_flight[group] -= 1
            span.end()
            transport = flight.pending.transport if flight.pending is not None else self._transport.kind(group)
            self._call_seconds.record(time.perf_counter() - flight.sent_at, {"group": group, "transport": transport})

    @staticmethod
    def _checked(layer: int, group: str, reply: GroupReply, rows: int, hidden: torch.Tensor) -> torch.Tensor:
        """Partial sums the router may add: [rows, H], the hidden states' dtype, finite. Else BadGroupResponse."""
        what = f"expert group {group} answered layer {layer} with"
        if reply.partial is None:
            raise BadGroupResponse(f"{what} an undecodable tensor: {reply.problem}")
        partial = reply.partial
        expected = (rows, hidden.shape[1])
        if tuple(partial.shape) != expected:
            raise BadGroupResponse(f"{what} partial sums of shape {list(partial.shape)}, expected {list(expected)}")
        if partial.dtype != hidden.dtype:
            raise BadGroupResponse(f"{what} {partial.dtype} partial sums, expected {hidden.dtype}")
        if not all_finite(partial):
            raise BadGroupResponse(f"{what} NaN/Inf in its partial sums; its experts may be corrupt")
        return partial

    def _fail_over(
        self,
        view: RoutingView,
        layer: int,
        hidden: torch.Tensor,
        num_tokens: int,
        failed: list[_GroupFailed],
        links: list[Link],
        out: torch.Tensor,
        timeout_s: float,
        served: list[GroupCall],
    ) -> list[_InFlight]:
        """Re-plan the failed calls' slots onto other replicas, within this step; adds into ``out``, and
        the calls that answered to ``served``.

        A call whose experts have no other replica is resent to the same group for a moment if it went
        away (``_resend``), else its error fails the step.
        """
        avoid = frozenset(view.groups.index(f.flight.group) for f in failed)
        flights = []
        for failure in failed:
            log.warning("%s; failing over", failure.error)
            if failure.failure is not _Failure.FAILED:  # it may be back, or be, elsewhere: look it up off the step
                self._look_up_later()
            index, weights = restrict_to(failure.flight.call, num_tokens, view.num_experts)
            try:
                calls = plan_layer(view, layer, index, weights, self._in_flight_by_index(view), avoid)
            except NoHealthyReplica:
                if failure.failure is not _Failure.GONE:
                    raise failure.error from None
                _add_rows(out, failure.flight.call.tokens, self._resend(layer, hidden, failure))
                served.append(failure.flight.call)
                continue
            retries = [self._send(view, layer, hidden, call, links, timeout_s) for call in calls]
            for flight in retries:
                try:
                    _add_rows(out, flight.call.tokens, self._collect(layer, hidden, flight))
                    served.append(flight.call)
                except _GroupFailed as second:
                    raise second.error from None
            flights += retries
        return flights

    def _resend(self, layer: int, hidden: torch.Tensor, failure: _GroupFailed) -> torch.Tensor:
        """[Tg, H] partial sums of a group that went away holding experts no other replica has: its call
        resent (Dispatch computes a pure function of the request) to whatever address the transport has for
        it, for at most ``sole_group_wait_s`` and the call's deadline: a blip, or a restarted replica whose
        address the lookup off the step finds meanwhile. None of it once the group's breaker is open (it has
        failed steps in a row): each step it fails then fails at once. Else GroupUnavailable, naming it.

        Its address is never looked up here: the lookup may wait (Serve's directory answers once a
        restarting replica serves) or fail with Ray's or the store's error, and every sequence of the step
        would wait with it, past their deadlines."""
        flight, group = failure.flight, failure.flight.group
        call_end = flight.sent_at + flight.timeout_s
        waiting = self._sole_wait if self.breakers.state(group) is BreakerState.CLOSED else 0.0
        give_up = min(call_end, time.perf_counter() + waiting)
        error, delay = failure.error, 0.05
        while (left := give_up - time.perf_counter()) > 0:
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.5)
            try:
                reply = self._transport.send(group, flight.request, max(call_end - time.perf_counter(), 0.001))
                partial = self._checked(layer, group, reply.result(), flight.call.tokens.numel(), hidden)
            except TransportError as err:
                error = GroupUnavailable(
                    f"expert group {group} at {self._transport.address(group)} failed layer {layer}: {err}"
                )
                if err.code != grpc.StatusCode.UNAVAILABLE:
                    raise error from None
                self._look_up_later()  # a lookup that found the old address is made again
                continue
            self.breakers.success(group)
            return partial
        why = f"it was not back within {waiting:g} s" if waiting else "it has failed steps in a row"
        raise GroupUnavailable(
            f"{error}; no other group holds the experts its tokens chose there, and {why} "
            "(its address is being looked up again): retry shortly"
        ) from None

    def _look_up_later(self) -> None:
        """The groups' addresses looked up again in a thread of its own, not the step's: the lookup may wait
        (Serve's directory answers once a restarting replica serves). One at a time; one that fails, or
        finds the group still at its old address, is made again at the group's next failed call (the trial
        its circuit breaker allows every cooldown)."""
        with self._lookup_lock:
            if self._closed or (self._lookup is not None and self._lookup.is_alive()):
                return
            self._lookup = threading.Thread(target=self._look_up, name="expertmesh-endpoint-lookup", daemon=True)
            self._lookup.start()

    def _look_up(self) -> None:
        try:
            fresh = self._resolve_endpoints()
        except Exception as err:  # Serve's directory timed out (the group is still away), the store is unreachable
            log.info("could not look the expert groups' addresses up again (again at the next failure): %s", err)
            return
        with self._lookup_lock:
            if not self._closed:
                self._use_endpoints(fresh)

    def _use_endpoints(self, fresh: dict[str, str]) -> None:
        """``fresh`` group addresses for the transport; a group of the view that it does not list keeps the
        address known (a flushed store lists groups again only as they re-register)."""
        view = self._watcher.view
        groups = {*(view.groups if view is not None else ()), *fresh}
        self._transport.update({g: a for g in groups if (a := fresh.get(g) or self._transport.address(g))})

    def transports(self) -> dict[str, str]:
        """What carries this router's calls to each group now ("" before its first call)."""
        view = self._watcher.view
        return {group: self._transport.kind(group) for group in (view.groups if view else ())}

    def queue_depths(self) -> dict[str, int]:
        """Dispatch calls in flight from this router, by group."""
        view = self._watcher.view
        return {group: self._in_flight[group] for group in (view.groups if view else ())}

    def close(self) -> None:
        with self._lookup_lock:  # a lookup still waiting (on Serve's directory, say) changes nothing after this
            self._closed = True
        self._transport.close()


def _add_rows(out: torch.Tensor, tokens: torch.Tensor, partial: torch.Tensor) -> None:
    """out[tokens] += partial. out [T, H] on the router's device; tokens [Tg] on the host; partial [Tg, H]
    where its transport left it (host memory, or the router's GPU over CUDA IPC)."""
    if tokens.device != out.device:
        tokens, partial = tokens.to(out.device), partial.to(out.device)
    add_rows(out, tokens, partial)
