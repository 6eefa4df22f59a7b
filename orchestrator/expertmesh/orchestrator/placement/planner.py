"""The placement planner: a pure function from load statistics and topology to a placement.

Objectives, in order:

1. balancedness (see ``metrics``) at least as good as DeepSeek's EPLB with the
   same redundant slots on the same stats, per layer, hence also summed;
2. with a domain affinity (``affinity``): fewest expert groups touched per token,
   within ``balance_tolerance`` of the balanced plan's max GPU load and never
   above EPLB's;
3. then fewest co-activated expert pairs split across NVLink islands and nodes;
4. given the current placement, fewest expert weights moved for the balancedness
   asked for (``min_gain``).

How, per layer (vectorised over layers where it pays):

* candidates: EPLB's own placement, and a flat one (replica counts by highest
  load per replica, capped at one replica per GPU, packed heaviest-first onto the
  lightest GPU that has a free slot and no replica of that expert yet);
* share water-filling on each: an expert's tokens are re-split across its
  replicas so the GPUs they sit on reach one level. A replica whose GPU is
  already above that level gets share 0 and is dropped. This never raises a
  GPU above the old maximum, so a candidate is never worse than where it began;
* island placement of each candidate: whole GPU contents are exchanged between
  islands/nodes while that keeps more co-activated weight inside one island and
  node; an exchange moves no load between contents, so balancedness is untouched
  (slots are the same on every GPU);
* the lower maximum GPU load wins (within ``balance_tolerance``, the lower
  cross-island cost wins);
* a final guard keeps EPLB's layer wherever the result came out worse, so
  objective 1 holds whatever the heuristics did;
* with an affinity, replicas are exchanged between GPUs to put experts hot in
  the same domain together (``affinity.colocate``) under a per-layer cap on the
  max GPU load, then island placement runs again on the new GPU contents.
  Without one, this step does not run and the plan is as before, bit for bit.

With a current placement, a layer whose current balancedness (after re-splitting
its shares, which moves no weights) is within ``min_gain`` of the plan's is kept.
Other layers take the plan with its GPUs renumbered inside each island to keep as
many replicas where they already are as possible (renumbering inside an island
changes neither loads nor island costs).

Everything is deterministic: ties go to the lowest index, no randomness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from expertmesh.contracts.errors import PlacementError
from expertmesh.contracts.gpu_plan import Placement
from expertmesh.contracts.topology import Topology
from expertmesh.orchestrator.placement.affinity import DomainAffinity, colocate
from expertmesh.orchestrator.placement.eplb import eplb_shares
from expertmesh.orchestrator.placement.islands import NODE_WEIGHT, relabel_gpus, renumber_within_islands
from expertmesh.orchestrator.placement.packing import greedy_pack, replicate_by_load
from expertmesh.orchestrator.placement.quality import gpu_loads, layer_balancedness, split_pair_weight
from expertmesh.orchestrator.placement.stats import LoadStats

# Loads are token counts; a relative slack this small only absorbs float rounding.
_EPS = 1e-9


@dataclass(frozen=True)
class PlanOptions:
    redundant: int
    slots_per_gpu: int | None = None  # default ceil((E + redundant) / num_gpus)
    min_gain: float = 0.0  # keep a current layer within this balancedness of the plan's
    balance_tolerance: float = 0.0  # relative max-load slack traded for fewer split pairs and groups per token
    eplb_groups: int = 1  # gating groups (DeepSeek's n_group) for the EPLB baseline's hierarchical policy
    refine_swaps: int = 64  # GPU-content exchanges tried per layer for island locality
    affinity_swaps: int = 128  # replica exchanges per layer for domain co-location
    repair_moves: int = 64  # incremental planner: edits per layer after its repair (``incremental.replan``)


@dataclass(frozen=True, eq=False)
class PlanResult:
    placement: Placement
    baseline: Placement  # EPLB on the same input
    slots_per_gpu: int
    layers_kept: int  # layers left as in the current placement


@dataclass(frozen=True)
class _Sites:
    gpu_ids: tuple[int, ...]
    island: np.ndarray  # [G] dense island index
    node: np.ndarray  # [G] dense node index
    gpus_per_node: list[int]


def _sites(topology: Topology) -> _Sites:
    sites = topology.sites()
    if not sites:
        raise PlacementError("topology has no GPUs")
    node = np.array([s.node for s in sites])
    return _Sites(
        tuple(s.gpu.id for s in sites),
        np.array([s.island for s in sites]),
        node,
        [int((node == n).sum()) for n in range(len(topology.nodes))],
    )


def resolve_slots(num_experts: int, redundant: int, num_gpus: int, slots_per_gpu: int | None) -> int:
    if num_gpus < 1:
        raise PlacementError("topology has no GPUs")
    if redundant < 0:
        raise PlacementError(f"--redundant must be >= 0, got {redundant}")
    if redundant > num_experts * (num_gpus - 1):
        raise PlacementError(
            f"--redundant {redundant} is more than the {num_experts * (num_gpus - 1)} extra replicas"
            f" {num_gpus} GPUs can hold without two copies of an expert on one GPU"
        )
    slots = slots_per_gpu if slots_per_gpu is not None else math.ceil((num_experts + redundant) / num_gpus)
    if slots < 1:
        raise PlacementError(f"--slots-per-gpu must be >= 1, got {slots}")
    if slots * num_gpus < num_experts + redundant:
        raise PlacementError(
            f"too few slots: {num_gpus} GPUs x {slots} slots = {slots * num_gpus} < {num_experts} experts"
            f" + {redundant} redundant replicas per layer"
        )
    return slots


def plan(
    stats: LoadStats,
    topology: Topology,
    options: PlanOptions,
    current: Placement | None = None,
    affinity: DomainAffinity | None = None,
) -> PlanResult:
    sites = _sites(topology)
    G, E = len(sites.gpu_ids), stats.num_experts
    slots = resolve_slots(E, options.redundant, G, options.slots_per_gpu)
    if affinity is not None:
        affinity.check_shape(stats.num_layers, E)
    if current is not None and (current.shares.shape != (stats.num_layers, E, G) or current.gpu_ids != sites.gpu_ids):
        raise PlacementError("current placement does not match the stats' layers/experts and the topology's GPUs")
    load = stats.load
    coact = _off_diagonal(stats.coactivation)

    eplb = eplb_shares(load, options.redundant, sites.gpus_per_node, options.eplb_groups)
    candidates = [eplb, _flat_candidate(load, options.redundant, G, slots)]
    candidates = [waterfill(load, c) for c in candidates]
    if coact is not None and sites.island.max() > 0:
        candidates = [relabel_gpus(c, coact, sites.island, sites.node, options.refine_swaps) for c in candidates]
    best = _pick(load, coact, sites, candidates, options.balance_tolerance)
    # Guard: never worse than EPLB on any layer, whatever the heuristics did.
    worse = gpu_loads(load, best).max(axis=1) > gpu_loads(load, eplb).max(axis=1)
    best[worse] = eplb[worse]
    if affinity is not None:
        top = gpu_loads(load, best).max(axis=1)
        cap = np.minimum(top * (1 + options.balance_tolerance), np.maximum(top, gpu_loads(load, eplb).max(axis=1)))
        best = colocate(load, best, affinity, stats.top_k, slots, cap, options.affinity_swaps)
        if coact is not None and sites.island.max() > 0:
            best = relabel_gpus(best, coact, sites.island, sites.node, options.refine_swaps)

    kept = 0
    if current is not None:
        best, kept = _respect_current(load, current.shares, best, sites, slots, options.min_gain)
    return PlanResult(Placement(sites.gpu_ids, best), Placement(sites.gpu_ids, eplb), slots, kept)


def _off_diagonal(coact: np.ndarray | None) -> np.ndarray | None:
    if coact is None:
        return None
    out = coact.astype(np.float64, copy=True)
    idx = np.arange(out.shape[1])
    out[:, idx, idx] = 0.0
    return out


# --- balance ------------------------------------------------------------------------------------


def _flat_candidate(load: np.ndarray, redundant: int, num_gpus: int, slots: int) -> np.ndarray:
    L, E = load.shape
    count = replicate_by_load(load, redundant, max_replicas=num_gpus)  # [L, E]
    n = E + redundant
    item_expert = np.stack([np.repeat(np.arange(E), count[l]) for l in range(L)])  # [L, n]
    item_weight = np.take_along_axis(load / count, item_expert, axis=1)
    pack, _ = greedy_pack(item_weight, num_gpus, slots, item_expert, E)
    shares = np.zeros((L, E, num_gpus))
    rows = np.broadcast_to(np.arange(L)[:, None], (L, n))
    placed = pack >= 0
    shares[rows[placed], item_expert[placed], pack[placed]] = 1.0
    # Conflicts can leave a replica unplaced; its expert's other replicas take its share.
    return shares / shares.sum(axis=2, keepdims=True)


def waterfill(load: np.ndarray, shares: np.ndarray, passes: int = 3) -> np.ndarray:
    """Re-split each multi-replica expert's tokens so its replicas' GPUs level out.

    One expert at a time (vectorised over layers): with ``base[g]`` the GPU load
    without this expert, find the level h with sum over its GPUs of
    max(0, h - base[g]) = its load; h = min over k of (load + sum of the k lowest
    bases) / k. No GPU ends above max(old loads of its GPUs).
    """
    shares = shares.copy()
    L, E, G = shares.shape
    loads = gpu_loads(load, shares)
    k = np.arange(1, G + 1)
    for _ in range(passes):
        multi = ((shares > 0).sum(axis=2) > 1) & (load > 0)  # [L, E]
        for e in np.flatnonzero(multi.any(axis=0)):
            rows = multi[:, e]
            w, s = load[rows, e], shares[rows, e]  # [R], [R, G]
            mask = s > 0
            base = loads[rows] - w[:, None] * s
            ordered = np.sort(np.where(mask, base, np.inf), axis=1)
            csum = np.cumsum(np.where(np.isfinite(ordered), ordered, 0.0), axis=1)
            level = np.where(k <= mask.sum(axis=1)[:, None], (w[:, None] + csum) / k, np.inf).min(axis=1)
            new = np.where(mask, np.maximum(level[:, None] - base, 0.0), 0.0)
            new /= new.sum(axis=1, keepdims=True)
            new[new < 1e-12] = 0.0  # a replica above the level is dropped, freeing its slot
            new /= new.sum(axis=1, keepdims=True)
            shares[rows, e] = new
            loads[rows] = base + w[:, None] * new
    return shares


def _cost(load: np.ndarray, coact: np.ndarray | None, sites: _Sites, shares: np.ndarray) -> np.ndarray:
    """[L] co-activated weight split across islands plus across nodes."""
    if coact is None:
        return np.zeros(load.shape[0])
    return split_pair_weight(coact, shares, sites.island) + NODE_WEIGHT * split_pair_weight(coact, shares, sites.node)


def _pick(load, coact, sites: _Sites, candidates: list[np.ndarray], tolerance: float) -> np.ndarray:
    tops = np.stack([gpu_loads(load, c).max(axis=1) for c in candidates])  # [C, L]
    costs = np.stack([_cost(load, coact, sites, c) for c in candidates])  # [C, L]
    fit = tops <= tops.min(axis=0) * (1 + tolerance) + _EPS
    # Among candidates within tolerance of the lowest max: lowest cost, then lowest max, then first.
    key = np.where(fit, costs, np.inf)
    choice = np.lexsort((tops, key), axis=0)[0]
    return np.stack(candidates)[choice, np.arange(load.shape[0])]


# --- current placement --------------------------------------------------------------------------


def _respect_current(load, current, best, sites: _Sites, slots: int, min_gain: float) -> tuple[np.ndarray, int]:
    out = renumber_within_islands(current, best, sites.island, sites.node)
    cur = waterfill(load, current)
    cur_bal, new_bal = layer_balancedness(load, cur), layer_balancedness(load, out)
    keep = (cur_bal >= new_bal - min_gain - _EPS) & ((cur > 0).sum(axis=1).max(axis=1) <= slots)
    out[keep] = cur[keep]
    return out, int(keep.sum())
