"""A router's live canary (``router.policy.canary``'s I/O shell): its state under one lock, the per-arm figures in
``/metrics``, and the automatic stop's log line. The RouterAdmin API and ``RequestRouter`` drive it; the output
processor feeds it each arm request's latency and each sample's agreement through the request's ``CanaryTicket``.

Metrics (labels ``arm``, ``policy``: the arm's policy name):
- ``expertmesh.canary.requests``: requests routed into the arm;
- ``expertmesh.canary.request_duration`` (s): submit to the last token, per arm;
- ``expertmesh.canary.sampled_tokens`` / ``expertmesh.canary.agreeing_tokens``: shadow recomputes, and those whose
  top-1 token agreed with exact routing; ``expertmesh.canary.agreement``: their ratio in the running canary;
- ``expertmesh.canary.state``: 1 for the canary's state (``state`` label), 0 for the others.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace

from opentelemetry.metrics import CallbackOptions, Observation

from expertmesh.infra.telemetry.setup import meter
from expertmesh.router.policy.canary import (
    ARMS,
    BASELINE,
    CANDIDATE,
    ArmTally,
    CanarySpec,
    CanaryState,
    arm_for,
    judge,
    sampled,
)
from expertmesh.router.policy.routing_policy import RoutingPolicy

__all__ = ["CANARY_KEY", "CanaryControl", "CanaryStatus", "CanaryTicket"]

log = logging.getLogger(__name__)

#: the gRPC metadata key and HTTP header of a request's canary key
CANARY_KEY = "x-expertmesh-canary-key"


@dataclass(frozen=True)
class CanaryStatus:
    """What ``expertmesh policy canary status`` shows: the canary (None: none started yet) and each arm's figures."""

    spec: CanarySpec | None = None
    baseline: RoutingPolicy | None = None
    state: CanaryState | None = None
    reason: str = ""
    tallies: dict[str, ArmTally] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class CanaryTicket:
    """A request's place in a canary: its arm, its arm's policy, which of its new tokens are samples, and the
    canary its figures go to."""

    arm: str
    policy: str
    sample_every: int
    control: "CanaryControl"
    #: the canary (its start count) the request was routed by: figures of an earlier one are dropped
    generation: int = 0

    def samples(self, index: int) -> bool:
        return sampled(index, self.sample_every)

    def finished(self, seconds: float) -> None:
        self.control._finished(self, seconds)

    def sample(self, agreed: bool) -> None:
        self.control._sampled(self, agreed)


