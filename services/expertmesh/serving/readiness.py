"""Whether this router can serve a request right now: the body of ``GET /health``.

Ready means: not draining; the router's own weights match their fingerprints at load
(``router.weight_check``: the latest check, periodic or asked for with ``check_weights``;
a changed tensor is named in the reasons); the engine's warm-up is over (``serving.warmup``: the
report carries its state and seconds; a failed one is *degraded*, the router serves
cold); a routing table is in use; every expert of that
table has a replica whose group answers its ``grpc.health.v1`` check as
SERVING; and every group holds the experts the table lists on it (its
``Describe``): a table that lists an expert on a group that unloaded it is an
outage, every token routed there NOT_FOUND, however healthy the group.

*Degraded* is a separate signal (``HealthReport.degraded``, and the gauge
``expertmesh_router_degraded``): the router serves, but on less than it should.
The state store not answering is one: the router keeps serving its last good
routing table (the table watcher's), so it stays ready; a store outage must not
take every router out of its Service at once. A group that is down while its
experts are replicated elsewhere is another (dispatch routes around it).

No store I/O here: the store's state is the table watcher's (it polls the store
off every request's path), and the groups are probed at the addresses the
router dials. Groups are checked in parallel with a short deadline, and a
report is reused for ``cache_s``, so a burst of probes is not a burst of RPCs.
"""

from __future__ import annotations

import threading
import time
from typing import Literal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.metrics import CallbackOptions, Observation
from pydantic import BaseModel

from expertmesh.config.settings import TlsConfig
from expertmesh.infra.group_channels import group_channel
from expertmesh.infra.security import from_env
from expertmesh.infra.telemetry.setup import meter
from expertmesh.router.dispatch.table_watcher import TableWatcher
from expertmesh.router.weight_check import MIN_GAP_S, WeightCheck, WeightWatch
from expertmesh.serving.engine import Engine
from expertmesh.serving.warmup import WarmUpStatus
from expertmesh.v1 import experts_pb2, experts_pb2_grpc

GroupState = Literal["serving", "not_serving", "unreachable", "no_endpoint"]


class HealthReport(BaseModel):
    status: Literal["ready", "not_ready", "draining"]
    #: why the router is not ready (empty when it is)
    reasons: list[str]
    #: what it serves without while ready (the state store, a group whose experts have other replicas)
    degraded: list[str] = []
    routing_table_version: int | None
    groups: dict[str, GroupState]
    active_sequences: int
    queued_requests: int
    #: the KV pool's blocks held and in all (None under the per-sequence fallback, which has none)
    kv_blocks_used: int | None = None
    kv_blocks_total: int | None = None
    #: the engine's warm-up: pending, running, done, failed or off; and the seconds it took (None: not over, or off)
    warm_up: WarmUpStatus = "done"
    warm_up_seconds: float | None = None
    #: the router's own weights at the latest check: unchanged since load, changed (named), or not checked yet
    router_weights: Literal["unchanged", "changed", "not_checked"] = "not_checked"
    router_weights_changed: list[str] = []

    @property
    def ready(self) -> bool:
        return self.status == "ready"


class GroupProbe:
    """``grpc.health.v1`` Check of expert groups, over one channel per address (mutual TLS as configured)."""

    def __init__(self, tls: TlsConfig | None = None, timeout_s: float = 2.0):
        self._tls = tls if tls is not None else from_env(TlsConfig)
        self._timeout = timeout_s
        self._channels: dict[str, grpc.Channel] = {}
        #: group -> the (layer, expert) pairs its last Describe said it holds (absent: not known)
        self.held: dict[str, frozenset[tuple[int, int]]] = {}

    def states(self, groups: tuple[str, ...], endpoints: dict[str, str]) -> dict[str, GroupState]:
        for address in set(self._channels) - set(endpoints.values()):
            self._channels.pop(address).close()
        calls = {}
        for group in groups:
            address = endpoints.get(group)
            if address is None:
                continue
            if address not in self._channels:
                self._channels[address] = group_channel(address, self._tls)
            channel = self._channels[address]
            calls[group] = (
                health_pb2_grpc.HealthStub(channel).Check.future(
                    health_pb2.HealthCheckRequest(service=""), timeout=self._timeout
                ),
                experts_pb2_grpc.ExpertGroupStub(channel).Describe.future(
                    experts_pb2.DescribeRequest(), timeout=self._timeout
                ),
            )
        out: dict[str, GroupState] = {}
        self.held = {}
        for group in groups:
            if group not in calls:
                out[group] = "no_endpoint"
                continue
            check, describe = calls[group]
            try:
                serving = check.result().status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                out[group] = "unreachable"
                continue
            out[group] = "serving" if serving else "not_serving"
            try:
                self.held[group] = frozenset((e.layer, e.expert) for e in describe.result().experts)
            except grpc.RpcError:
                pass  # it answered its health check: what it holds is checked next time
        return out

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()


