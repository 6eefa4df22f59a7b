"""``expertmesh bench placement``: the planner against the EPLB baseline.

Synthetic workloads, seeded so every run sees the same numbers:

* loads: per layer, a Zipf popularity (``1 / rank**skew``) over a random
  permutation of the experts;
* co-activation clustered by domain: tokens come from ``num_domains`` domains,
  each boosting its own block of experts; with ``q_d`` domain d's expert
  distribution and ``pi_d`` its token fraction, ``load = T k sum_d pi_d q_d`` and
  ``coactivation = T k (k - 1) sum_d pi_d q_d q_d^T`` (independent picks);
* a previous placement: the planner's plan for the same workload drifted
  (half of the layers' popularity re-drawn), to count weights moved.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import numpy as np

from expertmesh.orchestrator.placement.eplb import eplb_shares
from expertmesh.orchestrator.placement.metrics import Summary, summarize
from expertmesh.orchestrator.placement.planner import PlanOptions, plan
from expertmesh.orchestrator.placement.stats import LoadStats
from expertmesh.orchestrator.topology import Gpu, Island, Node, Topology

DOMAIN_BOOST = 8.0


@dataclass(frozen=True)
class Case:
    name: str
    nodes: int
    islands_per_node: int
    gpus_per_island: int
    num_layers: int
    num_experts: int
    top_k: int
    redundant: int
    skew: float
    num_domains: int = 8
    eplb_groups: int = 1


@dataclass(frozen=True)
class CaseResult:
    case: Case
    planner: Summary
    eplb: Summary


def grid_topology(nodes: int, islands_per_node: int, gpus_per_island: int, memory_gb: float = 80.0) -> Topology:
    gid = iter(range(nodes * islands_per_node * gpus_per_island))
    return Topology(
        tuple(
            Node(
                f"node-{n}",
                tuple(
                    Island(f"nvl-{i}", tuple(Gpu(next(gid), memory_gb, i) for _ in range(gpus_per_island)), i)
                    for i in range(islands_per_node)
                ),
            )
            for n in range(nodes)
        )
    )


def synthetic_stats(
    num_layers: int, num_experts: int, top_k: int, skew: float, num_domains: int, seed: int, tokens: float = 1e5
) -> LoadStats:
    rng = np.random.default_rng(seed)
    zipf = 1.0 / np.arange(1, num_experts + 1) ** skew
    popularity = np.stack([rng.permutation(zipf) for _ in range(num_layers)])  # [L, E]
    block = max(1, num_experts // num_domains)
    boost = np.ones((num_layers, num_domains, num_experts))
    for layer in range(num_layers):
        perm = rng.permutation(num_experts)
        for d in range(num_domains):
            boost[layer, d, perm[d * block : (d + 1) * block]] = DOMAIN_BOOST
    q = popularity[:, None, :] * boost
    q /= q.sum(axis=2, keepdims=True)  # [L, D, E]
    pi = rng.dirichlet(np.full(num_domains, 4.0), size=num_layers)  # [L, D]
    load = np.round(tokens * top_k * np.einsum("ld,lde->le", pi, q))
    coact = tokens * top_k * (top_k - 1) * np.einsum("ld,lde,ldf->lef", pi, q, q)
    coact = np.round((coact + coact.transpose(0, 2, 1)) / 2)
    idx = np.arange(num_experts)
    coact[:, idx, idx] = 0.0
    return LoadStats(num_layers, num_experts, top_k, load, coact)


def cases(quick: bool) -> list[Case]:
    if quick:
        return [
            Case("quick-1node", 1, 2, 2, 2, 16, 2, 4, 1.0, 4),
            Case("quick-2node", 2, 1, 4, 2, 16, 2, 4, 1.0, 4),
        ]
    out = []
    for nodes, islands, experts in ((1, 2, 64), (2, 1, 128), (8, 1, 256)):
        gpus = nodes * islands * (8 // islands)
        for skew in (0.6, 1.0, 1.4):
            out.append(Case(f"{nodes}node-zipf{skew}", nodes, islands, 8 // islands, 12, experts, 8, gpus // 2, skew))
    # DeepSeek-V3 shape: 61 MoE layers x 256 experts, top-8, 8 expert groups, 64 GPUs, 32 redundant.
    out.append(Case("dsv3-61x256-64gpu", 8, 1, 8, 61, 256, 8, 32, 1.0, 8, eplb_groups=8))
    return out


def run_case(case: Case, seed: int) -> CaseResult:
    topo = grid_topology(case.nodes, case.islands_per_node, case.gpus_per_island)
    sites = topo.sites()
    island = np.array([s.island for s in sites])
    node = np.array([s.node for s in sites])
    stats = synthetic_stats(case.num_layers, case.num_experts, case.top_k, case.skew, case.num_domains, seed)
    options = PlanOptions(redundant=case.redundant, eplb_groups=case.eplb_groups)
    previous = plan(_drifted(stats, seed + 1), topo, options).placement

    start = time.perf_counter()
    result = plan(stats, topo, options, current=previous)
    plan_s = time.perf_counter() - start
    start = time.perf_counter()
    eplb = eplb_shares(stats.load, case.redundant, [topo.num_gpus // case.nodes] * case.nodes, case.eplb_groups)
    eplb_s = time.perf_counter() - start

    def summary(shares: np.ndarray, seconds: float) -> Summary:
        return summarize(stats.load, stats.coactivation, island, node, shares, previous.shares, seconds)

    return CaseResult(case, summary(result.placement.shares, plan_s), summary(eplb, eplb_s))


def _drifted(stats: LoadStats, seed: int) -> LoadStats:
    other = synthetic_stats(stats.num_layers, stats.num_experts, stats.top_k, 1.0, 8, seed)
    half = np.arange(stats.num_layers) % 2 == 1
    load = np.where(half[:, None], other.load, stats.load)
    coact = np.where(half[:, None, None], other.coactivation, stats.coactivation)
    return LoadStats(stats.num_layers, stats.num_experts, stats.top_k, load, coact)


def format_rows(rows: list[tuple[str, Summary]]) -> str:
    """The comparison table: one row per (case, algorithm)."""
    head = f"{'case':<30} {'balanced':>9} {'x-island':>9} {'x-node':>8} {'max load':>12} {'moved':>7} {'time s':>8}"
    lines = [head, "-" * len(head)]
    for label, s in rows:
        moved = "-" if s.weights_moved is None else str(s.weights_moved)
        lines.append(
            f"{label:<30} {s.balancedness:>9.4f} {s.cross_island:>9.4f} {s.cross_node:>8.4f}"
            f" {s.max_gpu_load:>12.0f} {moved:>7} {s.plan_seconds:>8.3f}"
        )
    return "\n".join(lines)


def run_bench(quick: bool, seed: int) -> list[CaseResult]:
    return [run_case(case, seed) for case in cases(quick)]


def results_table(results: list[CaseResult]) -> str:
    rows = []
    for r in results:
        rows.append((f"{r.case.name} planner", r.planner))
        rows.append((f"{r.case.name} eplb", r.eplb))
    return format_rows(rows)


def results_json(results: list[CaseResult], seed: int) -> str:
    return json.dumps({"seed": seed, "cases": [asdict(r) for r in results]}, indent=2)
