"""The incremental planner: a new placement from the previous one, re-planning only the layers that need it.

Glossary
--------
carried placement
    The previous placement's replicas on the GPUs the topology still has (``carry``); a removed
    GPU's replicas are gone, an added GPU starts empty.
repair
    Per layer, the fewest edits that make a carried layer valid again: every expert with no
    replica left gets one (heaviest first, on the lightest GPU with a free slot), a GPU over its
    slots gives up replicas, the layer's replica count comes back within ``E + redundant``.
local search
    Then, in a layer below the bar, at most ``PlanOptions.repair_moves`` edits until it reaches the
    bar (less ``min_gain``), each lowering the hottest GPU: move one of its replicas to a GPU with a
    free slot, add a replica of one of its experts there (within the redundant budget), or exchange
    one with a lighter replica elsewhere. Each edit copies one expert's weights (an exchange two), so
    the weights moved stay proportional to the change, not to the cluster. Shares are then re-split
    by water-filling (``planner.waterfill``); the search is kept only where that helped.
bar
    The balancedness the full planner reaches on a layer: the better of its two balance-only
    candidates (EPLB's and the flat placement, both water-filled). A layer within
    ``PlanOptions.min_gain`` of it is kept; the others are re-planned in full (``planner.plan``, the
    repaired layer as its current placement, so it still keeps what it can). With ``min_gain`` 0
    every layer is as balanced as the full plan's. A kept layer keeps its island and domain
    co-location as it was (no ``relabel_gpus``, no ``colocate``): those moves would copy weights.

So one group added or removed costs a repair and a short search per layer plus the two balance
candidates (no island refinement) unless a layer falls below the bar; a load change re-plans only
the layers it unbalanced. Pure and deterministic: plain arrays in, a placement out; ties go to the
lowest index.

Example: ``replan(stats, topology_with_one_more_gpu, PlanOptions(redundant=257), previous.placement)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from expertmesh.contracts.errors import PlacementError
from expertmesh.contracts.gpu_plan import Placement
from expertmesh.contracts.topology import Topology
from expertmesh.orchestrator.placement.affinity import DomainAffinity
from expertmesh.orchestrator.placement.eplb import eplb_shares
from expertmesh.orchestrator.placement.planner import (
    PlanOptions,
    _flat_candidate,
    _sites,
    plan,
    resolve_slots,
    waterfill,
)
from expertmesh.orchestrator.placement.quality import layer_balancedness
from expertmesh.orchestrator.placement.stats import LoadStats

__all__ = ["ReplanResult", "carry", "replan"]

# Loads are token counts; a relative slack this small only absorbs float rounding.
_EPS = 1e-9


@dataclass(frozen=True, eq=False)
class ReplanResult:
    placement: Placement
    baseline: Placement  # EPLB on the same input
    slots_per_gpu: int
    #: layers re-planned in full (below the bar after repair), ascending
    layers_replanned: tuple[int, ...]
    #: per layer: replicas on a GPU that did not hold them in the previous placement (weights to copy)
    moved: np.ndarray  # [L] int


def carry(previous: Placement, gpu_ids: tuple[int, ...]) -> np.ndarray:
    """previous's shares [L, E, G_prev] -> [L, E, len(gpu_ids)] by GPU id; GPUs not in ``previous`` are empty."""
    column = {g: i for i, g in enumerate(previous.gpu_ids)}
    out = np.zeros((previous.num_layers, previous.num_experts, len(gpu_ids)))
    for i, g in enumerate(gpu_ids):
        if g in column:
            out[:, :, i] = previous.shares[:, :, column[g]]
    return out