class CanaryControl:
    """The canary of one router (see the module). Thread-safe."""

    def __init__(self, metrics_meter=None) -> None:
        self._lock = threading.Lock()
        self._status = CanaryStatus()
        self._generation = 0
        m = metrics_meter or meter()
        self._requests = m.create_counter("expertmesh.canary.requests", description="requests routed into a canary arm")
        self._duration = m.create_histogram(
            "expertmesh.canary.request_duration", unit="s", description="a canary arm's requests, submit to last token"
        )
        self._samples = m.create_counter(
            "expertmesh.canary.sampled_tokens", description="a canary arm's tokens computed again with exact routing"
        )
        self._agreeing = m.create_counter(
            "expertmesh.canary.agreeing_tokens",
            description="a canary arm's sampled tokens whose top-1 token agreed with exact routing",
        )
        m.create_observable_gauge(
            "expertmesh.canary.agreement",
            [self._observe_agreement],
            description="the running canary's agreeing / sampled tokens, per arm",
        )
        m.create_observable_gauge(
            "expertmesh.canary.state", [self._observe_state], description="1 for the canary's state, by state"
        )

    # -- the admin side ------------------------------------------------------------------------

    def status(self) -> CanaryStatus:
        with self._lock:
            return self._status

    def start(self, spec: CanarySpec, baseline: RoutingPolicy) -> CanaryStatus:
        """Start ``spec`` against ``baseline`` (the server's default now), in place of an ended canary; while one
        runs, nothing changes and its status is returned (its ``spec`` is not ``spec``)."""
        with self._lock:
            if self._status.state is CanaryState.RUNNING:
                return self._status
            self._generation += 1
            self._status = CanaryStatus(spec, baseline, CanaryState.RUNNING, "", {arm: ArmTally() for arm in ARMS})
            log.info("canary started: %s on %.1f%% of default-policy keys", spec.candidate.spec, spec.share * 100)
            return self._status

    def running(self) -> CanaryStatus | None:
        with self._lock:
            return self._status if self._status.state is CanaryState.RUNNING else None

    def end(self, state: CanaryState, reason: str) -> CanaryStatus | None:
        """End the running canary in ``state`` (PROMOTED or STOPPED); None when none runs."""
        with self._lock:
            if self._status.state is not CanaryState.RUNNING:
                return None
            self._status = replace(self._status, state=state, reason=reason)
            log.info("canary %s: %s", state.value, reason)
            return self._status

    # -- the request side ------------------------------------------------------------------------

    def assign(self, key: str, explicit: bool) -> tuple[RoutingPolicy | None, CanaryTicket | None]:
        """The default-policy request with canary ``key``: (the candidate when it is in that arm, else None: the
        default), and its ticket (None: no canary runs, or ``explicit``: it names its own policy)."""
        with self._lock:
            status = self._status
            arm = arm_for(key, status.spec.share, explicit) if status.state is CanaryState.RUNNING else None
            if arm is None:
                return None, None
            policy = status.spec.candidate if arm == CANDIDATE else status.baseline
            every = 0 if policy.is_exact else status.spec.sample_every  # exact agrees with itself: nothing to sample
            ticket = CanaryTicket(arm, policy.name, every, self, self._generation)
            self._add(ticket, requests=1)
        self._requests.add(1, {"arm": arm, "policy": policy.name})
        return (policy if arm == CANDIDATE else None), ticket

    def _finished(self, ticket: CanaryTicket, seconds: float) -> None:
        self._duration.record(seconds, {"arm": ticket.arm, "policy": ticket.policy})
        with self._lock:
            self._add(ticket, finished=1, seconds=seconds)

    def _sampled(self, ticket: CanaryTicket, agreed: bool) -> None:
        labels = {"arm": ticket.arm, "policy": ticket.policy}
        self._samples.add(1, labels)
        if agreed:
            self._agreeing.add(1, labels)
        with self._lock:
            tally = self._add(ticket, samples=1, agreeing=int(agreed))
            running = tally is not None and ticket.arm == CANDIDATE and self._status.state is CanaryState.RUNNING
            reason = judge(self._status.spec, tally) if running else None
            if reason:
                self._status = replace(self._status, state=CanaryState.AUTO_STOPPED, reason=reason)
        if reason:
            log.warning("canary auto-stopped: %s; requests take the server's default again", reason)

    def _add(self, ticket: CanaryTicket, **more: float) -> ArmTally | None:
        """(Under ``_lock``) ``more`` added to the figures of the ticket's arm when its canary is the current one
        (a request of an earlier one adds nothing); the new figures, or None."""
        if ticket.generation != self._generation:
            return None
        tally = self._status.tallies[ticket.arm]
        tally = replace(tally, **{name: getattr(tally, name) + value for name, value in more.items()})
        self._status = replace(self._status, tallies={**self._status.tallies, ticket.arm: tally})
        return tally

    # -- metrics ---------------------------------------------------------------------------------

    def _observe_agreement(self, options: CallbackOptions) -> list[Observation]:
        status = self.status()
        if status.state is not CanaryState.RUNNING:
            return []
        policies = {BASELINE: status.baseline.name, CANDIDATE: status.spec.candidate.name}
        return [
            Observation(t.agreement, {"arm": arm, "policy": policies[arm]})
            for arm, t in status.tallies.items()
            if t.agreement is not None
        ]

    def _observe_state(self, options: CallbackOptions) -> list[Observation]:
        state = self.status().state
        if state is None:
            return []
        return [Observation(float(s is state), {"state": s.value}) for s in CanaryState]
