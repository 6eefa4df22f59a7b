"""The simulated I/O of the scale simulation: a clock, a state backend that counts operations,
expert groups behind the migration executor's group-channel interface, and a fleet of routers
whose polls, heartbeats and load publishes hit the store on the simulated clock."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from expertmesh.bench.scale.model import Costs, ModelShape
from expertmesh.contracts.load_report import DETAIL_EVERY, publish_interval_s
from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.orchestrator.migration.group_calls import GroupCallFailed, GroupView, Loaded
from expertmesh.orchestrator.migration.plan import Canary, Pair
from expertmesh.store import RouterHeartbeat, StateStore
from expertmesh.store._memory import MemoryBackend

__all__ = ["Clock", "CountingBackend", "ParsedTableStore", "SimulatedGroups", "RouterFleet"]


class Clock:
    """Simulated seconds; ``now`` is what the executor and the records are stamped with."""

    def __init__(self, start: float = 0.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance_to(self, at: float) -> None:
        if at < self.now:
            raise ValueError(f"the simulated clock cannot go back from {self.now} to {at}")
        self.now = at


@dataclass
class OpCounts:
    """Store calls and bytes of one caller (routers or orchestrator), by kind."""

    ops: Counter = field(default_factory=Counter)
    bytes_in: int = 0  # to the store
    bytes_out: int = 0  # from the store

    def total(self) -> int:
        return sum(self.ops.values())


class CountingBackend:
    """A ``MemoryBackend`` whose calls are counted per caller: ``view(caller)`` is a
    ``KeyValueBackend`` for one caller over the same data."""

    def __init__(self) -> None:
        self._kv = MemoryBackend()
        self.counts: dict[str, OpCounts] = {}

    def view(self, caller: str) -> _CountingView:
        return _CountingView(self._kv, self.counts.setdefault(caller, OpCounts()))

    def reset(self) -> None:
        for c in self.counts.values():
            c.ops.clear()
            c.bytes_in = c.bytes_out = 0


class _CountingView:
    def __init__(self, kv: MemoryBackend, counts: OpCounts):
        self._kv, self._c = kv, counts

    def get(self, key: str) -> bytes | None:
        self._c.ops["get"] += 1
        value = self._kv.get(key)
        self._c.bytes_out += len(value or b"")
        return value

    def compare_and_set_many(self, guard_key: str, expected: bytes | None, items: dict[str, bytes]) -> bool:
        self._c.ops["compare_and_set"] += 1
        self._c.bytes_in += sum(len(v) for v in items.values())
        return self._kv.compare_and_set_many(guard_key, expected, items)

    def hset(self, key: str, field: str, value: bytes) -> None:
        self._c.ops["hset"] += 1
        self._c.bytes_in += len(value)
        self._kv.hset(key, field, value)

    def hdel(self, key: str, field: str) -> None:
        self._c.ops["hdel"] += 1
        self._kv.hdel(key, field)

    def hgetall(self, key: str) -> dict[str, bytes]:
        self._c.ops["hgetall"] += 1
        value = self._kv.hgetall(key)
        self._c.bytes_out += sum(len(v) for v in value.values())
        return value

    def hget(self, key: str, field: str) -> bytes | None:
        self._c.ops["hget"] += 1
        value = self._kv.hget(key, field)
        self._c.bytes_out += len(value or b"")
        return value

    def hlen(self, key: str) -> int:
        self._c.ops["hlen"] += 1
        return self._kv.hlen(key)

    def close(self) -> None:
        pass


class ParsedTableStore(StateStore):
    """A ``StateStore`` that parses the same stored table bytes once: the GET still happens (and is
    counted); only re-parsing identical JSON is skipped, which at DeepSeek-V3's shape is ~0.1 s of
    this process per read and would otherwise dominate the simulation's wall time."""

    def __init__(self, backend, namespace: str = "expertmesh"):
        super().__init__(backend, namespace)
        self._parsed: tuple[bytes, RoutingTable] | None = None

    def routing_table(self) -> RoutingTable | None:
        raw = self._kv.get(self._key("routing_table"))
        if raw is None:
            return None
        if self._parsed is None or self._parsed[0] != raw:
            self._parsed = (raw, RoutingTable.from_json(raw))
        return self._parsed[1]