def replan(
    stats: LoadStats,
    topology: Topology,
    options: PlanOptions,
    previous: Placement,
    affinity: DomainAffinity | None = None,
) -> ReplanResult:
    """A placement over ``topology``'s GPUs for ``stats``, starting from ``previous`` (any GPU set)."""
    sites = _sites(topology)
    G, L, E = len(sites.gpu_ids), stats.num_layers, stats.num_experts
    slots = resolve_slots(E, options.redundant, G, options.slots_per_gpu)
    if (previous.num_layers, previous.num_experts) != (L, E):
        raise PlacementError(
            f"previous placement covers {previous.num_layers} layers x {previous.num_experts} experts,"
            f" the stats {L} x {E}"
        )
    if affinity is not None:
        affinity.check_shape(L, E)
    load = stats.load
    carried = carry(previous, sites.gpu_ids)
    budget = E + options.redundant
    has = np.stack([_repair_layer(load[layer], carried[layer] > 0, slots, budget) for layer in range(L)])  # [L, E, G]
    repaired = waterfill(load, _start_shares(carried, has))

    eplb = eplb_shares(load, options.redundant, sites.gpus_per_node, options.eplb_groups)
    candidates = [eplb, _flat_candidate(load, options.redundant, G, slots)]
    bar = np.stack([layer_balancedness(load, waterfill(load, c)) for c in candidates]).max(axis=0)  # [L]
    low = np.flatnonzero(layer_balancedness(load, repaired) < bar - _EPS)
    if low.size and options.repair_moves:
        # Stop at the bar: equal shares are a split water-filling only improves on, so that much is enough.
        goal = np.maximum(bar - options.min_gain, _EPS)
        enough = load.sum(axis=1) / G / goal  # [L] the max GPU load that reaches it
        searched = np.stack(
            [
                _search_layer(load[layer], has[layer], slots, budget, options.repair_moves, enough[layer])
                for layer in low
            ]
        )
        tried = waterfill(load[low], _start_shares(carried[low], searched))
        better = layer_balancedness(load[low], tried) > layer_balancedness(load[low], repaired[low]) + _EPS
        repaired[low[better]] = tried[better]
    redo = np.flatnonzero(layer_balancedness(load, repaired) < bar - options.min_gain - _EPS)
    out = repaired
    if redo.size:
        sub = LoadStats(
            redo.size,
            E,
            stats.top_k,
            load[redo],
            None if stats.coactivation is None else stats.coactivation[redo],
        )
        sub_affinity = (
            None if affinity is None else DomainAffinity(affinity.domains, affinity.share[redo], affinity.weight)
        )
        result = plan(sub, topology, options, current=Placement(sites.gpu_ids, repaired[redo]), affinity=sub_affinity)
        out = repaired.copy()
        out[redo] = result.placement.shares
    return ReplanResult(
        Placement(sites.gpu_ids, out),
        Placement(sites.gpu_ids, eplb),
        slots,
        tuple(int(layer) for layer in redo),
        ((out > 0) & ~(carried > 0)).sum(axis=(1, 2)),
    )


# --- one layer ----------------------------------------------------------------------------------


class _Layer:
    """One layer's replicas as a bool matrix ``has`` [E, G] with equal shares (the search's estimate)."""

    def __init__(self, load: np.ndarray, has: np.ndarray, slots: int):
        self.w = load  # [E]
        self.has = has.copy()  # [E, G]
        self.slots = slots

    @property
    def count(self) -> np.ndarray:
        return self.has.sum(axis=1)  # [E]

    def per_replica(self) -> np.ndarray:
        return self.w / np.maximum(self.count, 1)  # [E]

    def gpu_load(self) -> np.ndarray:
        return self.per_replica() @ self.has  # [G]

    def free(self) -> np.ndarray:
        return self.has.sum(axis=0) < self.slots  # [G]

    def place(self, e: int) -> bool:
        """A new replica of e on the lightest GPU with a free slot that holds no e; False when none has one."""
        ok = self.free() & ~self.has[e]
        if not ok.any():
            return False
        self.has[e, int(np.argmin(np.where(ok, self.gpu_load(), np.inf)))] = True
        return True

    def drop(self, e: int) -> None:
        """e's replica on its most loaded GPU goes (e keeps another)."""
        self.has[e, int(np.argmax(np.where(self.has[e], self.gpu_load(), -np.inf)))] = False


def _repair_layer(load: np.ndarray, has: np.ndarray, slots: int, budget: int) -> np.ndarray:
    """load [E], has [E, G] carried replicas -> has [E, G] valid with the fewest edits. ``budget``: most
    replicas in the layer (E + redundant)."""
    lay = _Layer(load, has, slots)
    # A GPU over its slots gives up replicas: of an expert with others first (the most replicas), else its lightest.
    for g in np.flatnonzero(lay.has.sum(axis=0) > slots):
        while lay.has[:, g].sum() > slots:
            on = np.flatnonzero(lay.has[:, g])
            count = lay.count[on]
            e = on[np.argmax(count)] if count.max() > 1 else on[np.argmin(load[on])]
            lay.has[e, g] = False
    # Over the budget: the replica of least worth (lowest load per replica once removed) goes.
    while lay.count.sum() > budget:
        lay.drop(_least_worth(load, lay.count))
    # Experts left with no replica, heaviest first; with no free slot (or budget) left, a spare replica makes room.
    for e in sorted(np.flatnonzero(lay.count == 0), key=lambda x: (-load[x], x)):
        if lay.count.sum() >= budget or not lay.place(int(e)):
            lay.drop(_least_worth(load, lay.count))
            if not lay.place(int(e)):  # slots x GPUs >= E + redundant, so a slot is free now
                raise PlacementError(f"no GPU has room for expert {e}")
    return lay.has


