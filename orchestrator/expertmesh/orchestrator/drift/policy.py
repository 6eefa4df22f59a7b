"""The drift policy: one observation and what the last scan left -> the decisions
of this scan and what it leaves for the next. A pure function (``decide``); the
triggers, targets and holds are defined in the package docstring.

Choices the field report leaves open, made here:

* A group fires at most once per ``consecutive_scans``: when it moves experts its
  count starts again from 0, so the moves show in its utilisation before it is
  judged again. A group that fires but moves nothing (a hold) keeps its count and
  tries again at the next scan.
* "Its least-used experts" are taken in order of replica load, and an expert in
  cooldown or without a target is passed over for the next one, so a group gives
  away up to ``experts_per_move`` experts that can go somewhere.
* A target must stay at or under the high watermark with the experts it takes,
  or the next scan would move them back. Moves decided in one scan count against
  their targets' room at once.
* Groups a running migration moves an expert off or onto are neither sources nor
  targets (their figures are in flux), and pairs already moving are left alone.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace

from expertmesh.orchestrator.drift.config import DriftConfig
from expertmesh.orchestrator.drift.rebalance import LayerLoads
from expertmesh.orchestrator.drift.state import (
    BusySample,
    Decision,
    DriftState,
    GroupSample,
    GroupUtilisation,
    Hold,
    LayerBalance,
    Move,
    Observation,
    Pair,
    Scan,
    Trigger,
)


def busy_fraction(previous: BusySample | None, now: BusySample) -> float | None:
    """Share of the wall time between two samples with a Dispatch computing; None without a previous
    sample or when the counter went backwards (the group restarted)."""
    if previous is None or now.at <= previous.at or now.seconds < previous.seconds:
        return None
    return min(1.0, (now.seconds - previous.seconds) / (now.at - previous.at))


def memory_level(sample: GroupSample, measured: bool = True) -> float | None:
    """How full a group's memory is: its weights over their budget, or the memory measured where it computes over
    that memory's size when ``measured`` and higher (another process on the GPU, activations, the KV of a
    co-located router: what runs out first); None with neither."""
    levels = []
    if sample.budget_bytes:
        levels.append(sample.weight_bytes / sample.budget_bytes)
    if measured and sample.memory_total_bytes > 0:
        levels.append(sample.memory_used_bytes / sample.memory_total_bytes)
    return max(levels, default=None)


def window_tokens(obs: Observation) -> float:
    """Tokens in the load windows: the busiest layer's expert loads over top-k."""
    per_layer: dict[int, float] = defaultdict(float)
    for entry in obs.loads:
        per_layer[entry.layer] += entry.tokens
    return max(per_layer.values(), default=0.0) / max(obs.top_k, 1)


class _Batch:
    """This scan's moves so far, and what rules a move out: groups and pairs a running migration
    holds, pairs in cooldown, room already promised to targets."""

    def __init__(
        self,
        obs: Observation,
        groups: dict[str, GroupUtilisation],
        samples: dict[str, GroupSample],
        config: DriftConfig,
    ):
        self.obs, self.groups, self.samples, self.config = obs, groups, samples, config
        running = [m for m in obs.migrations if not m.phase.terminal]
        self.running = len(running)
        self.busy_groups = {g for m in running for g in (m.source, m.target) if g}
        self.moving = {m.pair for m in running}
        self.cooling = {m.pair for m in obs.migrations if obs.at - m.started_at < config.cooldown_s}
        self.promised: dict[str, int] = defaultdict(int)
        self.moves: list[Move] = []
        self.planned: set[Pair] = set()

    def movable(self, pair: Pair) -> bool:
        return pair not in self.moving and pair not in self.planned

    def fits(self, source: str, target: str) -> bool:
        """Both groups answered and run no migration, and ``target`` stays at or under the high
        watermark with one more of ``source``'s experts than promised so far."""
        if not {source, target} <= self.samples.keys() or {source, target} & self.busy_groups:
            return False
        sample = self.samples[target]
        used = sample.weight_bytes + self.promised[target] + self.samples[source].expert_bytes
        return not sample.budget_bytes or used / sample.budget_bytes <= self.config.high_watermark

    def room(self, group: str) -> float:
        sample = self.samples[group]
        return sample.budget_bytes - sample.weight_bytes - self.promised[group] if sample.budget_bytes else math.inf

    def target(self, pair: Pair, source: str) -> str | None:
        """The group below the low watermark with the most room that does not serve ``pair`` and
        ``fits`` it; None when there is none."""
        serving = self.obs.table.replicas.get(pair, ())
        fits = [
            g
            for g, u in self.groups.items()
            if g not in serving and u.level < self.config.low_watermark and self.fits(source, g)
        ]
        return min(fits, key=lambda g: (-self.room(g), self.groups[g].level, g), default=None)

    def take(self, move: Move) -> None:
        self.moves.append(move)
        self.planned.add((move.layer, move.expert))
        self.promised[move.target] += self.samples[move.source].expert_bytes


