"""The capacity policy: one observation (drift's) and what the last scan left -> this scan's decisions and what
it leaves for the next. A pure function (``decide``); the terms are the package docstring's.

Choices made here:

* Replicas go where they raise balancedness most directly: the worst layer under ``replicate_below`` first, its
  hot group's heaviest expert that can go somewhere, onto the layer's least-loaded group with memory room. A
  replica is taken only if the layer's estimated balancedness (replica loads split evenly) rises by ``min_gain``,
  so a layer that one more replica cannot help gets none.
* A retire may lower the layer's estimated balancedness by at most ``min_gain``, and never takes an expert's last
  replica. Both count against ``max_changes_per_scan`` and the room promised to targets this scan.
* Pairs a migration moves now or started moving within ``cooldown_s`` are left alone (drift's rule), as are groups
  a running migration holds: their figures are in flux.
* Groups are only advised (``ADD_GROUP`` / ``REMOVE_GROUP``): the controller's caller adds or removes them (the
  admin API's groups, or a Ray/KubeRay autoscaler satisfying a pending placement group).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Mapping

from expertmesh.orchestrator.capacity.config import CapacityConfig
from expertmesh.orchestrator.drift.policy import busy_fraction, window_tokens
from expertmesh.orchestrator.drift.state import BusySample, Observation, Pair

__all__ = ["Action", "CapacityDecision", "CapacityScan", "CapacityState", "decide"]


class Action(StrEnum):
    REPLICATE = "replicate"
    RETIRE = "retire"
    ADD_GROUP = "add_group"
    REMOVE_GROUP = "remove_group"


@dataclass(frozen=True)
class CapacityDecision:
    action: Action
    #: one line a person can act on, with the figures behind it
    detail: str
    layer: int | None = None
    expert: int | None = None
    #: a replicate's target, a retire's source, the group a REMOVE_GROUP names
    group: str | None = None


@dataclass(frozen=True)
class CapacityState:
    """What one scan leaves for the next; fresh at start (a restarted orchestrator only waits longer)."""

    busy: Mapping[str, BusySample] = field(default_factory=dict)
    scans_busy: int = 0
    scans_idle: int = 0
    #: when a group was last advised added or removed (observation time)
    group_advised_at: float | None = None


@dataclass(frozen=True)
class CapacityScan:
    #: mean busy fraction of the groups with a previous sample; None on the first scan
    cluster_busy: float | None
    #: layer -> estimated balancedness before this scan's decisions
    balancedness: Mapping[int, float]
    decisions: tuple[CapacityDecision, ...]


class _Layers:
    """Group loads per layer from the table and the load windows (replica loads split evenly), updated as
    decisions are taken."""

    def __init__(self, obs: Observation, groups: list[str]):
        self.groups = groups
        self.load: dict[Pair, float] = {(x.layer, x.expert): x.tokens for x in obs.loads}
        self.replicas: dict[Pair, list[str]] = {pair: list(names) for pair, names in obs.table.replicas.items()}
        #: pair -> each replica's share of its tokens (the table's, else even; even again once changed)
        self.shares: dict[Pair, list[float]] = {
            pair: list(obs.table.shares.get(pair) or [1.0 / len(names)] * len(names))
            for pair, names in self.replicas.items()
        }
        self.group_load: dict[int, dict[str, float]] = defaultdict(lambda: dict.fromkeys(groups, 0.0))
        self.experts: dict[int, int] = defaultdict(int)
        self.total: dict[int, float] = defaultdict(float)
        for (layer, expert), names in self.replicas.items():
            self.experts[layer] += 1
            tokens = self.load.get((layer, expert), 0.0)
            self.total[layer] += tokens
            for name, share in zip(names, self.shares[(layer, expert)]):
                if name in self.group_load[layer]:
                    self.group_load[layer][name] += tokens * share

    def replica_load(self, pair: Pair) -> float:
        """The largest share of the pair's tokens one replica takes."""
        return self.load.get(pair, 0.0) * max(self.shares.get(pair, ()), default=1.0)

    def balancedness(self, layer: int, loads: Mapping[str, float] | None = None) -> float:
        values = list((loads or self.group_load[layer]).values())
        top = max(values, default=0.0)
        return sum(values) / len(values) / top if top > 0 else 1.0

    def after(self, pair: Pair, add: str | None = None, drop: str | None = None) -> dict[str, float]:
        """The layer's group loads once ``pair`` gains a replica on ``add`` or loses the one on ``drop``."""
        layer = pair[0]
        names = self.replicas[pair]
        now = [n for n in names if n != drop] + ([add] if add else [])
        tokens = self.load.get(pair, 0.0)
        loads = dict(self.group_load[layer])
        for n, share in zip(names, self.shares[pair]):
            if n in loads:
                loads[n] -= tokens * share
        for n in now:
            if n in loads:
                loads[n] += tokens / len(now)
        return loads

    def take(self, pair: Pair, add: str | None = None, drop: str | None = None) -> None:
        self.group_load[pair[0]] = self.after(pair, add, drop)
        names = self.replicas[pair]
        self.replicas[pair] = [n for n in names if n != drop] + ([add] if add else [])
        self.shares[pair] = [1.0 / len(self.replicas[pair])] * len(self.replicas[pair])