class SimulatedGroups:
    """Expert groups as the executor's ``GroupChannels`` sees them (describe, load, unload, dispatch,
    close): each holds a set of (layer, expert) pairs of ``model``'s size under a byte budget.
    Nothing computes: a canary Dispatch answers zeros [T, H] from every group, so replicas agree.

    ``busy`` (group -> busy fraction) is set by the run from the load model; ``busy_seconds`` integrates it.
    """

    def __init__(self, model: ModelShape, costs: Costs, held: dict[str, set[Pair]], clock: Clock):
        self.model, self.costs, self.clock = model, costs, clock
        self.held = {g: set(pairs) for g, pairs in held.items()}
        self.busy: dict[str, float] = {g: 0.0 for g in held}
        self._busy_seconds: dict[str, float] = {g: 0.0 for g in held}
        self._busy_at = clock.now
        self.calls: Counter = Counter()
        self.loaded_bytes = 0
        #: highest weight bytes / budget any group reached
        self.peak_memory = max((self.memory(g) for g in held), default=0.0)

    def memory(self, group: str) -> float:
        return len(self.held[group]) * self.model.expert_bytes / self.costs.budget_bytes

    def set_busy(self, busy: dict[str, float]) -> None:
        """Integrate the busy fractions so far up to now, then take the new ones."""
        span = self.clock.now - self._busy_at
        for g, fraction in self.busy.items():
            self._busy_seconds[g] += fraction * span
        self._busy_at = self.clock.now
        self.busy = dict(busy)

    def _group(self, group: str) -> set[Pair]:
        if group not in self.held:
            raise GroupCallFailed(group, grpc.StatusCode.UNAVAILABLE, "no such simulated group")
        return self.held[group]

    def describe(self, group: str, timeout: float | None = None) -> GroupView:
        self.calls["describe"] += 1
        pairs = self._group(group)
        busy = self._busy_seconds[group] + self.busy[group] * (self.clock.now - self._busy_at)
        return GroupView(
            group=group,
            dtype=torch.bfloat16,
            hidden_size=self.model.hidden_size,
            pairs=frozenset(pairs),
            weight_bytes=len(pairs) * self.model.expert_bytes,
            budget_bytes=self.costs.budget_bytes,
            in_flight={},
            busy_seconds=busy,
        )

    def load(self, group: str, pair: Pair) -> Loaded:
        self.calls["load"] += 1
        pairs = self._group(group)
        if pair in pairs:
            return Loaded(False, len(pairs) * self.model.expert_bytes)
        if (len(pairs) + 1) * self.model.expert_bytes > self.costs.budget_bytes:
            raise GroupCallFailed(group, grpc.StatusCode.RESOURCE_EXHAUSTED, "over the simulated memory budget")
        pairs.add(pair)
        self.loaded_bytes += self.model.expert_bytes
        self.peak_memory = max(self.peak_memory, self.memory(group))
        return Loaded(True, len(pairs) * self.model.expert_bytes)

    def unload(self, group: str, pair: Pair) -> bool:
        self.calls["unload"] += 1
        pairs = self._group(group)
        held = pair in pairs
        pairs.discard(pair)
        return held

    def dispatch(self, group: str, layer: int, canary: Canary) -> torch.Tensor:
        self.calls["dispatch"] += 1
        self._group(group)
        return torch.zeros(canary.hidden.shape[0], self.model.hidden_size, dtype=torch.bfloat16)

    def close(self) -> None:
        pass


