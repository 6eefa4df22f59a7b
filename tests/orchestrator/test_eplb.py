"""EPLB baseline on small cases worked out by hand from the EPLB README's rules."""

import numpy as np

from expertmesh.orchestrator.placement.eplb import balanced_packing, eplb_shares, replicate_experts


def test_replicate_gives_replicas_to_highest_load_per_replica():
    phy2log, rank, logcnt = replicate_experts(np.array([[10.0, 4.0, 2.0]]), 5)
    # 10/1 is highest -> expert 0 (now 5 per replica), 5 > 4 -> expert 0 again.
    assert phy2log.tolist() == [[0, 1, 2, 0, 0]]
    assert rank.tolist() == [[0, 0, 0, 1, 2]]
    assert logcnt.tolist() == [[3, 1, 1]]


def test_balanced_packing_heaviest_first_into_lightest_pack_with_room():
    pack, rank = balanced_packing(np.array([[9.0, 7.0, 6.0, 5.0, 4.0, 1.0]]), 2)
    # 9->p0, 7->p1, 6->p1 (7<9), 5->p0 (9<13), 4->p1 (13<14, now full), 1->p0.
    assert pack.tolist() == [[0, 1, 1, 0, 1, 0]]
    assert rank.tolist() == [[0, 0, 1, 1, 2, 2]]


def test_global_policy_merges_two_replicas_on_one_gpu():
    shares = eplb_shares(np.array([[6.0, 2.0, 2.0, 2.0]]), num_redundant=2, gpus_per_node=[2], num_gating_groups=1)
    # Expert 0 gets 3 replicas of 2 tokens; six equal items alternate g0, g1, g0, ...
    # so g0 holds replicas 0 and 4 (both expert 0), merged into one share of 2/3.
    assert np.allclose(shares[0, 0], [2 / 3, 1 / 3])
    assert np.allclose(shares[0, 1], [0, 1]) and np.allclose(shares[0, 2], [1, 0]) and np.allclose(shares[0, 3], [0, 1])
    assert np.allclose(np.einsum("le,leg->lg", np.array([[6.0, 2, 2, 2]]), shares), [[6, 6]])


def test_hierarchical_policy_packs_groups_to_nodes_then_replicates_inside():
    # 2 groups {0,1} (3 tokens) and {2,3} (7 tokens) on 2 nodes x 2 GPUs, 4 redundant.
    shares = eplb_shares(np.array([[1.0, 2.0, 3.0, 4.0]]), num_redundant=4, gpus_per_node=[2, 2], num_gating_groups=2)
    # Heavier group goes to node 0 (GPUs 0, 1); inside, experts 3 then 2 get a second
    # replica, and the four equal-ish replicas spread one of each per GPU.
    assert np.allclose(shares[0, 3], [0.5, 0.5, 0, 0])
    assert np.allclose(shares[0, 2], [0.5, 0.5, 0, 0])
    assert np.allclose(shares[0, 1], [0, 0, 0.5, 0.5])
    assert np.allclose(shares[0, 0], [0, 0, 0.5, 0.5])


def test_without_divisibility_falls_back_to_global_with_rounded_up_capacity():
    shares = eplb_shares(np.array([[5.0, 1.0, 1.0]]), num_redundant=0, gpus_per_node=[2], num_gating_groups=1)
    # 3 replicas on 2 GPUs: up to 2 per GPU. 5 -> g0, 1 -> g1, 1 -> g1.
    assert (shares[0] > 0).sum(axis=1).tolist() == [1, 1, 1]
    assert shares[0, 0, 0] == 1 and shares[0, 1, 1] == 1 and shares[0, 2, 1] == 1
