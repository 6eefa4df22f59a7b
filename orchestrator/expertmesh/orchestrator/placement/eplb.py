"""DeepSeek's EPLB (Expert Parallelism Load Balancer), the baseline the planner must beat.

Written from the published description (github.com/deepseek-ai/EPLB, README):

* hierarchical policy, used when the number of gating groups divides by the
  number of nodes: pack gating groups onto nodes (greedy heaviest-first balanced
  packing, equal gating-group count per node), replicate experts inside each node by
  repeatedly giving one more replica to the expert with the highest
  load / replica-count, then pack the node's physical replicas onto its GPUs the
  same balanced way;
* global policy otherwise: replicate over the whole cluster, pack onto all GPUs.

Replicas of an expert take equal shares. Two departures, both only where EPLB
itself would refuse: when the replica count does not divide by the GPU count, a
GPU holds up to ``ceil(replicas / gpus)`` (EPLB asserts divisibility), and the
hierarchical policy needs the same GPU count on every node (else global). EPLB
may put two replicas of one expert on one GPU; as a placement those merge into
one replica with the summed share (same GPU loads).

*Gating groups* are DeepSeek's groups of experts for group-limited routing (``n_group``), not this
project's expert groups (the served processes).
"""

from __future__ import annotations

import numpy as np

from expertmesh.orchestrator.placement.packing import greedy_pack


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """[X, n] weights -> pack_index, rank_in_pack; each pack gets n / num_packs items (rounded up)."""
    return greedy_pack(weight, num_packs, -(-weight.shape[1] // num_packs))


def replicate_experts(weight: np.ndarray, num_physical: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[X, n] loads -> phy2log [X, num_physical], rank [X, num_physical], logcnt [X, n].

    Physical replica ``i < n`` is logical expert ``i``; each later one goes to the
    expert with the highest load per replica so far (first such on ties).
    """
    rows, n = weight.shape
    phy2log = np.tile(np.arange(num_physical), (rows, 1))
    rank = np.zeros((rows, num_physical), dtype=np.int64)
    logcnt = np.ones((rows, n), dtype=np.int64)
    ar = np.arange(rows)
    for i in range(n, num_physical):
        best = (weight / logcnt).argmax(axis=1)
        phy2log[:, i] = best
        rank[:, i] = logcnt[ar, best]
        logcnt[ar, best] += 1
    return phy2log, rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def rebalance_hierarchical(
    weight: np.ndarray, num_physical: int, num_gating_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray]:
    """[L, E] loads -> (phy2log [L, num_physical], gpu_of_phy [L, num_physical])."""
    L, E = weight.shape
    gating_group_size, gating_groups_per_node = E // num_gating_groups, num_gating_groups // num_nodes
    per_gpu = num_physical // num_gpus
    # Step 1: gating groups onto nodes.
    gating_group_tokens = weight.reshape(L, num_gating_groups, gating_group_size).sum(axis=2)
    gating_group_pack, gating_group_rank = balanced_packing(gating_group_tokens, num_nodes)
    log2mlog = ((gating_group_pack * gating_groups_per_node + gating_group_rank) * gating_group_size)[
        :, :, None
    ] + np.arange(gating_group_size)
    mlog2log = _inverse(log2mlog.reshape(L, E))  # node-major order of logical experts
    # Step 2: replicas inside each node.
    mlog_tokens = np.take_along_axis(weight, mlog2log, axis=1).reshape(L * num_nodes, E // num_nodes)
    phy2mlog, _, mlogcnt = replicate_experts(mlog_tokens, num_physical // num_nodes)
    # Step 3: a node's replicas onto its GPUs.
    phy_tokens = np.take_along_axis(mlog_tokens / mlogcnt, phy2mlog, axis=1)
    pack, rank = balanced_packing(phy_tokens, num_gpus // num_nodes)
    pphy2phy = _inverse(pack * per_gpu + rank)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1).reshape(L, num_nodes, -1)
    pphy2mlog = (pphy2mlog + (np.arange(num_nodes) * (E // num_nodes))[:, None]).reshape(L, -1)
    phy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=1)
    return phy2log, np.broadcast_to(np.arange(num_physical) // per_gpu, phy2log.shape)


def rebalance_global(weight: np.ndarray, num_physical: int, num_gpus: int) -> tuple[np.ndarray, np.ndarray]:
    phy2log, _, logcnt = replicate_experts(weight, num_physical)
    phy_tokens = np.take_along_axis(weight / logcnt, phy2log, axis=1)
    pack, _ = balanced_packing(phy_tokens, num_gpus)
    return phy2log, pack


def eplb_shares(
    weight: np.ndarray, num_redundant: int, gpus_per_node: list[int], num_gating_groups: int = 1
) -> np.ndarray:
    """EPLB's placement as shares [L, E, G] (G = sum(gpus_per_node), GPUs node-major)."""
    L, E = weight.shape
    num_gpus, num_nodes = sum(gpus_per_node), len(gpus_per_node)
    num_physical = E + num_redundant
    hierarchical = (
        num_gating_groups >= 1
        and E % num_gating_groups == 0
        and num_gating_groups % num_nodes == 0
        and len(set(gpus_per_node)) == 1
        and num_physical % num_gpus == 0
        and num_physical % num_nodes == 0
    )
    if hierarchical:
        phy2log, gpu = rebalance_hierarchical(weight, num_physical, num_gating_groups, num_nodes, num_gpus)
    else:
        phy2log, gpu = rebalance_global(weight, num_physical, num_gpus)
    return replicas_to_shares(phy2log, gpu, E, num_gpus)


def replicas_to_shares(phy2log: np.ndarray, gpu: np.ndarray, num_experts: int, num_gpus: int) -> np.ndarray:
    """Equal shares per replica; two replicas of one expert on one GPU add up."""
    L = phy2log.shape[0]
    rows = np.broadcast_to(np.arange(L)[:, None], phy2log.shape)
    counts = np.zeros((L, num_experts))
    np.add.at(counts, (rows, phy2log), 1.0)
    shares = np.zeros((L, num_experts, num_gpus))
    np.add.at(shares, (rows, phy2log, gpu), 1.0 / np.take_along_axis(counts, phy2log, axis=1))
    return shares
