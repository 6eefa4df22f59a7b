"""The faults of a host (``bench chaos --hosts``), each injected into a ``HostsPlatform`` and
returning a ``measure.Timeline`` as the faults of ``faults`` do: a group host's link down and
back (with another replica of its experts, and with one of its experts left without one), the
Redis host cut off, the orchestrator host cut off just after it started a live move, a group
host killed whole and started again.

``UnhostedWatch`` polls the routing table while a scenario runs: the promise under test is that
no (layer, expert) is ever left without a replica, whatever a host does.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc

from expertmesh.bench.chaos.faults import (
    RECOVERY_TIMEOUT_S,
    held,
    lifted_until_the_router_reports,
    replicas_hold_their_experts,
)
from expertmesh.bench.chaos.hosts_platform import HostsPlatform
from expertmesh.bench.chaos.measure import Timeline, unhosted
from expertmesh.bench.chaos.platform import wait_until
from expertmesh.contracts.errors import ExpertMeshError
from expertmesh.v1 import admin_pb2 as admin_pb

#: how often the watch reads the routing table
WATCH_POLL_S = 0.2


def _reachable(predicate):
    """``predicate`` as wait_until polls it, with an unreachable admin API too counted as false."""

    def polled() -> bool:
        try:
            return predicate()
        except (ExpertMeshError, grpc.RpcError):
            return False

    return polled


def _link(platform: HostsPlatform, host: str, up: bool) -> Callable[[], None]:
    """Takes ``host``'s link up or down when called."""
    return lambda: platform.hosts.link(host, up=up)


class _GroupBack:
    """Polled: the group answers, is registered, and routers stream calls to it again over TCP (its
    "grpc-stream" calls grew since the first answer after the fault was lifted; a restarted group
    starts from 0). Streams, not unary calls: the health monitor's probes are unary, and a router
    whose stream path broke keeps off it for a while (``router.transport.auto.RETRY_PATH_S``)."""

    def __init__(self, platform: HostsPlatform, group: str):
        self._platform, self._group = platform, group
        self._baseline: tuple[int, int] | None = None  # (pid, stream calls) at the first answer

    def __call__(self) -> bool:
        view = self._platform.describe(self._group)
        calls = view.transport_calls.get("grpc-stream", 0)
        if self._baseline is None or self._baseline[0] != view.pid:
            self._baseline = (view.pid, calls)
        return self._group in self._platform.store.endpoints() and calls > self._baseline[1]


@dataclass(frozen=True)
class HostLinkDown:
    """A group host's link down for the hold, then up: its process runs on, unreachable, its
    connections hanging. Routers fail over to the other replicas of its experts. ``sole``: one
    of its experts (layer, expert) has its other replica (on ``other``) evicted first, so tokens
    routed to it have nowhere else to go while the link is down; replicated back at the end."""

    group: str
    sole: tuple[int, int] | None = None
    other: str = ""

    @property
    def name(self) -> str:
        return "host-link-down-sole" if self.sole else "host-link-down-replicated"

    @property
    def description(self) -> str:
        if self.sole is None:
            return (
                f"group host {self.group}'s link down for the hold, then up; every expert it holds has another replica"
            )
        layer, expert = self.sole
        return (
            f"group host {self.group}'s link down for the hold, then up; its layer {layer} expert {expert} has no "
            f"other replica (the one on {self.other} evicted first)"
        )

    def run(self, platform: HostsPlatform, hold_s: float) -> Timeline:
        if self.sole is not None:
            platform.migrate(*self.sole, admin_pb.MIGRATION_MODE_EVICT, source=self.other)
        injected, lifted = held(_link(platform, self.group, up=False), _link(platform, self.group, up=True), hold_s)
        recovered = wait_until(_GroupBack(platform, self.group), RECOVERY_TIMEOUT_S)
        if self.sole is not None:
            platform.migrate(*self.sole, admin_pb.MIGRATION_MODE_REPLICATE, target=self.other, source=self.group)
            if recovered is not None:
                recovered = time.monotonic()  # whole again: both replicas again
        return Timeline(injected, lifted, recovered)


@dataclass(frozen=True)
class RedisHostCutOff:
    """The Redis host's link down for the hold, then up: the store hangs rather than refuses.
    Routers serve on the table they hold; groups and the orchestrator retry."""

    name: str = "redis-host-cut-off"
    description: str = "the Redis host's link down for the hold, then up"

    def run(self, platform: HostsPlatform, hold_s: float) -> Timeline:
        redis = platform.host_of("redis")
        injected, _ = held(_link(platform, redis, up=False), _link(platform, redis, up=True), hold_s)
        return Timeline(injected, *lifted_until_the_router_reports(platform))


