"""The planner's figures of one scale case: a full re-plan against the incremental planner, on the day's
last load, and one GPU (one expert group) added or removed.

Each figure is one call of the real planner, timed (wall and this process's CPU), with the plan's
balancedness, cross-island fraction and the weights it moves from the placement it started from.
*full* is ``planner.plan`` (given the current placement where the GPU set allows it), *incremental*
``incremental.replan``. The group changes start from the full re-plan of the day's last load, so they
measure the change alone, not the day's drift.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from expertmesh.contracts.gpu_plan import Placement
from expertmesh.contracts.topology import Gpu, Island, Node, Topology
from expertmesh.orchestrator.placement.incremental import carry, replan
from expertmesh.orchestrator.placement.planner import PlanOptions, plan
from expertmesh.orchestrator.placement.quality import summarize
from expertmesh.orchestrator.placement.stats import LoadStats

__all__ = ["planner_figures", "with_gpu_added", "with_gpu_removed"]


def with_gpu_added(topology: Topology) -> Topology:
    """``topology`` and one more node of one GPU (``groups add --gpus 1`` on a new machine)."""
    gpu = Gpu(max(s.gpu.id for s in topology.sites()) + 1, topology.nodes[-1].islands[0].gpus[0].memory_gb, 0)
    return Topology((*topology.nodes, Node(f"node-added-{gpu.id}", (Island("nvl-0", (gpu,), 0),))))


def with_gpu_removed(topology: Topology) -> Topology:
    """``topology`` less the last GPU of its last island (``groups remove`` of a one-GPU group)."""
    node = topology.nodes[-1]
    island = node.islands[-1]
    if len(island.gpus) > 1:
        islands = (*node.islands[:-1], replace(island, gpus=island.gpus[:-1]))
    else:
        islands = node.islands[:-1]
    nodes = (*topology.nodes[:-1], replace(node, islands=islands)) if islands else topology.nodes[:-1]
    return Topology(nodes)


def _timed(fn, *args, **kwargs):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - wall, time.process_time() - cpu


def _figures(result, wall: float, cpu: float, stats: LoadStats, topology: Topology, before: Placement) -> dict:
    sites = topology.sites()
    island = np.array([s.island for s in sites])
    node = np.array([s.node for s in sites])
    placement = result.placement
    summary = summarize(
        stats.load, stats.coactivation, island, node, placement.shares, carry(before, placement.gpu_ids)
    )
    out = {
        "wall_s": wall,
        "cpu_s": cpu,
        "balancedness": summary.balancedness,
        "cross_island": summary.cross_island,
        "weights_moved": summary.weights_moved,
        "replicas": int((placement.shares > 0).sum()),
    }
    if hasattr(result, "layers_replanned"):
        out["layers_replanned"] = len(result.layers_replanned)
    else:
        out["layers_kept"] = result.layers_kept
    return out


def _usable(current: np.ndarray, slots: int) -> bool:
    """Whether ``plan`` may take ``current`` [L, E, G] as the current placement (every expert held, slots kept)."""
    return bool(((current > 0).sum(axis=2) >= 1).all() and (current > 0).sum(axis=1).max() <= slots)


def _full(stats: LoadStats, topology: Topology, options: PlanOptions, before: Placement) -> tuple:
    gpu_ids = tuple(s.gpu.id for s in topology.sites())
    current = carry(before, gpu_ids)
    slots = -(-(stats.num_experts + options.redundant) // len(gpu_ids))
    given = Placement(gpu_ids, current) if _usable(current, slots) else None
    return _timed(plan, stats, topology, options, current=given)


def _compare(stats: LoadStats, topology: Topology, options: PlanOptions, before: Placement) -> tuple[dict, Placement]:
    """Both planners from ``before``: their figures, and the full plan's placement."""
    result, wall, cpu = _full(stats, topology, options, before)
    full = _figures(result, wall, cpu, stats, topology, before)
    incremental = _figures(*_timed(replan, stats, topology, options, before), stats, topology, before)
    return {"full": full, "incremental": incremental}, result.placement


def planner_figures(
    stats: LoadStats, topology: Topology, options: PlanOptions, current: Placement, *, per_gpu_redundant: bool
) -> dict:
    """The day-end re-plan from ``current`` (full and incremental), then one GPU added and one removed from
    the full re-plan. ``per_gpu_redundant``: the redundant count follows the GPU count (one per GPU)."""
    figures, start = {}, current
    figures["day_end"], start = _compare(stats, topology, options, current)
    for name, changed in (("gpu_added", with_gpu_added(topology)), ("gpu_removed", with_gpu_removed(topology))):
        opts = options
        if per_gpu_redundant:
            opts = replace(options, redundant=options.redundant + changed.num_gpus - topology.num_gpus)
        figures[name], _ = _compare(stats, changed, opts, start)
    return figures