def _utilisation(
    obs: Observation, state: DriftState, config: DriftConfig
) -> tuple[dict[str, GroupUtilisation], dict[str, BusySample]]:
    groups, busy = {}, {}
    for s in obs.groups:
        busy[s.group] = BusySample(s.busy_seconds, obs.at)
        u = GroupUtilisation(
            group=s.group,
            memory=memory_level(s, config.measured_memory),
            busy=busy_fraction(state.busy.get(s.group), busy[s.group]),
            weight_bytes=s.weight_bytes,
            budget_bytes=s.budget_bytes,
            scans_above=0,
        )
        above = state.scans_above.get(s.group, 0) + 1 if u.level > config.high_watermark else 0
        groups[s.group] = replace(u, scans_above=above)
    return groups, busy


def _replica_load(obs: Observation, tokens: dict[Pair, float], pair: Pair, group: str) -> float:
    replicas = obs.table.replicas[pair]
    return tokens.get(pair, 0.0) * obs.table.shares_of(pair)[replicas.index(group)]


def _high_watermark(
    batch: _Batch, tokens: dict[Pair, float], window: float, scans_above: dict[str, int]
) -> list[Decision]:
    obs, config = batch.obs, batch.config
    decisions = []
    due = [u for u in batch.groups.values() if u.scans_above >= config.consecutive_scans]
    for u in sorted(due, key=lambda u: (-u.level, u.group)):
        why = f"{u.describe()} above the high watermark {config.high_watermark:.0%} for {u.scans_above} scans"

        def hold(reason: Hold, because: str) -> None:
            decisions.append(Decision(Trigger.HIGH_WATERMARK, f"{why}; {because}", hold=reason))

        if u.group in batch.busy_groups:
            hold(Hold.IN_FLIGHT, "waiting for the migration in flight on it")
            continue
        if window < config.min_window_tokens:
            hold(
                Hold.LOW_TRAFFIC,
                f"the load windows hold {window:.0f} tokens, fewer than {config.min_window_tokens:.0f}",
            )
            continue
        served = [pair for pair, replicas in obs.table.replicas.items() if u.group in replicas and batch.movable(pair)]
        ranked = sorted(served, key=lambda pair: (_replica_load(obs, tokens, pair, u.group), pair))
        candidates = [pair for pair in ranked if pair not in batch.cooling]
        if not candidates:
            hold(Hold.COOLDOWN, f"each expert it serves moved within the last {config.cooldown_s:g} s")
            continue
        moved = []
        for pair in candidates:
            target = batch.target(pair, u.group)
            if target is None:
                continue
            move = Move(pair[0], pair[1], u.group, target)
            batch.take(move)
            moved.append(move)
            load = _replica_load(obs, tokens, pair, u.group)
            decisions.append(
                Decision(
                    Trigger.HIGH_WATERMARK,
                    f"{why}; moving its least-used expert layer {pair[0]} expert {pair[1]} ({load:.0f} tokens)"
                    f" to {batch.groups[target].describe()}, the group below the low watermark"
                    f" {config.low_watermark:.0%} with the most room",
                    move=move,
                )
            )
            if len(moved) == config.experts_per_move:
                break
        if moved:
            scans_above[u.group] = 0
        else:
            hold(
                Hold.NO_TARGET,
                f"no group below the low watermark {config.low_watermark:.0%} with room lacks any of its"
                f" {len(candidates)} movable experts",
            )
    return decisions


