"""Island placement: which GPU of the topology each GPU's contents go to, for co-activation locality.

Glossary
--------
contents
    One GPU's replicas in one layer (a column of ``shares[l]``). Exchanging two GPUs' contents
    changes no GPU load (slots are uniform), so balancedness is untouched.
location
    A distinct (NVLink island, node) pair: positions at one location are interchangeable.
position vector
    ``dom[p]``: one-hot island of position ``p`` next to ``sqrt(NODE_WEIGHT)`` times its one-hot
    node, so ``|d_b - d_c|^2`` counts an island hop 2 and a node hop ``2 * NODE_WEIGHT``.

``relabel_gpus`` maximises, per layer, ``F = sum_{b != c} A[b, c] d_b . d_c`` (A: co-activation
between contents, ``d_b``: position vector where content ``b`` sits) by exchanging contents, best
exchange first, at most ``max_swaps`` per layer. ``renumber_within_islands`` permutes a plan's GPUs
inside each location to keep the most replicas where a current placement has them.

Cost: with ``Q = A M`` (M one-hot location of each content, [G, K]) and ``S = dom_k . dom_k'``
[K, K], ``V = Q S`` is the co-activation of each content with each location, ``U[b, k] = V[b, k] -
V[b, loc_b]`` the gain of moving ``b`` to ``k``, and exchanging ``b`` and ``c`` gains
``2 (U[b, loc_c] + U[c, loc_b]) - 2 A[b, c] |d_b - d_c|^2``. An exchange between locations k1 and k2
changes ``V`` by a rank-one term on the locations that share an island or node with k1 or k2, so
only the gain rows and columns of contents at those locations are recomputed: O(G x changed) per
exchange instead of O(G^2 x D). Pure and deterministic: ties go to the lowest (b, c).
"""

from __future__ import annotations

import numpy as np

__all__ = ["NODE_WEIGHT", "relabel_gpus", "renumber_within_islands"]

# A node hop costs more than an island hop inside a node: weight of the node term.
NODE_WEIGHT = 1.0


def _locations(island: np.ndarray, node: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """island [G], node [G] -> loc [G] location of each position, S [K, K] position-vector products."""
    pairs, loc = np.unique(np.stack([island, node], axis=1), axis=0, return_inverse=True)
    same_island = pairs[:, 0][:, None] == pairs[:, 0][None, :]
    same_node = pairs[:, 1][:, None] == pairs[:, 1][None, :]
    return loc.reshape(-1), same_island.astype(np.float64) + NODE_WEIGHT * same_node


def relabel_gpus(
    shares: np.ndarray, coact: np.ndarray, island: np.ndarray, node: np.ndarray, max_swaps: int
) -> np.ndarray:
    """shares [L, E, G], coact [L, E, E] (zero diagonal), island/node [G] dense indices -> shares [L, E, G]
    with each layer's GPU columns permuted to keep co-activated contents in one island and node."""
    L = shares.shape[0]
    loc, S = _locations(island, node)
    out = np.empty_like(shares)
    for layer in range(L):
        pos = _relabel_layer(_content_coactivation(shares[layer], coact[layer]), loc, S, max_swaps)
        out[layer][:, pos] = shares[layer]
    return out


def _content_coactivation(shares: np.ndarray, coact: np.ndarray) -> np.ndarray:
    """shares [E, G], coact [E, E] -> A [G, G] = shares^T coact shares with a zero diagonal, over the replicas only
    (a layer holds E + redundant of them, far fewer than E x G)."""
    G = shares.shape[1]
    e, g = np.nonzero(shares)  # [R] one per replica
    s = shares[e, g]
    weight = coact[np.ix_(e, e)] * s[:, None] * s[None, :]  # [R, R]
    A = np.bincount((g[:, None] * G + g[None, :]).ravel(), weights=weight.ravel(), minlength=G * G).reshape(G, G)
    A[np.arange(G), np.arange(G)] = 0.0
    return A


def _relabel_layer(A: np.ndarray, loc: np.ndarray, S: np.ndarray, max_swaps: int) -> np.ndarray:
    """A [G, G] symmetric co-activation between contents -> pos [G] (a permutation)."""
    G, K = A.shape[0], S.shape[0]
    pos = np.arange(G)
    ell = loc.copy()  # [G] location of each content
    Dk = np.diag(S)[:, None] + np.diag(S)[None, :] - 2 * S  # [K, K] |d - d'|^2 between locations
    onehot = np.zeros((G, K))
    onehot[np.arange(G), ell] = 1.0
    V = A @ onehot @ S  # [G, K]
    ar = np.arange(G)
    U = V - V[ar, ell][:, None]
    gain = 2 * (U[:, ell] + U[:, ell].T) - 2 * A * Dk[ell][:, ell]  # [G, G], symmetric
    floor = 1e-9 * max(float(A.sum()), 1.0)
    for _ in range(max_swaps):
        b, c = divmod(int(gain.argmax()), G)
        if not gain[b, c] > floor:
            break
        k1, k2 = ell[b], ell[c]
        s = S[k1] - S[k2]  # [K]
        V += np.outer(A[:, c] - A[:, b], s)
        ell[b], ell[c] = k2, k1
        pos[b], pos[c] = pos[c], pos[b]
        touched = s != 0
        touched[[k1, k2]] = True
        rows = np.flatnonzero(touched[ell])  # contents whose gains changed (b and c among them)
        U = V - V[ar, ell][:, None]
        block = 2 * (U[rows][:, ell] + U[:, ell[rows]].T) - 2 * A[rows] * Dk[ell[rows]][:, ell]  # [R, G]
        gain[rows] = block
        gain[:, rows] = block.T
    return pos


def renumber_within_islands(current: np.ndarray, plan: np.ndarray, island: np.ndarray, node: np.ndarray) -> np.ndarray:
    """Permute each layer's GPU columns inside islands to keep the most replicas in place (greedy matching).

    current, plan [L, E, G] -> plan with columns permuted. Greedy: the (new, current) GPU pair of one
    location holding the most replicas in common first (lowest indices on ties); locations are
    independent, so each is matched alone, all layers at once.
    """
    out = np.empty_like(plan)
    L = plan.shape[0]
    loc, _ = _locations(island, node)
    ar = np.arange(L)
    new_has, cur_has = (plan > 0).astype(np.int64), (current > 0).astype(np.int64)
    for k in range(int(loc.max()) + 1):
        members = np.flatnonzero(loc == k)  # ascending: the order ties go by
        n = members.size
        overlap = np.einsum("len,lec->lnc", new_has[:, :, members], cur_has[:, :, members]).astype(np.float64)
        target = np.empty((L, n), dtype=np.int64)
        for _ in range(n):
            new_i, cur_i = np.divmod(overlap.reshape(L, -1).argmax(axis=1), n)
            target[ar, new_i] = cur_i
            overlap[ar, new_i, :] = -np.inf
            overlap[ar, :, cur_i] = -np.inf
        out[ar[:, None], :, members[target]] = plan[:, :, members].transpose(0, 2, 1)
    return out