def _group_advice(
    obs: Observation, state: CapacityState, config: CapacityConfig, busy: dict[str, float | None], layers: _Layers
) -> tuple[list[CapacityDecision], float | None, int, int, float | None]:
    known = [b for b in busy.values() if b is not None]
    cluster = sum(known) / len(known) if known else None
    scans_busy = state.scans_busy + 1 if cluster is not None and cluster > config.add_busy else 0
    scans_idle = state.scans_idle + 1 if cluster is not None and cluster < config.remove_busy else 0
    advised = state.group_advised_at
    if advised is not None and obs.at - advised < config.group_cooldown_s:
        return [], cluster, scans_busy, scans_idle, advised
    out = []
    if scans_busy >= config.scans:
        out.append(
            CapacityDecision(
                Action.ADD_GROUP,
                f"the groups were {cluster:.0%} busy on average for {scans_busy} scans (add above "
                f"{config.add_busy:.0%}): add a group",
            )
        )
        scans_busy, advised = 0, obs.at
    elif scans_idle >= config.scans and len(busy) > config.min_groups:
        total = {g: sum(layers.group_load[layer].get(g, 0.0) for layer in layers.group_load) for g in busy}
        group = min(busy, key=lambda g: (busy[g] if busy[g] is not None else math.inf, total[g], g))
        out.append(
            CapacityDecision(
                Action.REMOVE_GROUP,
                f"the groups were {cluster:.0%} busy on average for {scans_idle} scans (remove below "
                f"{config.remove_busy:.0%}): remove {group}, the least busy",
                group=group,
            )
        )
        scans_idle, advised = 0, obs.at
    return out, cluster, scans_busy, scans_idle, advised


