"""One case of the scale simulation: a simulated day of drifting Zipf load on one cluster.

The real algorithms run on simulated inputs: the placement planner makes the first placement (and
a full re-plan at the end, timed), the drift policy (``drift.policy.decide``) scans every
``scan_interval_s``, the migration executor (``MigrationExecutor.step``, phase by phase, its group
calls answered by ``SimulatedGroups``) carries out the moves, and the health policy judges one
round over every replica. The loop is discrete-event: a heap of (simulated time, event). A
migration is stepped when its phase's simulated work is done (weights loaded at ``Costs.load_bytes_s``;
a drain when every router serves the version, ``RouterFleet.serve_delays``), so the executor never
waits in wall time.
"""

from __future__ import annotations

import heapq
import io
import math
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from expertmesh.bench.placement import grid_topology
from expertmesh.bench.scale.model import Costs, ModelShape, diurnal, expert_load, zipf_popularity
from expertmesh.bench.scale.planning import planner_figures
from expertmesh.bench.scale.simulated import Clock, CountingBackend, ParsedTableStore, RouterFleet, SimulatedGroups
from expertmesh.config.settings import LOAD_INFLOW_BUDGET_BYTES_S
from expertmesh.contracts.errors import ExpertMeshError
from expertmesh.contracts.gpu_plan import Placement
from expertmesh.contracts.load_report import DETAIL_EVERY, LoadPulse
from expertmesh.contracts.load_window import LoadSnapshot
from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.orchestrator.capacity.config import CapacityConfig
from expertmesh.orchestrator.capacity.policy import Action, CapacityState
from expertmesh.orchestrator.capacity.policy import decide as capacity_decide
from expertmesh.orchestrator.drift.config import DriftConfig
from expertmesh.orchestrator.drift.policy import decide
from expertmesh.orchestrator.drift.state import DriftState, ExpertLoad, GroupSample, Observation
from expertmesh.orchestrator.health import measure, sampling
from expertmesh.orchestrator.health import policy as health_policy
from expertmesh.orchestrator.health.config import HealthConfig
from expertmesh.orchestrator.health.state import Check, ReplicaId, ReplicaRecord
from expertmesh.orchestrator.migration.executor import MigrationExecutor
from expertmesh.orchestrator.migration.state import MigrationMode, Phase, load, load_all
from expertmesh.orchestrator.placement.planner import PlanOptions, plan
from expertmesh.orchestrator.placement.quality import layer_balancedness
from expertmesh.orchestrator.placement.stats import LoadStats
from expertmesh.store import StateStore

__all__ = ["Case", "run_case"]

HOUR = 3600.0
#: phases whose work is waiting for the routers (the executor's ``_drain``)
_DRAINS = (Phase.CONFIRMING, Phase.DRAINING)


@dataclass(frozen=True)
class Case:
    model: ModelShape
    gpus: int
    routers: int
    hours: float = 24.0
    #: redundant replicas per layer (default: one per GPU)
    redundant: int | None = None
    #: the re-plans keep a layer within this balancedness of the full plan's (``PlanOptions.min_gain``)
    min_gain: float = 0.01
    #: probe rows of one sampled health round (``HealthConfig.round_probe_rows``): a thousand replicas at the
    #: default 1000 tokens, 28.7 GB at DeepSeek-V3's width
    sampled_round_rows: int = 1_000_000
    seed: int = 0
    costs: Costs = field(default_factory=Costs)
    drift: DriftConfig = field(default_factory=lambda: DriftConfig(rebalance=True))
    health: HealthConfig = field(default_factory=HealthConfig)
    #: migrations in flight at once (the runner's ``max_concurrent``)
    max_moves: int = 4
    #: simulated seconds of router traffic whose store calls are counted one by one: a whole cycle of load
    #: details (``DETAIL_EVERY`` publishes 10 s apart), in which every router writes exactly one
    ops_window_s: float = DETAIL_EVERY * 10.0
    #: the routers' load windows (``LoadWindow.window_s``): the tokens a scan sees
    load_window_s: float = 600.0
    #: the fleet's load-publish budget (``DataPlaneConfig.load_inflow_budget_bytes_s``); 0: none
    load_inflow_budget_bytes_s: float = LOAD_INFLOW_BUDGET_BYTES_S
    #: the capacity controller beside drift (replicas of hot experts, cold ones retired); None: drift alone
    capacity: CapacityConfig | None = None

    @property
    def name(self) -> str:
        return f"{self.model.name} {self.gpus} GPUs {self.routers} routers" + (" +capacity" if self.capacity else "")


