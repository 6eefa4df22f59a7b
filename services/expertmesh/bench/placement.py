"""``expertmesh bench placement``: the planner against the EPLB baseline.

Synthetic workloads, seeded so every run sees the same numbers:

* loads: per layer, a Zipf popularity (``1 / rank**skew``) over a random
  permutation of the experts;
* co-activation clustered by domain: tokens come from ``num_domains`` domains,
  each boosting its own block of experts; with ``q_d`` domain d's expert
  distribution and ``pi_d`` its token fraction, ``load = T k sum_d pi_d q_d`` and
  ``coactivation = T k (k - 1) sum_d pi_d q_d q_d^T`` (independent picks);
* a previous placement: the planner's plan for the same workload drifted
  (half of the layers' popularity re-drawn), to count weights moved;
* domain-skewed cases (``affinity_cases``): fewer domains, each boosting its
  block much harder; the planner gets a domain affinity measured on one sample
  of tokens (as profiles would be) and is scored on another: expert groups (one
  per GPU) touched per token, counted over sampled tokens (top-k without
  replacement from the domain's expert distribution, a replica by share).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import numpy as np

from expertmesh.contracts.topology import Gpu, Island, Node, Topology
from expertmesh.orchestrator.placement.affinity import DomainAffinity, affinity_from_counts
from expertmesh.orchestrator.placement.eplb import eplb_shares
from expertmesh.orchestrator.placement.planner import PlanOptions, plan
from expertmesh.orchestrator.placement.quality import Summary, summarize
from expertmesh.orchestrator.placement.stats import LoadStats

DOMAIN_BOOST = 8.0


@dataclass(frozen=True)
class _Shape:
    """The cluster and model of a benchmark case."""

    name: str
    nodes: int
    islands_per_node: int
    gpus_per_island: int
    num_layers: int
    num_experts: int
    top_k: int
    redundant: int

    def topology(self) -> Topology:
        return grid_topology(self.nodes, self.islands_per_node, self.gpus_per_island)


@dataclass(frozen=True)
class Case(_Shape):
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
    pi, q = synthetic_domains(num_layers, num_experts, skew, num_domains, seed)
    return _expected_stats(pi, q, top_k, tokens)


def synthetic_domains(
    num_layers: int, num_experts: int, skew: float, num_domains: int, seed: int, boost_factor: float = DOMAIN_BOOST
) -> tuple[np.ndarray, np.ndarray]:
    """pi [L, D] each domain's token fraction, q [L, D, E] each domain's expert distribution."""
    rng = np.random.default_rng(seed)
    zipf = 1.0 / np.arange(1, num_experts + 1) ** skew
    popularity = np.stack([rng.permutation(zipf) for _ in range(num_layers)])  # [L, E]
    block = max(1, num_experts // num_domains)
    boost = np.ones((num_layers, num_domains, num_experts))
    for layer in range(num_layers):
        perm = rng.permutation(num_experts)
        for d in range(num_domains):
            boost[layer, d, perm[d * block : (d + 1) * block]] = boost_factor
    q = popularity[:, None, :] * boost
    q /= q.sum(axis=2, keepdims=True)  # [L, D, E]
    pi = rng.dirichlet(np.full(num_domains, 4.0), size=num_layers)  # [L, D]
    return pi, q


def _expected_stats(pi: np.ndarray, q: np.ndarray, top_k: int, tokens: float) -> LoadStats:
    num_layers, _, num_experts = q.shape
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
    topo = case.topology()
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


def results_json(results: list[CaseResult], seed: int, affinity: list[AffinityResult] | None = None) -> str:
    return json.dumps(
        {"seed": seed, "cases": [asdict(r) for r in results], "affinity_cases": [asdict(r) for r in affinity or []]},
        indent=2,
    )


# --- domain-skewed traffic: groups touched per token with and without affinity --------------------


@dataclass(frozen=True)
class AffinityCase(_Shape):
    num_domains: int
    domain_boost: float  # how much more a domain's own block of experts is chosen
    balance_tolerance: float
    tokens: int = 5000  # sampled per layer, once to profile and once to score
    skew: float = 1.0


@dataclass(frozen=True)
class AffinitySummary:
    groups_per_token: float  # distinct GPUs one token's top-k reaches, mean over tokens and layers
    balancedness: float
    max_gpu_load: float  # summed over layers


@dataclass(frozen=True)
class AffinityResult:
    case: AffinityCase
    without: AffinitySummary
    with_affinity: AffinitySummary


def affinity_cases(quick: bool) -> list[AffinityCase]:
    if quick:
        return [AffinityCase("quick-domains", 1, 2, 2, 2, 16, 2, 4, 4, 30.0, 0.05, tokens=1000)]
    return [
        AffinityCase("domains4-64e-8gpu-tol0", 1, 1, 8, 8, 64, 4, 8, 4, 30.0, 0.0),
        AffinityCase("domains4-64e-8gpu-tol0.05", 1, 1, 8, 8, 64, 4, 8, 4, 30.0, 0.05),
        AffinityCase("domains8-128e-16gpu-tol0.05", 2, 1, 8, 8, 128, 8, 16, 8, 30.0, 0.05),
    ]


def sample_choices(
    pi: np.ndarray, q: np.ndarray, top_k: int, tokens: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """pi [D], q [L, D, E] -> domain [T] of each token and experts [L, T, k] it chose (without replacement)."""
    domain = rng.choice(pi.size, size=tokens, p=pi)
    keys = np.log(q[:, domain]) + rng.gumbel(size=(q.shape[0], tokens, q.shape[2]))  # Gumbel top-k
    return domain, np.argpartition(-keys, top_k - 1, axis=2)[:, :, :top_k]


def sampled_groups_per_token(shares: np.ndarray, experts: np.ndarray, u: np.ndarray) -> float:
    """shares [L, E, G], experts [L, T, k], u [L, T, k] uniforms picking a replica by share."""
    cum = np.cumsum(shares, axis=2)
    cum /= cum[:, :, -1:]
    gpu = (u[..., None] >= cum[np.arange(shares.shape[0])[:, None, None], experts]).sum(axis=3)  # [L, T, k]
    gpu = np.sort(gpu, axis=2)
    return float((1 + (np.diff(gpu, axis=2) != 0).sum(axis=2)).mean())


def run_affinity_case(case: AffinityCase, seed: int) -> AffinityResult:
    topo = case.topology()
    pi, q = synthetic_domains(case.num_layers, case.num_experts, case.skew, case.num_domains, seed, case.domain_boost)
    mix = pi[0]  # a token keeps its domain through every layer
    stats = _expected_stats(np.broadcast_to(mix, pi.shape), q, case.top_k, float(case.tokens))
    rng = np.random.default_rng(seed + 1)
    domain, picks = sample_choices(mix, q, case.top_k, case.tokens, rng)
    counts = np.zeros((case.num_layers, case.num_domains, case.num_experts))
    np.add.at(counts, (np.arange(case.num_layers)[:, None, None], domain[None, :, None], picks), 1.0)
    affinity: DomainAffinity = affinity_from_counts(tuple(f"d{d}" for d in range(case.num_domains)), counts)
    _, picks = sample_choices(mix, q, case.top_k, case.tokens, rng)  # scored on tokens the profile never saw
    u = rng.random(picks.shape)
    options = PlanOptions(redundant=case.redundant, balance_tolerance=case.balance_tolerance)

    def summary(shares: np.ndarray) -> AffinitySummary:
        s = summarize(stats.load, None, np.zeros(topo.num_gpus, dtype=int), np.zeros(topo.num_gpus, dtype=int), shares)
        return AffinitySummary(sampled_groups_per_token(shares, picks, u), s.balancedness, s.max_gpu_load)

    return AffinityResult(
        case,
        summary(plan(stats, topo, options).placement.shares),
        summary(plan(stats, topo, options, affinity=affinity).placement.shares),
    )


def affinity_table(results: list[AffinityResult]) -> str:
    head = f"{'domain-skewed case':<36} {'affinity':>8} {'groups/token':>13} {'balanced':>9} {'max load':>12}"
    lines = [head, "-" * len(head)]
    for r in results:
        for label, s in (("off", r.without), ("on", r.with_affinity)):
            lines.append(
                f"{r.case.name:<36} {label:>8} {s.groups_per_token:>13.3f} "
                f"{s.balancedness:>9.4f} {s.max_gpu_load:>12.0f}"
            )
    return "\n".join(lines)