class Readiness:
    def __init__(
        self,
        watcher: TableWatcher,
        engine: Engine,
        probe: GroupProbe | None = None,
        cache_s: float = 1.0,
        weights: WeightWatch | None = None,
    ):
        """``watcher``: the router's table watcher (its view, whether the store answers its rounds, and the
        address the router dials for each group). ``weights``: the check of the router's own weights (None: not
        checked)."""
        self._weights = weights
        self._watcher = watcher
        self._engine = engine
        self._probe = probe or GroupProbe()
        self._cache_s = cache_s
        self._lock = threading.Lock()
        self._last: tuple[float, HealthReport] | None = None
        #: set when the router starts draining: it stops being ready at once
        self.draining = False
        meter().create_observable_gauge(
            "expertmesh.router.degraded",
            callbacks=[self._degraded_gauge],
            description="1 while the router serves degraded (its /health lists why: the state store, a group down)",
        )

    def report(self) -> HealthReport:
        with self._lock:  # one check at a time; the others reuse its answer
            if self._last is not None and time.monotonic() - self._last[0] < self._cache_s and not self.draining:
                return self._last[1]
            report = self._check()
            self._last = (time.monotonic(), report)
            return report

    def check_weights(self) -> WeightCheck | None:
        """Check the router's weights now (one finished within ``MIN_GAP_S`` answers instead); the next report
        says what it found. None: no weights to check."""
        if self._weights is None:
            return None
        check = self._weights.check(MIN_GAP_S)
        with self._lock:
            self._last = None
        return check

    def _check(self) -> HealthReport:
        active, queued = self._engine.load()
        kv = self._engine.kv_usage()
        view = self._watcher.view
        reasons: list[str] = []
        degraded: list[str] = []
        groups: dict[str, GroupState] = {}
        weights = self._weights.last if self._weights is not None else None
        if weights is not None and weights.changed:
            shown = ", ".join(weights.changed[:5]) + (
                f" and {len(weights.changed) - 5} more" if len(weights.changed) > 5 else ""
            )
            reasons.append(
                f"the router's weights changed since they were loaded ({shown}): its answers cannot be trusted; "
                "restart it"
            )
        warm = self._engine.warm_up_state
        if not warm.finished:
            reasons.append(f"the router is warming up ({warm.detail or 'not begun'})")
        elif warm.status == "failed":
            degraded.append(f"the warm-up failed ({warm.error}): the first requests run cold")
        problem = self._watcher.store_problem
        if problem is not None:
            what = f"the state store is unreachable: {problem}"
            (reasons if view is None else degraded).append(
                what if view is None else f"{what}; serving on routing table version {view.version}"
            )
        if view is None:
            reasons.append("no routing table in use yet")
        else:
            groups = self._probe.states(view.groups, self._watcher.addresses())
            reasons += _unservable(view.holders, view.groups, groups)
            reasons += _listed_but_not_held(view.holders, view.groups, self._probe.held)
            degraded += [
                f"expert group {g} is {state.replace('_', ' ')}" for g, state in groups.items() if state != "serving"
            ]
        status = "draining" if self.draining else "not_ready" if reasons else "ready"
        return HealthReport(
            status=status,
            reasons=(["the router is draining and takes no new requests"] if self.draining else []) + reasons,
            degraded=degraded,
            routing_table_version=None if view is None else view.version,
            groups=groups,
            active_sequences=active,
            queued_requests=queued,
            kv_blocks_used=None if kv is None else kv.blocks_used,
            kv_blocks_total=None if kv is None else kv.blocks_total,
            warm_up=warm.status,
            warm_up_seconds=warm.seconds,
            router_weights="not_checked" if weights is None else "changed" if weights.changed else "unchanged",
            router_weights_changed=list(weights.changed) if weights is not None else [],
        )

    def _degraded_gauge(self, _options: CallbackOptions) -> list[Observation]:
        """The store from the watcher's latest round; groups from the latest report (a probe asked for it)."""
        last = self._last
        degraded = self._watcher.store_problem is not None or (last is not None and bool(last[1].degraded))
        return [Observation(1 if degraded else 0)]

    def close(self) -> None:
        self._probe.close()


def _unservable(
    holders: dict[tuple[int, int], tuple[int, ...]], names: tuple[str, ...], states: dict[str, GroupState]
) -> list[str]:
    """One reason per group whose experts have no serving replica elsewhere. Experts with no
    replica at all are quarantined and served by the gate's fallback, so they do not count."""
    stranded: dict[str, int] = {}
    for replicas in holders.values():
        if replicas and not any(states.get(names[i]) == "serving" for i in replicas):
            for i in replicas:
                stranded[names[i]] = stranded.get(names[i], 0) + 1
    return [
        f"expert group {group} is {states[group].replace('_', ' ')} and {n} of its experts "
        "have no other serving replica"
        for group, n in sorted(stranded.items())
    ]


def _listed_but_not_held(
    holders: dict[tuple[int, int], tuple[int, ...]], names: tuple[str, ...], held: dict[str, frozenset[tuple[int, int]]]
) -> list[str]:
    """One reason per group the table lists for experts its Describe says it does not hold."""
    missing: dict[str, list[tuple[int, int]]] = {}
    for pair, replicas in sorted(holders.items()):
        for i in replicas:
            if names[i] in held and pair not in held[names[i]]:
                missing.setdefault(names[i], []).append(pair)
    return [
        f"expert group {group} does not hold {len(pairs)} of the experts the routing table lists on it "
        f"(layer/expert {', '.join(f'{layer}/{e}' for layer, e in pairs[:5])}{' ...' if len(pairs) > 5 else ''}): "
        "their tokens fail NOT_FOUND"
        for group, pairs in sorted(missing.items())
    ]