def _topology(gpus: int):
    per_node = min(8, gpus)
    if gpus % per_node:
        raise ValueError(f"{gpus} GPUs do not fill nodes of {per_node}")
    return grid_topology(gpus // per_node, 1, per_node)


def _stats(model: ModelShape, popularity: np.ndarray, tokens: float) -> LoadStats:
    """Expected load [L, E] and co-activation [L, E, E] of independent top-k picks."""
    k = model.top_k
    load = expert_load(popularity, tokens, k)
    coact = tokens * k * (k - 1) * np.einsum("le,lf->lef", popularity, popularity)
    idx = np.arange(model.num_experts)
    coact[:, idx, idx] = 0.0
    return LoadStats(model.moe_layers, model.num_experts, k, load, coact)


def table_shares(table: RoutingTable, groups: list[str], layers: int, experts: int) -> np.ndarray:
    """[L, E, G] each group's share of each expert's tokens."""
    column = {g: i for i, g in enumerate(groups)}
    shares = np.zeros((layers, experts, len(groups)))
    for (layer, expert), names in table.replicas.items():
        for name, share in zip(names, table.shares_of((layer, expert))):
            shares[layer, expert, column[name]] = share
    return shares


def _table_from_shares(shares: np.ndarray, gpu_ids: tuple[int, ...]) -> RoutingTable:
    replicas, split = {}, {}
    for layer, expert in np.ndindex(*shares.shape[:2]):
        cols = np.flatnonzero(shares[layer, expert] > 0)
        replicas[(layer, expert)] = tuple(f"g{gpu_ids[c]}" for c in cols)
        if len(cols) > 1:
            split[(layer, expert)] = tuple(
                float(s) for s in shares[layer, expert, cols] / shares[layer, expert, cols].sum()
            )
    return RoutingTable(version=1, num_experts=shares.shape[1], replicas=replicas, shares=split)


def router_window(model: ModelShape, popularity: np.ndarray, tokens: float, seed: int = 0) -> LoadSnapshot:
    """One router's window of ``tokens`` tokens as its ``LoadWindow`` counts them: whole counts, Poisson around
    the expected load [L, E], co-activation [L, E, E] (symmetric) and position load [L, P, E] of ``_stats``."""
    rng = np.random.default_rng(seed)
    expected = _stats(model, popularity, tokens)
    upper = np.triu(rng.poisson(expected.coactivation), 1)  # [L, E, E]
    bins = 16
    return LoadSnapshot(
        moe_layers=tuple(range(model.moe_layers)),
        num_experts=model.num_experts,
        top_k=model.top_k,
        load=rng.poisson(expected.load).astype(np.float64),
        coactivation=(upper + upper.transpose(0, 2, 1)).astype(np.float64),
        position_load=rng.poisson(np.repeat(expected.load[:, None, :] / bins, bins, axis=1)).astype(np.float64),
        max_context=4096,
    )


def whole_window_bytes(snap: LoadSnapshot) -> bytes:
    """``snap`` as routers wrote it every interval before pulses (``contracts.load_report``): every array dense
    float64 in one ``.npz``; ``LoadSnapshot.from_bytes`` still reads it."""
    buf = io.BytesIO()
    np.savez_compressed(
        buf,
        moe_layers=np.array(snap.moe_layers, dtype=np.int64),
        shape=np.array([snap.num_experts, snap.top_k, snap.max_context], dtype=np.int64),
        load=snap.load,
        coactivation=snap.coactivation,
        position_load=snap.position_load,
        domains=np.array(sorted(snap.domain_load), dtype=str),
        domain_load=np.stack([snap.domain_load[d] for d in sorted(snap.domain_load)])
        if snap.domain_load
        else np.zeros((0, *snap.load.shape)),
        relative_load=snap.relative_load,
        experts_per_token=snap.experts_per_token,
        query_length_edges=np.array(snap.query_length_edges, dtype=np.int64),
    )
    return buf.getvalue()


def _wall(decode, data: bytes) -> float:
    started = time.perf_counter()
    decode(data)
    return time.perf_counter() - started


def load_records(model: ModelShape, popularity: np.ndarray, tokens: float) -> dict:
    """What one router writes of a window of ``tokens`` tokens, before pulses and now (bytes), and what reading it
    costs (measured wall seconds): a control loop's scan decodes one per router, ``stats export`` one detail."""
    snap = router_window(model, popularity, tokens)
    whole, detail = whole_window_bytes(snap), snap.to_bytes()
    pulse = LoadPulse(snap.moe_layers, snap.num_experts, snap.top_k, snap.load).to_bytes()
    return {
        "whole": whole,
        "pulse": pulse,
        "detail": detail,
        "whole_decode_wall_s": _wall(LoadSnapshot.from_bytes, whole),
        "pulse_decode_wall_s": _wall(LoadPulse.from_bytes, pulse),
        "detail_decode_wall_s": _wall(LoadSnapshot.from_bytes, detail),
    }


class _Versions:
    """Every table version published, when, and when each router serves it."""

    def __init__(self, routers: int):
        self.published: list[tuple[int, float]] = []
        self.served_at: dict[int, np.ndarray] = {}  # version -> [R] simulated time each router serves it
        self.serving = np.zeros(routers, dtype=np.int64)  # [R]
        self.all_serve_s: list[float] = []
        self.increasing = True

    def publish(self, version: int, at: float, delays: np.ndarray) -> None:
        if self.published and version <= self.published[-1][0]:
            self.increasing = False
        self.published.append((version, at))
        self.served_at[version] = at + delays
        self.all_serve_s.append(float(delays.max()))

    def at(self, now: float) -> np.ndarray:
        """[R] the version each router serves at ``now``."""
        for version, times in self.served_at.items():
            if version > self.serving.min():
                self.serving = np.where(times <= now, np.maximum(self.serving, version), self.serving)
        return self.serving


def run_case(case: Case, progress=lambda text: None) -> dict:
    model, costs = case.model, case.costs
    topo = _topology(case.gpus)
    redundant = case.gpus if case.redundant is None else case.redundant
    peak_tokens = case.routers * costs.router_tokens_s * case.load_window_s

    def popularity(hour: float) -> np.ndarray:
        return zipf_popularity(model.moe_layers, model.num_experts, hour, seed=case.seed)

    # -- the first placement: the real planner (measured wall time) --------------------------------
    stats0 = _stats(model, popularity(0.0), peak_tokens * diurnal(0.0))
    options = PlanOptions(redundant=redundant, min_gain=case.min_gain)
    started, cpu = time.perf_counter(), time.process_time()
    first = plan(stats0, topo, options)
    plan_wall_s, plan_cpu_s = time.perf_counter() - started, time.process_time() - cpu
    gpu_ids = first.placement.gpu_ids
    groups = [f"g{g}" for g in gpu_ids]
    table = _table_from_shares(first.placement.shares, gpu_ids)
    initial_shares = table_shares(table, groups, model.moe_layers, model.num_experts)
    progress(
        f"{case.name}: first plan {plan_wall_s:.2f} s wall, {len(table.replicas)} pairs, "
        f"{sum(map(len, table.replicas.values()))} replicas"
    )

    # -- the store, the groups, the routers, the executor ------------------------------------------
    clock = Clock()
    backend = CountingBackend()
    orch = ParsedTableStore(backend.view("orchestrator"))
    for g in groups:
        orch.set_endpoint(g, f"sim://{g}")
    if not orch.publish_routing_table(table):
        raise RuntimeError("the first routing table was not stored")
    raw_table = table.to_json()
    table_bytes = len(raw_table)
    started = time.perf_counter()
    RoutingTable.from_json(raw_table)
    table_parse_wall_s = time.perf_counter() - started  # every reader of the table pays this per version
    held: dict[str, set] = {g: set() for g in groups}
    for pair, names in table.replicas.items():
        for name in names:
            held[name].add(pair)
    sim = SimulatedGroups(model, costs, held, clock)
    # one router's window at the day's peak, as it publishes it now and as it did before pulses
    windows = load_records(model, popularity(0.0), costs.router_tokens_s * case.load_window_s)
    router_store = StateStore(backend.view("routers"))
    fleet = RouterFleet(
        router_store,
        case.routers,
        costs,
        pulse_bytes=windows["pulse"],
        detail_bytes=windows["detail"],
        budget_bytes_s=case.load_inflow_budget_bytes_s,
        load_window_s=case.load_window_s,
    )
    versions = _Versions(case.routers)
    versions.publish(1, 0.0, fleet.serve_delays(0.0, table_bytes))
    executor = MigrationExecutor(
        orch, clock=clock, groups=sim, router_liveness_s=3 * fleet.heartbeat_s, drain_timeout_s=1.0
    )

    events: list[tuple[float, int, str, str]] = []  # (time, order, kind, migration id)
    order = iter(range(1 << 62))

    def at(t: float, kind: str, mid: str = "") -> None:
        heapq.heappush(events, (t, next(order), kind, mid))

    scan_s = case.drift.scan_interval_s
    end = case.hours * HOUR
    for k in range(int(end // scan_s) + 1):
        at(k * scan_s, "scan")
    for h in range(1, int(math.ceil(case.hours)) + 1):
        at(min(h * HOUR, end), "hour")

    state = DriftState()
    capacity_state, capacity_due = CapacityState(), 0.0
    capacity_actions: Counter = Counter()
    unhosted = 0
    decide_wall: list[float] = []
    refused = Counter()
    hours: list[dict] = []
    load_now = expert_load(popularity(0.0), peak_tokens * diurnal(0.0), model.top_k)

    def set_busy(current: RoutingTable, load: np.ndarray) -> None:
        """Busy fraction of each group: its token-expert work per second over its FLOP/s."""
        shares = table_shares(current, groups, model.moe_layers, model.num_experts)
        per_s = np.einsum("le,leg->g", load, shares) / case.load_window_s
        busy = per_s * model.expert_flops_per_token / costs.gpu_flops
        sim.set_busy({g: float(min(1.0, b)) for g, b in zip(groups, busy)})

    def after_step(m_before_version: int) -> None:
        nonlocal unhosted
        version = orch.routing_table_version()
        if version != m_before_version:
            current = orch.routing_table()
            versions.publish(version, clock.now, fleet.serve_delays(clock.now, table_bytes))
            # Make-before-break: every listed replica's group holds the expert, every expert has one.
            for pair, names in current.replicas.items():
                if not names or not all(pair in sim.held[n] for n in names):
                    unhosted += 1

    def wake(mid: str) -> None:
        m = load(orch, mid)
        if m.phase in _DRAINS:
            serving = versions.at(clock.now)
            if serving.min() < m.table_version:
                at(float(versions.served_at[m.table_version].max()), "step", mid)
                return
            fleet.beat(serving, clock.now)
        before = orch.routing_table_version()
        m = executor.step(mid)
        after_step(before)
        if m.phase.terminal:
            return
        if m.phase is Phase.CHECKING:  # LoadExperts just returned: the weights took this long
            delay = costs.load_s(model.expert_bytes)
        elif m.phase in _DRAINS:
            delay = float(versions.served_at[m.table_version].max()) - clock.now
        else:
            delay = costs.rpc_s
        at(clock.now + max(delay, costs.rpc_s), "step", mid)

    while events:
        t, _, kind, mid = heapq.heappop(events)
        if t > end:
            break
        clock.advance_to(t)
        if kind == "step":
            wake(mid)
        elif kind == "scan":
            hour = t / HOUR
            current = orch.routing_table()
            load_now = expert_load(popularity(hour), peak_tokens * diurnal(hour), model.top_k)
            set_busy(current, load_now)
            obs = Observation(
                at=t,
                table=current,
                groups=tuple(
                    GroupSample(v.group, v.weight_bytes, v.budget_bytes, v.busy_seconds, model.expert_bytes)
                    for v in (sim.describe(g) for g in groups)
                ),
                loads=tuple(ExpertLoad(l, e, float(load_now[l, e])) for l, e in np.ndindex(*load_now.shape)),
                top_k=model.top_k,
                migrations=tuple(load_all(orch)),
            )
            started = time.perf_counter()
            scan, state = decide(obs, state, case.drift, case.max_moves)
            decide_wall.append(time.perf_counter() - started)
            for decision in scan.decisions:
                move = decision.move
                if move is None:
                    continue
                try:
                    m = executor.submit(
                        move.layer, move.expert, move.target, move.source, initiator=f"drift:{decision.trigger}"
                    )
                except ExpertMeshError as err:
                    refused[type(err).__name__] += 1
                    continue
                at(t + costs.rpc_s, "step", m.id)
            if case.capacity is not None and t >= capacity_due:
                capacity_due = t + case.capacity.scan_interval_s
                started = time.perf_counter()
                capacity_scan, capacity_state = capacity_decide(obs, capacity_state, case.capacity)
                decide_wall[-1] += time.perf_counter() - started
                for d in capacity_scan.decisions:
                    capacity_actions[d.action.value] += 1
                    if d.action not in (Action.REPLICATE, Action.RETIRE):
                        continue  # group advice: counted; the simulated cluster's GPUs are fixed
                    replicate = d.action is Action.REPLICATE
                    try:
                        m = executor.submit(
                            d.layer,
                            d.expert,
                            target=d.group if replicate else None,
                            source=None if replicate else d.group,
                            mode=MigrationMode.REPLICATE if replicate else MigrationMode.EVICT,
                            initiator=f"capacity:{d.action.value}",
                        )
                    except ExpertMeshError as err:
                        refused[type(err).__name__] += 1
                        continue
                    at(t + costs.rpc_s, "step", m.id)
        elif kind == "hour":
            current = orch.routing_table()
            shares = table_shares(current, groups, model.moe_layers, model.num_experts)
            hours.append(
                {
                    "hour": round(t / HOUR, 3),
                    "balancedness_drift": float(layer_balancedness(load_now, shares).mean()),
                    "balancedness_static": float(layer_balancedness(load_now, initial_shares).mean()),
                    "table_version": current.version,
                    "peak_memory_utilisation": sim.peak_memory,
                }
            )
            progress(f"{case.name}: hour {t / HOUR:.0f} simulated, table v{current.version}")

    records = load_all(orch)
    done = [m for m in records if m.phase is Phase.SUCCEEDED]
    by_hour_moves, by_hour_bytes = defaultdict(int), defaultdict(int)
    for m in done:
        h = min(int(m.history[-1].at // HOUR), len(hours) - 1)
        by_hour_moves[h] += 1
        by_hour_bytes[h] += m.bytes_loaded
    for h, row in enumerate(hours):
        row["moves"] = by_hour_moves[h]
        row["bytes_moved"] = by_hour_bytes[h]
    orchestrator = backend.counts["orchestrator"]
    orchestrator_ops_s = orchestrator.total() / max(end, 1.0)
    # Migration records are never pruned and every step reads them all (``StateStore.migration``):
    # what the orchestrator reads grows with the day's moves.
    orchestrator_bytes_out_s = orchestrator.bytes_out / max(end, 1.0)

    # -- steady-state store traffic: the fleet's calls, one by one, over a simulated window --------
    router_counts = backend.counts["routers"]
    backend.reset()  # first as before pulses: every router writing its whole window each interval
    RouterFleet(router_store, case.routers, costs, pulse_bytes=windows["whole"]).run_window(
        clock.now, case.ops_window_s, known=orch.routing_table_version()
    )
    router_bytes_in_s_before = router_counts.bytes_in / case.ops_window_s
    backend.reset()
    fleet.run_window(clock.now, case.ops_window_s, known=orch.routing_table_version())
    router_ops_s = router_counts.total() / case.ops_window_s

    final = orch.routing_table()
    replan = _replan(case, topo, options, final, groups, popularity(case.hours), peak_tokens * diurnal(case.hours))
    health = _health_round(case, final)
    peak_level = max(max(sim.memory(g), sim.busy[g]) for g in groups)
    return {
        "case": {
            "model": model.name,
            "gpus": case.gpus,
            "routers": case.routers,
            "hours": case.hours,
            "redundant": redundant,
            "min_gain": case.min_gain,
            "capacity": case.capacity is not None,
        },
        "planner": {"first_plan_wall_s": plan_wall_s, "first_plan_cpu_s": plan_cpu_s, **replan},
        "drift": {
            "scans": len(decide_wall),
            "decide_wall_s_mean": float(np.mean(decide_wall)) if decide_wall else 0.0,
            "decide_wall_s_max": float(np.max(decide_wall)) if decide_wall else 0.0,
            "submitted": len(records),
            "succeeded": len(done),
            "in_flight_at_end": sum(1 for m in records if not m.phase.terminal),
            "ended_otherwise": Counter(
                m.phase.value for m in records if m.phase is not Phase.SUCCEEDED and m.phase.terminal
            ),
            "refused": dict(refused),
            #: the capacity controller's decisions by action (replicate, retire, add_group, remove_group)
            "capacity_decisions": dict(capacity_actions),
            "moves_per_hour": len(done) / case.hours,
            "bytes_moved_per_hour": sum(m.bytes_loaded for m in done) / case.hours,
        },
        "memory": {
            "peak_utilisation": sim.peak_memory,
            "peak_level_at_end": peak_level,
            "expert_bytes": model.expert_bytes,
        },
        "table": {
            "versions": len(versions.published),
            "versions_strictly_increase": versions.increasing,
            "bytes": table_bytes,
            "parse_wall_s": table_parse_wall_s,
            "all_routers_serve_s_max": max(versions.all_serve_s),
            "all_routers_serve_s_mean": float(np.mean(versions.all_serve_s)),
            "unhosted_or_unheld": unhosted,
        },
        "store": {
            "router_ops_s": router_ops_s,
            "router_ops_s_by_kind": {k: v / case.ops_window_s for k, v in sorted(router_counts.ops.items())},
            "router_bytes_in_s": router_counts.bytes_in / case.ops_window_s,
            #: the same, had every router written its whole window every interval (before pulses)
            "router_bytes_in_s_before": router_bytes_in_s_before,
            #: seconds between one router's load publishes (10 s, or more where the fleet's budget binds)
            "load_publish_s": fleet.load_publish_s,
            "router_bytes_out_s": router_counts.bytes_out / case.ops_window_s,
            "orchestrator_ops_s": orchestrator_ops_s,
            "orchestrator_bytes_out_s": orchestrator_bytes_out_s,
            "ops_s": router_ops_s + orchestrator_ops_s,
            "ops_s_per_router": router_ops_s / case.routers,
            #: one router's peak window: its pulse (every interval), its detail (every DETAIL_EVERY), whole (before)
            "load_pulse_bytes": len(windows["pulse"]),
            "load_detail_bytes": len(windows["detail"]),
            "detail_every": DETAIL_EVERY,
            "load_window_bytes": len(windows["whole"]),
            #: what a drift or capacity scan reads and decodes: every router's pulse (before: its whole window)
            "scan_reads_bytes": len(windows["pulse"]) * case.routers,
            "scan_reads_bytes_before": len(windows["whole"]) * case.routers,
            "scan_decode_wall_s": windows["pulse_decode_wall_s"] * case.routers,
            "scan_decode_wall_s_before": windows["whole_decode_wall_s"] * case.routers,
            #: what ``stats export`` decodes: every router's detail
            "detail_decode_wall_s": windows["detail_decode_wall_s"] * case.routers,
        },
        "health": health,
        "hours": hours,
        "group_calls": dict(sim.calls),
    }


def _replan(
    case: Case, topo, options: PlanOptions, table: RoutingTable, groups: list[str], pop: np.ndarray, tokens: float
) -> dict:
    """At the day's end, given the placement then: a full re-plan and the incremental one (measured wall and CPU
    time, what each would move), and one GPU added and one removed (``planning.planner_figures``)."""
    model = case.model
    stats = _stats(model, pop, tokens)
    current = Placement(
        tuple(int(g[1:]) for g in groups), table_shares(table, groups, model.moe_layers, model.num_experts)
    )
    figures = planner_figures(stats, topo, options, current, per_gpu_redundant=case.redundant is None)
    full = figures["day_end"]["full"]
    return {
        "replan_wall_s": full["wall_s"],
        "replan_weights_moved": full["weights_moved"],
        "replan_layers_kept": full.get("layers_kept", 0),
        **figures,
    }


def _probe_round(case: Case, replicas: list[ReplicaId]) -> dict:
    """Probing ``replicas`` once: calls and bytes (the monitor's batching, ``measure.batches``) and simulated time
    (groups ``probe_concurrency`` at a time, bounded by the orchestrator's NIC)."""
    model, costs, config = case.model, case.costs, case.health
    row_bytes = model.hidden_size * model.dtype_bytes
    per_group: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for rid in replicas:
        per_group[rid.group][rid.layer].append(rid.expert)
    group_s, calls, sent = {}, 0, 0
    for g, layers in per_group.items():
        g_calls = sum(
            len(measure.batches(experts, config.tokens, row_bytes, config.probe_batch_bytes))
            for experts in layers.values()
        )
        g_rows = sum(len(experts) for experts in layers.values()) * config.tokens
        g_bytes = 2 * g_rows * row_bytes  # probe rows out, partial sums back, same shape [rows, H]
        group_s[g] = (
            g_calls * costs.rpc_s
            + g_bytes / costs.group_net_bytes_s
            + g_rows * model.expert_flops_per_token / costs.gpu_flops
        )
        calls += g_calls
        sent += g_bytes
    ordered = sorted(group_s.values(), reverse=True)
    waves = [ordered[i : i + config.probe_concurrency] for i in range(0, len(ordered), config.probe_concurrency)]
    probe_s = max(sum(max(w) for w in waves), sent / costs.orchestrator_net_bytes_s) if ordered else 0.0
    return {"replicas": len(replicas), "probe_calls": calls, "probe_bytes": sent, "probe_sim_s": probe_s}


def _sampled_rounds(case: Case, replicas: list[ReplicaId]) -> tuple[list[ReplicaId], int]:
    """The replicas of one sampled round in steady state (every replica healthy, checked once) within
    ``case.sampled_round_rows``, and the rounds until every replica was checked again (``health.sampling``)."""
    records = {rid: replace(ReplicaRecord(rid), last_check=1.0) for rid in replicas}
    tokens, budget = case.health.tokens, case.sampled_round_rows
    first = set(sampling.layers_for_round(replicas, records, tokens, budget))
    unchecked, rounds = {rid.layer for rid in replicas}, 0
    while unchecked:
        rounds += 1
        chosen = set(sampling.layers_for_round(replicas, records, tokens, budget))
        unchecked -= chosen
        for rid in replicas:
            if rid.layer in chosen:
                records[rid] = replace(records[rid], last_check=1.0 + rounds)
    return [rid for rid in replicas if rid.layer in first], rounds


def _health_round(case: Case, table: RoutingTable) -> dict:
    """One health-monitor round over every replica (as by default), and one sampled round within
    ``case.sampled_round_rows`` probe rows: probe calls and bytes, simulated probe time, the monitor's CPU
    (summarising and judging, measured), and the rounds a sampled monitor takes to check every replica."""
    model, config = case.model, case.health
    replicas = [ReplicaId(l, e, g) for (l, e), names in table.replicas.items() for g in names]
    # Measured: the monitor summarises every replica's probe output [tokens, H] (one timed, times the replicas)
    # and judges every replica (all of them timed, on the real policy).
    out = torch.randn(config.tokens, model.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    measure.summarise(out)  # the first call pays torch's warm-up, not the monitor's work
    started = time.perf_counter()
    summary = measure.summarise(out)
    summarise_wall_s = time.perf_counter() - started
    base = measure.baseline(summary, "fp", 0.0, config.histogram_bins, "probe")
    check = Check(0.0, "fp", True, "probe", "seeded", 0, 0, summary.norm_mean, None, base, None, 1)

    def judge(subset: list[ReplicaId]) -> float:
        started = time.perf_counter()
        records = {rid: health_policy.judge(ReplicaRecord(rid), check, config)[0] for rid in subset}
        health_policy.plan_table(table, records)
        return time.perf_counter() - started

    full = _probe_round(case, replicas)
    subset, rounds = _sampled_rounds(case, replicas)
    sampled = _probe_round(case, subset)
    return {
        **full,
        "summarise_wall_s": summarise_wall_s * len(replicas),
        "judge_wall_s": judge(replicas),
        "interval_s": config.interval_s,
        "sampled": {
            **sampled,
            "round_probe_rows": case.sampled_round_rows,
            "summarise_wall_s": summarise_wall_s * len(subset),
            "judge_wall_s": judge(subset),
            "rounds_to_cover": rounds,
            "hours_to_cover": rounds * config.interval_s / HOUR,
        },
    }
