"""A scenario's figures from what the clients saw: pure functions over ``traffic.Request``s,
token arrivals and the fault's ``Timeline``.

A request belongs to a scenario when its life [sent, ended] overlaps the scenario's span, from
the injection until the platform is whole again and at least the hold (requests in flight when
the fault struck count). Of its completed ones:

- with a corruption that a quarantine ends (``Timeline.quarantined``): a completion *sent*
  before the routers served the quarantine may have used the bad weights and counts in
  ``wrong_before_quarantine`` if it differs; one sent while the routers fell back around the
  expert (``Timeline.fallback_until``: its every replica was out of service) counts as
  ``degraded`` if it differs; one sent later must equal its reference (``wrong_outputs``);
- otherwise (no fault that corrupts, or a corruption never quarantined) every completion
  must equal its reference (``wrong_outputs``).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from expertmesh.bench.chaos.traffic import Request


@dataclass(frozen=True)
class Timeline:
    """What the fault driver saw, in time.monotonic() seconds; None: did not happen (in time)."""

    injected: float
    #: the fault taken away (SIGCONT, restart); equal to ``injected`` for a one-off fault
    lifted: float
    #: the platform whole again (the group answering, the store holding table and endpoints,
    #: the orchestrator serving, the corrupted replica healthy and listed again)
    recovered: float | None
    #: corruption: the health monitor's record of the replica leaves "healthy"
    detected: float | None = None
    #: corruption: the router serves without the replica (a table that drops it, or the fallback)
    quarantined: float | None = None
    #: corruption of an expert with no other replica: until when routers fell back around it
    fallback_until: float | None = None
    #: corruption: reloaded from the checkpoint and verified (probation)
    repaired: float | None = None
    #: one line on anything the numbers do not say
    note: str = ""
    #: what an operator sees of the fault, one line each (a refusal and its reason)
    evidence: tuple[str, ...] = ()
    #: requests the fault sent itself (``probes``), counted with the clients' against ``probe_reference``
    #: (indexed by their ``client``)
    probes: tuple[Request, ...] = ()
    probe_reference: tuple[tuple[int, ...], ...] = ()
    #: the longest ``/health/live`` took to answer during the fault, in s (None: not watched)
    health_live_max_s: float | None = None


@dataclass(frozen=True)
class Counts:
    sent: int
    completed: int
    failed: int
    wrong_outputs: int
    wrong_before_quarantine: int
    degraded: int
    #: "CODE: details" -> requests that failed so
    failures: dict[str, int]

    def __add__(self, other: "Counts") -> "Counts":
        return Counts(
            self.sent + other.sent,
            self.completed + other.completed,
            self.failed + other.failed,
            self.wrong_outputs + other.wrong_outputs,
            self.wrong_before_quarantine + other.wrong_before_quarantine,
            self.degraded + other.degraded,
            dict(Counter(self.failures) + Counter(other.failures)),
        )


def overlapping(requests: Sequence[Request], start: float, end: float) -> list[Request]:
    return [r for r in requests if r.sent <= end and r.ended >= start]


def count(requests: Sequence[Request], reference: Sequence[Sequence[int]], timeline: Timeline) -> Counts:
    """The scenario's counts; ``requests`` are its own (``overlapping``)."""
    done = [r for r in requests if r.ok]
    differing = [r for r in done if list(r.tokens) != list(reference[r.client])]
    before = after = fallback = 0
    for r in differing:
        if timeline.quarantined is not None and r.sent < timeline.quarantined:
            before += 1
        elif timeline.fallback_until is not None and r.sent < timeline.fallback_until:
            fallback += 1
        else:
            after += 1
    return Counts(
        sent=len(requests),
        completed=len(done),
        failed=len(requests) - len(done),
        wrong_outputs=after,
        wrong_before_quarantine=before,
        degraded=fallback,
        failures=dict(Counter(_short(r.error) for r in requests if not r.ok)),
    )


#: the router's per-request id in an error ("UNAVAILABLE: request 9c2f…: expert group …"): dropped, so
#: failures of one cause are counted together
_REQUEST_ID = re.compile(r"\brequest [0-9a-f]{8,}: ")


def _short(error: str) -> str:
    error = _REQUEST_ID.sub("", error, count=1)
    return error if len(error) <= 160 else error[:157] + "..."


def tokens_per_second(arrivals: Sequence[tuple[float, int]], start: float, end: float) -> float | None:
    """Streamed tokens per second in [start, end); None for an empty window."""
    if end <= start:
        return None
    return sum(n for t, n in arrivals if start <= t < end) / (end - start)


def itl_p99_ms(requests: Sequence[Request], start: float, end: float) -> float | None:
    """p99 of the gaps between a request's consecutive streamed chunks that ended in [start, end), in ms
    (the inter-token latency clients saw); None without any."""
    gaps = sorted(b - a for r in requests for a, b in zip(r.arrivals, r.arrivals[1:]) if start <= b < end)
    if not gaps:
        return None
    return 1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]


def longest_stall_s(requests: Sequence[Request], start: float, end: float) -> float | None:
    """The longest any client waited on its stream, of the waits that ended in [start, end) or were still going
    on at its end (counted up to the end: ``min(ended, end) - began``), in s: from a request's sending to its
    first streamed chunk, between consecutive chunks, and for a failed request from its last chunk (or its
    sending) to the error. A fault a replica covers should stall no stream; one that leaves some tokens nowhere
    to go should fail them fast, not hold them. None without any wait."""
    waits = [
        # a wait still going on at the window's end counts as long as it had lasted by then: a stream held
        # through the whole fault (no token, no error until after it) is its longest stall, not none
        min(b, end) - a
        for r in requests
        for points in [(r.sent, *r.arrivals, *((r.ended,) if not r.ok else ()))]
        for a, b in zip(points, points[1:])
        if start <= b and a < end
    ]
    return max(waits, default=None)


def unhosted(
    replicas: dict[tuple[int, int], Sequence[str]], moe_layers: Sequence[int], num_experts: int
) -> list[tuple[int, int]]:
    """The (layer, expert) pairs of the model that a routing table's ``replicas`` give no group:
    tokens routed to one of them have nowhere to go."""
    return [(layer, e) for layer in moe_layers for e in range(num_experts) if not replicas.get((layer, e))]