def decide(obs: Observation, state: CapacityState, config: CapacityConfig) -> tuple[CapacityScan, CapacityState]:
    samples = {s.group: s for s in obs.groups}
    now_busy = {g: BusySample(s.busy_seconds, obs.at) for g, s in samples.items()}
    busy = {g: busy_fraction(state.busy.get(g), now_busy[g]) for g in samples}
    layers = _Layers(obs, sorted(samples))
    before = {layer: layers.balancedness(layer) for layer in sorted(layers.group_load)}
    decisions, cluster, scans_busy, scans_idle, advised = _group_advice(obs, state, config, busy, layers)

    running = [m for m in obs.migrations if not m.phase.terminal]
    flux_groups = {g for m in running for g in (m.source, m.target) if g}
    frozen = {m.pair for m in running} | {m.pair for m in obs.migrations if obs.at - m.started_at < config.cooldown_s}
    promised: dict[str, int] = defaultdict(int)

    def room(group: str) -> bool:
        s = samples[group]
        if not s.budget_bytes:
            return True
        need = s.weight_bytes + promised[group] + max(x.expert_bytes for x in obs.groups)
        return need <= config.memory_high * s.budget_bytes

    changes: list[CapacityDecision] = []
    if window_tokens(obs) >= config.min_window_tokens and len(samples) > 1:
        done: set[int] = set()
        while len(changes) < config.max_changes_per_scan:
            open_layers = [
                layer
                for layer in layers.group_load
                if layer not in done and layers.balancedness(layer) < config.replicate_below
            ]
            if not open_layers:
                break
            layer = min(open_layers, key=lambda x: (layers.balancedness(x), x))
            decision = _replicate_one(layer, layers, config, frozen, flux_groups, room)
            if decision is None:
                done.add(layer)
                continue
            changes.append(decision)
            frozen.add((layer, decision.expert))
            promised[decision.group] += max(x.expert_bytes for x in obs.groups)
        for pair in sorted(layers.replicas, key=lambda p: (layers.replica_load(p), p)):
            if len(changes) >= config.max_changes_per_scan:
                break
            decision = _retire_one(pair, layers, config, frozen, flux_groups)
            if decision is not None:
                changes.append(decision)
                frozen.add(pair)
    scan = CapacityScan(cluster, before, tuple(decisions + changes))
    return scan, CapacityState(now_busy, scans_busy, scans_idle, advised)


def _replicate_one(layer, layers: _Layers, config, frozen, flux_groups, room) -> CapacityDecision | None:
    loads = layers.group_load[layer]
    hot = max(loads, key=lambda g: (loads[g], g))
    if hot in flux_groups:
        return None
    bal = layers.balancedness(layer)
    held = [p for p, names in layers.replicas.items() if p[0] == layer and hot in names]
    for pair in sorted(held, key=lambda p: (-layers.replica_load(p), p)):
        names = layers.replicas[pair]
        if pair in frozen or len(names) >= config.max_replicas_per_pair or layers.load.get(pair, 0.0) <= 0:
            continue
        targets = [g for g in loads if g not in names and g not in flux_groups and room(g)]
        if not targets:
            continue
        target = min(targets, key=lambda g: (loads[g], g))
        gain = layers.balancedness(layer, layers.after(pair, add=target)) - bal
        if gain < config.min_gain:
            continue
        layers.take(pair, add=target)
        return CapacityDecision(
            Action.REPLICATE,
            f"layer {layer} balancedness {bal:.3f} (replicate below {config.replicate_below}): expert {pair[1]}, "
            f"{layers.load[pair]:.0f} tokens on {len(names)} replica(s) with {hot} the busiest, gets one on "
            f"{target} (estimated +{gain:.3f})",
            layer,
            pair[1],
            target,
        )
    return None


def _retire_one(pair: Pair, layers: _Layers, config, frozen, flux_groups) -> CapacityDecision | None:
    names = layers.replicas[pair]
    layer = pair[0]
    mean = layers.total[layer] / max(layers.experts[layer], 1)
    if len(names) < 2 or pair in frozen or layers.replica_load(pair) >= config.retire_below * mean:
        return None
    loads = layers.group_load[layer]
    candidates = [n for n in names if n in loads and n not in flux_groups]
    if not candidates:
        return None
    source = max(candidates, key=lambda g: (loads[g], g))
    bal = layers.balancedness(layer)
    after = layers.balancedness(layer, layers.after(pair, drop=source))
    if after < bal - config.min_gain:
        return None
    layers.take(pair, drop=source)
    return CapacityDecision(
        Action.RETIRE,
        f"layer {layer} expert {pair[1]}: {layers.load.get(pair, 0.0):.0f} tokens over {len(names)} replicas, "
        f"under {config.retire_below:.0%} of the layer's mean expert load {mean:.0f}: its replica on {source} "
        f"is retired (balancedness {bal:.3f} -> {after:.3f})",
        layer,
        pair[1],
        source,
    )
