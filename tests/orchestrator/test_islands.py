"""Island placement (``placement.islands``) and the pair-split figures (``quality``) against the dense forms they
replaced: the same objective reached, the same renumbering, the same numbers."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expertmesh.orchestrator.placement.islands import NODE_WEIGHT, relabel_gpus, renumber_within_islands
from expertmesh.orchestrator.placement.quality import domain_shares, gpu_loads, split_pair_weight

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- the dense forms, as the planner had them (O(layers x GPUs^2 x domains) per exchange) -------------------


def _onehot(index):
    out = np.zeros((index.size, int(index.max()) + 1))
    out[np.arange(index.size), index] = 1.0
    return out


def dense_relabel(shares, coact, island, node, max_swaps):
    dom = np.concatenate([_onehot(island), NODE_WEIGHT**0.5 * _onehot(node)], axis=1)
    L, G = shares.shape[0], dom.shape[0]
    A = np.einsum("leb,lef,lfc->lbc", shares, coact, shares)
    A[:, np.arange(G), np.arange(G)] = 0.0
    d = np.broadcast_to(dom, (L, *dom.shape)).copy()
    pos = np.tile(np.arange(G), (L, 1))
    Y = A @ d
    ar = np.arange(L)
    floor = 1e-9 * np.maximum(A.sum(axis=(1, 2)), 1.0)
    for _ in range(max_swaps):
        Z = Y @ d.transpose(0, 2, 1)
        zd = np.diagonal(Z, axis1=1, axis2=2)
        dn = (d * d).sum(axis=2)
        dist = dn[:, :, None] + dn[:, None, :] - 2 * (d @ d.transpose(0, 2, 1))
        gain = 2 * (Z + Z.transpose(0, 2, 1) - zd[:, :, None] - zd[:, None, :]) - 2 * A * dist
        b, c = np.divmod(gain.reshape(L, -1).argmax(axis=1), G)
        active = gain[ar, b, c] > floor
        if not active.any():
            break
        b, c, rows = b[active], c[active], ar[active]
        delta = d[rows, c] - d[rows, b]
        Y[rows] += (A[rows, :, b] - A[rows, :, c])[:, :, None] * delta[:, None, :]
        d[rows, b], d[rows, c] = d[rows, c], d[rows, b].copy()
        pos[rows, b], pos[rows, c] = pos[rows, c], pos[rows, b].copy()
    out = np.empty_like(shares)
    out[ar[:, None], :, pos] = shares.transpose(0, 2, 1)
    return out


def dense_renumber(current, plan, island, node):
    out = plan.copy()
    same = (island[:, None] == island[None, :]) & (node[:, None] == node[None, :])
    for layer in range(plan.shape[0]):
        overlap = ((plan[layer] > 0).T.astype(np.int64) @ (current[layer] > 0).astype(np.int64)).astype(float)
        overlap = np.where(same, overlap, -np.inf)
        target = np.full(island.size, -1)
        for _ in range(island.size):
            new_g, cur_g = np.unravel_index(np.argmax(overlap), overlap.shape)
            target[new_g] = cur_g
            overlap[new_g, :] = -np.inf
            overlap[:, cur_g] = -np.inf
        out[layer][:, target] = plan[layer]
    return out


def dense_split_pair_weight(coactivation, shares, domain_of_gpu):
    p = shares @ _onehot(domain_of_gpu)
    together = p @ p.transpose(0, 2, 1)
    off = coactivation.copy()
    idx = np.arange(coactivation.shape[1])
    off[:, idx, idx] = 0.0
    return 0.5 * (off * (1.0 - together)).sum(axis=(1, 2))


# --- random problems ------------------------------------------------------------------------------------


@st.composite
def layouts(draw, every_gpu_used: bool = False):
    """Shares [L, E, G] (1-3 replicas an expert, random shares), symmetric co-activation, an island/node layout
    with an optional clique (one island id on two nodes). ``every_gpu_used``: no GPU empty (an empty GPU's
    exchanges all gain the same, and the greedy order among equal gains is a matter of rounding)."""
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    nodes, per_node, per_island = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    island = np.repeat(np.arange(nodes * per_node), per_island)
    node = np.repeat(np.arange(nodes), per_node * per_island)
    if draw(st.booleans()) and nodes > 1:
        island = np.unique(np.where(island == per_node, 0, island), return_inverse=True)[1]
    G, L = island.size, draw(st.integers(1, 3))
    E = draw(st.integers(G, G + 12)) if every_gpu_used else draw(st.integers(2, 20))
    shares = np.zeros((L, E, G))
    for layer in range(L):
        for e in range(E):
            gpus = rng.choice(G, size=int(rng.integers(1, min(3, G) + 1)), replace=False)
            if every_gpu_used and e < G and e not in gpus:
                gpus[0] = e
            w = rng.random(gpus.size)
            shares[layer, e, gpus] = w / w.sum()
    coact = rng.random((L, E, E))
    coact = coact + coact.transpose(0, 2, 1)
    current = np.zeros_like(shares)
    for layer in range(L):
        for e in range(E):
            current[layer, e, rng.choice(G, size=min(2, G), replace=False)] = 1.0
    return shares, coact, island, node, current


def _cost(coact, shares, island, node):
    off = coact.copy()
    idx = np.arange(coact.shape[1])
    off[:, idx, idx] = 0.0
    return split_pair_weight(off, shares, island) + NODE_WEIGHT * split_pair_weight(off, shares, node)


@SETTINGS
@given(layouts(every_gpu_used=True), st.integers(0, 24))
def test_relabel_reaches_the_dense_forms_objective_and_moves_no_load(layout, swaps):
    shares, coact, island, node, _ = layout
    off = coact.copy()
    off[:, np.arange(coact.shape[1]), np.arange(coact.shape[1])] = 0.0
    ours = relabel_gpus(shares, off, island, node, swaps)
    dense = dense_relabel(shares, off, island, node, swaps)
    # Exchanges of equal gain (a symmetric topology has many) may be taken in another order; the objective is the
    # same after every number of exchanges.
    np.testing.assert_allclose(
        _cost(coact, ours, island, node), _cost(coact, dense, island, node), rtol=1e-9, atol=1e-9
    )
    # Whole GPU contents only change places: the multiset of GPU loads and of columns is the same.
    load = np.ones(shares.shape[:2])
    np.testing.assert_allclose(np.sort(gpu_loads(load, ours), axis=1), np.sort(gpu_loads(load, shares), axis=1))
    for layer in range(shares.shape[0]):
        assert sorted(map(bytes, ours[layer].T)) == sorted(map(bytes, shares[layer].T))
    assert (_cost(coact, ours, island, node) <= _cost(coact, shares, island, node) + 1e-9).all()


@SETTINGS
@given(layouts(), st.integers(0, 24))
def test_relabel_never_raises_the_split_cost_nor_moves_load_with_empty_gpus(layout, swaps):
    shares, coact, island, node, _ = layout
    off = coact.copy()
    off[:, np.arange(coact.shape[1]), np.arange(coact.shape[1])] = 0.0
    ours = relabel_gpus(shares, off, island, node, swaps)
    assert (_cost(coact, ours, island, node) <= _cost(coact, shares, island, node) + 1e-9).all()
    for layer in range(shares.shape[0]):
        assert sorted(map(bytes, ours[layer].T)) == sorted(map(bytes, shares[layer].T))


@SETTINGS
@given(layouts())
def test_renumber_within_islands_equals_the_dense_greedy_matching(layout):
    shares, _, island, node, current = layout
    np.testing.assert_array_equal(
        renumber_within_islands(current, shares, island, node), dense_renumber(current, shares, island, node)
    )


@SETTINGS
@given(layouts())
def test_split_pair_weight_and_domain_shares_equal_the_dense_forms(layout):
    shares, coact, island, node, _ = layout
    for domain in (island, node):
        np.testing.assert_allclose(domain_shares(shares, domain), shares @ _onehot(domain), atol=1e-12)
        np.testing.assert_allclose(
            split_pair_weight(coact, shares, domain),
            dense_split_pair_weight(coact, shares, domain),
            rtol=1e-9,
            atol=1e-9,
        )


def test_an_exchange_that_gathers_a_coactivated_pair_is_made():
    """Two islands of two GPUs; experts 0 and 1 co-activate but start in different islands: one exchange puts them
    together, and nothing else is worth moving."""
    island, node = np.array([0, 0, 1, 1]), np.zeros(4, dtype=np.int64)
    shares = np.eye(4)[None]  # expert e on GPU e
    coact = np.zeros((1, 4, 4))
    coact[0, 0, 2] = coact[0, 2, 0] = 10.0
    out = relabel_gpus(shares, coact, island, node, 8)
    where = out[0].argmax(axis=1)  # GPU of each expert
    assert island[where[0]] == island[where[2]]
    assert _cost(coact, out, island, node)[0] == pytest.approx(0.0)
