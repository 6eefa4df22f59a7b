"""Greedy heaviest-first balanced packing, vectorised over layers.

Shared by the EPLB baseline (its ``balanced_packing``) and the planner (which
also forbids two replicas of one expert in a pack).
"""

from __future__ import annotations

import numpy as np


def greedy_pack(
    weight: np.ndarray,
    num_packs: int,
    capacity: int,
    item_expert: np.ndarray | None = None,
    num_experts: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Put items in packs heaviest first, each into the lightest pack with room.

    weight: [X, n] item weights, one packing problem per row.
    capacity: items a pack may hold (``ceil(n / num_packs)`` at least).
    item_expert: [X, n] optional; when given, a pack never takes two items of one
        expert (an item that fits nowhere gets pack -1).
    Returns pack_index [X, n] and rank_in_pack [X, n] (order of arrival in the pack).
    Ties go to the lowest pack index, so the result is deterministic.
    """
    rows, n = weight.shape
    order = np.argsort(-weight, axis=1, kind="stable")
    pack_load = np.zeros((rows, num_packs))
    pack_count = np.zeros((rows, num_packs), dtype=np.int64)
    pack_index = np.full((rows, n), -1, dtype=np.int64)
    rank = np.full((rows, n), -1, dtype=np.int64)
    ar = np.arange(rows)
    holds = np.zeros((rows, num_packs, num_experts), dtype=bool) if item_expert is not None else None
    for k in range(n):
        item = order[:, k]
        cand = np.where(pack_count < capacity, pack_load, np.inf)
        if holds is not None:
            expert = item_expert[ar, item]
            cand = np.where(holds[ar, :, expert], np.inf, cand)
        pack = cand.argmin(axis=1)
        ok = np.isfinite(cand[ar, pack])
        r, p, it = ar[ok], pack[ok], item[ok]
        pack_index[r, it] = p
        rank[r, it] = pack_count[r, p]
        pack_load[r, p] += weight[r, it]
        pack_count[r, p] += 1
        if holds is not None:
            holds[r, p, item_expert[r, it]] = True
    return pack_index, rank


def replicate_by_load(weight: np.ndarray, num_redundant: int, max_replicas: int | None = None) -> np.ndarray:
    """Replica counts [X, n]: each extra replica goes to the item with the highest load / count.

    max_replicas caps one item's count (an expert cannot have more replicas than
    there are GPUs); an extra replica that no item can take is not made.
    """
    count = np.ones(weight.shape, dtype=np.int64)
    ar = np.arange(weight.shape[0])
    for _ in range(num_redundant):
        per = weight / count
        if max_replicas is not None:
            per = np.where(count < max_replicas, per, -np.inf)
        best = per.argmax(axis=1)
        count[ar, best] += np.isfinite(per[ar, best])
    return count