def _rebalance(
    batch: _Batch,
    layer_loads: LayerLoads,
    balance: dict[int, float],
    window: float,
    scans_below: dict[int, int],
    max_moves: int,
) -> list[Decision]:
    obs, config = batch.obs, batch.config
    decisions = []
    due = [layer for layer, n in scans_below.items() if n >= config.consecutive_scans]
    for layer in sorted(due, key=lambda layer: (balance[layer], layer)):
        why = (
            f"layer {layer} balancedness {balance[layer]:.2f} below {config.rebalance_below:.2f}"
            f" for {scans_below[layer]} scans"
        )

        def hold(reason: Hold, because: str) -> None:
            decisions.append(Decision(Trigger.REBALANCE, f"{why}; {because}", hold=reason))

        room = max_moves - batch.running - len(batch.moves)
        if room <= 0:
            hold(
                Hold.IN_FLIGHT,
                f"{batch.running + len(batch.moves)} moves are in flight or decided, the limit of {max_moves}",
            )
            continue
        if window < config.min_window_tokens:
            hold(
                Hold.LOW_TRAFFIC,
                f"the load windows hold {window:.0f} tokens, fewer than {config.min_window_tokens:.0f}",
            )
            continue
        planned = layer_loads.planned_moves(layer, obs.top_k, config.rebalance_min_gain)
        if not planned:
            scans_below[layer] = 0
            hold(
                Hold.NO_GAIN,
                f"the planner gains less than {config.rebalance_min_gain:.2f} balancedness over the current placement"
                if planned is None
                else "the planner would only move experts with several replicas, which drift leaves as they are",
            )
            continue
        possible = [
            m for m in planned if batch.movable((m.layer, m.expert)) and (m.layer, m.expert) not in batch.cooling
        ]
        ready = []
        for move in possible:
            if len(ready) < room and batch.fits(move.source, move.target):
                batch.take(move)
                ready.append(move)
        for move in ready:
            decisions.append(
                Decision(
                    Trigger.REBALANCE,
                    f"{why}; the planner moves expert {move.expert} from {move.source} to {move.target}"
                    f" ({len(planned)} moves planned, {len(ready)} now)",
                    move=move,
                )
            )
        if ready:
            scans_below[layer] = 0
        elif possible:
            hold(
                Hold.NO_TARGET,
                f"none of the planner's {len(possible)} movable experts has a target that answers, runs no migration"
                " and has room",
            )
        else:
            hold(
                Hold.COOLDOWN,
                f"the planner's {len(planned)} moves are of experts moving or moved within the last"
                f" {config.cooldown_s:g} s",
            )
    return decisions


def decide(obs: Observation, state: DriftState, config: DriftConfig, max_moves: int) -> tuple[Scan, DriftState]:
    """One scan's decisions, and the state to keep for the next (a dry run drops it).

    ``max_moves``: migrations in flight at once (the runner's), the bound on a rebalance batch.
    """
    groups, busy = _utilisation(obs, state, config)
    samples = {s.group: s for s in obs.groups}
    tokens = {(e.layer, e.expert): e.tokens for e in obs.loads}
    window = window_tokens(obs)
    batch = _Batch(obs, groups, samples, config)
    scans_above = {g: u.scans_above for g, u in groups.items()}
    decisions = _high_watermark(batch, tokens, window, scans_above)

    layer_loads = LayerLoads.build(obs.table, obs.loads, samples)
    balance = layer_loads.balancedness()
    scans_below: dict[int, int] = {}
    if config.rebalance:
        scans_below = {
            layer: state.scans_below.get(layer, 0) + 1 if b < config.rebalance_below else 0
            for layer, b in balance.items()
        }
        layers = [LayerBalance(layer, b, scans_below[layer]) for layer, b in balance.items()]
        decisions += _rebalance(batch, layer_loads, balance, window, scans_below, max_moves)
    else:
        layers = [LayerBalance(layer, b, 0) for layer, b in balance.items()]
    scan = Scan(tuple(groups.values()), tuple(layers), window, tuple(decisions))
    return scan, DriftState(scans_above=scans_above, scans_below=scans_below, busy=busy)