class RouterFleet:
    """``count`` routers polling the store every ``poll_s`` (version GET + quarantine HGETALL, the table
    GET when the version changed), heartbeating every ``heartbeat_s`` and on every switch, publishing a
    load pulse of ``pulse_bytes`` every ``load_publish_s`` and, when ``detail_bytes`` are given, the detail
    before every ``detail_every``-th pulse (``contracts.load_report``). Router ``r``'s polls fall at
    ``(r + 0.5) / count`` of a poll interval, and its details at that fraction of ``detail_every`` pulses, so
    the fleet's calls are spread evenly (deterministic). Before pulses a router wrote its whole window every
    interval: ``pulse_bytes`` = those bytes, no ``detail_bytes``. Given the fleet's inflow budget, the routers
    publish as the real ones do: ``load_publish_s`` apart, or further while ``count`` of them would exceed it
    (``load_report.publish_interval_s``)."""

    def __init__(
        self,
        store: StateStore,
        count: int,
        costs: Costs,
        *,
        poll_s: float = 0.25,
        heartbeat_s: float = 1.0,
        load_publish_s: float = 10.0,
        pulse_bytes: bytes = b"",
        detail_bytes: bytes = b"",
        detail_every: int = DETAIL_EVERY,
        budget_bytes_s: float = 0.0,
        load_window_s: float = 600.0,
    ):
        self.store, self.count, self.costs = store, count, costs
        self.poll_s, self.heartbeat_s = poll_s, heartbeat_s
        self.pulse_bytes, self.detail_bytes, self.detail_every = pulse_bytes, detail_bytes, detail_every
        per_publish = len(pulse_bytes) + len(detail_bytes) / detail_every
        self.load_publish_s = publish_interval_s(load_publish_s, count, per_publish, budget_bytes_s, load_window_s)
        self.ids = [f"router-{r}" for r in range(count)]
        self.phase = (np.arange(count) + 0.5) / count  # [R] fraction of an interval
        self.detail_offset = (self.phase * detail_every).astype(np.int64)  # [R] pulses each wrote before, mod K

    def serve_delays(self, published_at: float, table_bytes: int) -> np.ndarray:
        """[R] simulated seconds from a publish at ``published_at`` until each router steps with it."""
        first_poll = self.phase * self.poll_s  # [R] offset of each router's polls in an interval
        wait = (first_poll - published_at) % self.poll_s
        return wait + 2 * self.costs.fetch_s(0) + self.costs.fetch_s(table_bytes) + self.costs.step_s

    def beat(self, versions: np.ndarray, at: float) -> None:
        """Every router reports the version it serves (the executor's drain reads these)."""
        for rid, version in zip(self.ids, versions.tolist()):
            self.store.publish_router_heartbeat(RouterHeartbeat(rid, int(version), at))

    def run_window(self, start: float, seconds: float, known: int = 0) -> None:
        """Every store call the fleet makes in [start, start + seconds), in time order, on the real
        store methods the routers use (``TableWatcher``, ``Heartbeat``, the load window's publisher);
        the routers start out serving version ``known`` (a steady state: no table fetch unless it changed)."""
        events = []
        for r, phase in enumerate(self.phase.tolist()):
            for interval, kind in ((self.poll_s, 0), (self.heartbeat_s, 1), (self.load_publish_s, 2)):
                t = start + phase * interval
                while t < start + seconds:
                    events.append((t, kind, r))
                    t += interval
        events.sort()
        seen = {rid: known for rid in self.ids}
        pulses = self.detail_offset.copy()  # [R] each router's pulses so far, counted from its phase
        for t, kind, r in events:
            rid = self.ids[r]
            if kind == 0:
                version = self.store.routing_table_version()
                self.store.quarantined()
                if seen.get(rid) != version:
                    self.store.routing_table()
                    seen[rid] = version
            elif kind == 1:
                self.store.publish_router_heartbeat(RouterHeartbeat(rid, seen[rid], t))
            else:
                if self.detail_bytes and pulses[r] % self.detail_every == 0:
                    self.store.publish_load_detail(rid, self.detail_bytes)
                self.store.publish_load(rid, self.pulse_bytes)
                pulses[r] += 1
