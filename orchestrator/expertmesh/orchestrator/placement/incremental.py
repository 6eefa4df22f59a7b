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
    bar, each lowering the hottest GPU: move one of its replicas to a GPU with a
    free slot, add a replica of one of its experts there (within the redundant budget), or exchange
    one with a lighter replica elsewhere, judged on the water-filled shares, the experts an edit
    touched levelled again after it. Each edit copies one expert's weights (an exchange two), so the
    weights moved stay proportional to the change, not to the cluster. The layer is water-filled
    again (``planner.waterfill``); the search is kept only where that helped.
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
        # Stop at the bar: the max GPU load that reaches it (min_gain decides re-plans, not where the search stops).
        enough = load.sum(axis=1) / G / np.maximum(bar, _EPS)  # [L]
        searched = np.stack(
            [
                _search_layer(load[layer], repaired[layer], slots, budget, options.repair_moves, enough[layer])
                for layer in low
            ]
        )
        tried = waterfill(load[low], searched)
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
    """One layer's replicas as a bool matrix ``has`` [E, G] with equal shares (the repair's estimate)."""

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


def _search_layer(
    load: np.ndarray, share: np.ndarray, slots: int, budget: int, moves: int, enough: float
) -> np.ndarray:
    """load [E], share [E, G] (water-filled) -> share [E, G] after at most ``moves`` edits, each lowering the
    hottest GPU, until none is above ``enough``. Judged on the shares as they are; after each edit the experts
    it touched are levelled again over their GPUs (``_relevel``)."""
    share = share.copy()
    loads = load @ share  # [G]
    for _ in range(moves):
        h = int(np.argmax(loads))
        if loads[h] <= enough * (1 + _EPS) or loads[h] <= 0:
            break
        action = _best_edit(load, share, loads, h, slots, budget)
        if action is None:
            break
        kind, e, g = action[0], action[1], action[2]
        if kind == "move":
            share[e, g], share[e, h] = share[e, h], 0.0
        elif kind == "add":
            share[e, g] = _EPS  # a replica with no share yet: levelling gives it one
            share[e] /= share[e].sum()
        else:
            other = action[3]
            share[e, g], share[e, h] = share[e, h], 0.0
            share[other, h], share[other, g] = share[other, g], 0.0
        loads = load @ share
        for expert in (e, action[3]) if kind == "swap" else (e,):
            _relevel(load[expert], share[expert], loads)
    return share


def _relevel(w: float, share: np.ndarray, loads: np.ndarray) -> None:
    """Water-fill one expert (``w`` tokens, ``share`` [G]) over its GPUs given ``loads`` [G]; both updated in place."""
    gpus = np.flatnonzero(share > 0)
    if gpus.size < 2 or w <= 0:
        return
    base = loads[gpus] - w * share[gpus]
    level = ((w + np.cumsum(np.sort(base))) / np.arange(1, gpus.size + 1)).min()
    new = np.maximum(level - base, 0.0)
    new[new < 1e-12 * max(w, 1.0)] = 0.0  # a replica above the level takes nothing and frees its slot
    new /= new.sum()
    share[gpus] = new
    loads[gpus] = base + w * new


def _best_edit(load, share, loads, h: int, slots: int, budget: int) -> tuple | None:
    """The edit that leaves the hottest GPU ``h`` and the GPU it involves lowest, if below ``loads[h]``:
    ("move", e, t), ("add", e, t) or ("swap", e, t, f)."""
    has = share > 0
    top = loads[h]
    on = np.flatnonzero(has[:, h])  # experts on the hottest GPU
    y = load[on] * share[on, h]  # [S] what each computes there
    free = has.sum(axis=0) < slots  # [G]
    best, action = top * (1 - _EPS), None
    # Move e from h to a GPU t with a free slot that holds no e: h sheds y, t takes it.
    ok = free[None, :] & ~has[on]  # [S, G]
    after = np.where(ok, np.maximum(top - y[:, None], loads[None, :] + y[:, None]), np.inf)
    i, t = np.unravel_index(np.argmin(after), after.shape)
    if after[i, t] < best:
        best, action = after[i, t], ("move", int(on[i]), int(t))
    # Add a replica of e on such a GPU, within the budget: e levels over its GPUs and t. A GPU whose load without
    # e is above the new level keeps that load; the others end at the level.
    if has.sum() < budget:
        for i, e in enumerate(on):
            targets = np.flatnonzero(ok[i])
            if not targets.size:
                continue
            gpus = np.flatnonzero(has[e])
            base = loads[gpus] - load[e] * share[e, gpus]
            bases = np.sort(np.column_stack([np.broadcast_to(base, (targets.size, base.size)), loads[targets]]), axis=1)
            level = ((load[e] + np.cumsum(bases, axis=1)) / np.arange(1, bases.shape[1] + 1)).min(axis=1)
            after = np.maximum(level, bases[:, -1])
            j = int(np.argmin(after))
            if after[j] < best:
                best, action = after[j], ("add", int(e), int(targets[j]))
    # Exchange e (on h) with a replica of f on t: h takes what f computes instead of e, t the opposite.
    f, t = np.nonzero(has)  # [R] every replica
    z = load[f] * share[f, t]  # [R]
    valid = (t != h) & ~has[f, h]  # h holds no f
    for i, e in enumerate(on):
        okr = valid & ~has[e, t]  # t holds no e
        after = np.where(okr, np.maximum(top - y[i] + z, loads[t] - z + y[i]), np.inf)  # [R]
        r = int(np.argmin(after))
        if after[r] < best * (1 - _EPS):  # an exchange copies two experts: only when strictly better
            best, action = after[r], ("swap", int(e), int(t[r]), int(f[r]))
    return action


def _start_shares(carried: np.ndarray, has: np.ndarray) -> np.ndarray:
    """[..., E, G]: an expert whose replicas are where they were keeps its shares, another splits equally."""
    kept = np.where(has, carried, 0.0)
    count = has.sum(axis=-1, keepdims=True)
    # Same replicas: every one held before, and no other (a removed GPU's share is missing from the sum).
    same = ((kept > 0).sum(axis=-1, keepdims=True) == count) & (np.abs(kept.sum(axis=-1, keepdims=True) - 1) < 1e-9)
    return np.where(same, kept, has / np.maximum(count, 1))