def _least_worth(load: np.ndarray, count: np.ndarray) -> int:
    """The expert whose replica is worth least (lowest load per replica once one goes), among those with several."""
    return int(np.argmin(np.where(count > 1, load / np.maximum(count - 1, 1), np.inf)))


def _search_layer(load: np.ndarray, has: np.ndarray, slots: int, budget: int, moves: int, enough: float) -> np.ndarray:
    """At most ``moves`` edits, each lowering the hottest GPU (equal shares as the estimate), until no GPU is above
    ``enough`` -> has [E, G]."""
    lay = _Layer(load, has, slots)
    for _ in range(moves):
        if lay.gpu_load().max() <= enough * (1 + _EPS) or not _improve(lay, budget):
            break
    return lay.has


def _start_shares(carried: np.ndarray, has: np.ndarray) -> np.ndarray:
    """[..., E, G]: an expert whose replicas are where they were keeps its shares, another splits equally."""
    kept = np.where(has, carried, 0.0)
    count = has.sum(axis=-1, keepdims=True)
    # Same replicas: every one held before, and no other (a removed GPU's share is missing from the sum).
    same = ((kept > 0).sum(axis=-1, keepdims=True) == count) & (np.abs(kept.sum(axis=-1, keepdims=True) - 1) < 1e-9)
    return np.where(same, kept, has / np.maximum(count, 1))


def _improve(lay: _Layer, budget: int) -> bool:
    """One edit that lowers the hottest GPU (move, add within the budget, or exchange); False when none does."""
    has, w = lay.has, lay.w
    count = has.sum(axis=1)  # [E]
    per = w / np.maximum(count, 1)  # [E] each replica's load (equal shares)
    f, t = np.nonzero(has)  # [R] every replica: its expert and GPU
    loads = np.bincount(t, weights=per[f], minlength=has.shape[1])  # [G]
    h = int(np.argmax(loads))
    top = loads[h]
    if top <= 0:
        return False
    on = np.flatnonzero(has[:, h])  # experts on the hottest GPU
    x = per[on]  # [S]
    free = np.bincount(t, minlength=has.shape[1]) < lay.slots  # [G]
    best, action = top * (1 - _EPS), None
    # Move e from h to a GPU t with a free slot that holds no e.
    ok = free[None, :] & ~has[on]  # [S, G]
    after = np.where(ok, np.maximum(top - x[:, None], loads[None, :] + x[:, None]), np.inf)
    i, g = np.unravel_index(np.argmin(after), after.shape)
    if after[i, g] < best:
        best, action = after[i, g], ("move", on[i], int(g))
    # Add a replica of e on such a GPU: each GPU of e sheds w/c - w/(c+1) (none rises), t takes w/(c+1).
    if f.size < budget:
        new = w[on] / (count[on] + 1)
        after = np.where(ok, np.maximum(top - (x - new)[:, None], loads[None, :] + new[:, None]), np.inf)
        i, g = np.unravel_index(np.argmin(after), after.shape)
        if after[i, g] < best:
            best, action = after[i, g], ("add", on[i], int(g))
    # Exchange e (on h) with a replica of f on t: h takes y instead of x, t the opposite. Over the replicas only.
    y = per[f]  # [R]
    valid = (t != h) & ~has[f, h]  # [R] h holds no f
    for i, e in enumerate(on):
        ok = valid & ~has[e, t]  # t holds no e
        after = np.where(ok, np.maximum(top - x[i] + y, loads[t] - y + x[i]), np.inf)  # [R]
        r = int(np.argmin(after))
        if after[r] < best * (1 - _EPS):  # an exchange copies two experts: only when strictly better
            best, action = after[r], ("swap", e, int(t[r]), int(f[r]))
    if action is None:
        return False
    kind, e, g = action[0], int(action[1]), action[2]
    if kind == "move":
        has[e, h], has[e, g] = False, True
    elif kind == "add":
        has[e, g] = True
    else:
        other = action[3]
        has[e, h], has[e, g], has[other, g], has[other, h] = False, True, False, True
    return True