@dataclass(frozen=True)
class OrchestratorCutOffMidMigration:
    """A live move of one expert started, and the orchestrator host's link taken down as soon as
    the admin API has accepted it; up again after the hold. Whole again once the move has ended
    (whichever way), the table lists only replicas that hold their experts and the router
    serves it."""

    layer: int
    expert: int
    source: str
    target: str
    name: str = "orchestrator-cut-off-mid-migration"

    @property
    def description(self) -> str:
        return (
            f"layer {self.layer} expert {self.expert} moved live {self.source} -> {self.target}; the orchestrator "
            "host's link down as soon as the move started, up after the hold"
        )

    def run(self, platform: HostsPlatform, hold_s: float) -> Timeline:
        orch = platform.host_of("orchestrator")
        migration = platform.start_migration(
            self.layer, self.expert, admin_pb.MIGRATION_MODE_MOVE, target=self.target, source=self.source
        )
        at_cut = admin_pb.MigrationPhase.Name(migration.phase)
        injected, lifted = held(_link(platform, orch, up=False), _link(platform, orch, up=True), hold_s)
        ended: list = []

        def whole() -> bool:
            if not ended:
                record = platform.migration(migration.id)
                if record.phase not in _ENDED:
                    return False
                ended.append(record)
            table = platform.store.routing_table()
            return (
                table is not None
                and platform.router_version() >= table.version
                and replicas_hold_their_experts(platform, table)
            )

        recovered = wait_until(_reachable(whole), RECOVERY_TIMEOUT_S)
        end = admin_pb.MigrationPhase.Name(ended[0].phase) if ended else "not ended"
        reason = f": {ended[0].reason}" if ended and ended[0].reason else ""
        return Timeline(injected, lifted, recovered, note=f"the move was {at_cut} at the cut; it ended {end}{reason}")


_ENDED = (admin_pb.MIGRATION_PHASE_SUCCEEDED, admin_pb.MIGRATION_PHASE_FAILED, admin_pb.MIGRATION_PHASE_ROLLED_BACK)


@dataclass(frozen=True)
class GroupHostKilled:
    """Every process of a group host SIGKILLed at once (the host lost), its group started again on
    it after the hold, as its Deployment would, at the same address."""

    group: str
    name: str = "group-host-killed"

    @property
    def description(self) -> str:
        return f"every process of group host {self.group} SIGKILLed; its group started again after the hold"

    def run(self, platform: HostsPlatform, hold_s: float) -> Timeline:
        injected = time.monotonic()
        killed = platform.hosts.kill(self.group)
        time.sleep(hold_s)
        platform.restart_group(self.group)
        lifted = time.monotonic()
        recovered = wait_until(_GroupBack(platform, self.group), RECOVERY_TIMEOUT_S)
        return Timeline(injected, lifted, recovered, note=f"{killed} process(es) killed")


class UnhostedWatch:
    """Reads the routing table every ``WATCH_POLL_S`` from ``start`` to ``stop``: which (layer,
    expert) pairs any read found without a replica, and how many reads there were (a read that
    cannot reach the store, as while the Redis host is cut off, is counted apart)."""

    def __init__(self, platform: HostsPlatform):
        self._platform = platform
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="chaos-unhosted-watch", daemon=True)
        self.reads = 0
        self.unread = 0
        self.unhosted: set[tuple[int, int]] = set()

    def start(self) -> "UnhostedWatch":
        self._thread.start()
        return self

    def stop(self) -> "UnhostedWatch":
        """Stop watching. A watch whose every read met the fault (a read that waits out the store's socket
        timeout can outlast a short hold) reads once more now, the scenario recovered: so each scenario's
        table is read at least once while the store answers."""
        self._stop.set()
        self._thread.join()
        if self.reads == 0:
            self._read()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(WATCH_POLL_S):
            self._read()

    def _read(self) -> None:
        spec = self._platform.spec
        try:
            table = self._platform.store.routing_table()
        except ConnectionError:
            self.unread += 1
            return
        self.reads += 1
        if table is None:
            # A store without a table (flushed) leaves every expert unlisted.
            self.unhosted.update(unhosted({}, spec.moe_layers, spec.num_experts))
        else:
            self.unhosted.update(unhosted(table.replicas, spec.moe_layers, spec.num_experts))
