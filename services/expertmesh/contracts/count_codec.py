"""Token counts in an ``.npz`` exactly and compactly: whole counts as uint32, a symmetric co-activation as its
upper triangle.

Glossary
- *whole counts*: an array whose entries are all integers in ``[0, 2**32)`` (what a router's ``LoadWindow``
  holds: it adds ones); stored as uint32 (half of float64, and zlib packs the zero high bytes), read back as
  float64, bit for bit. Anything else (a fraction, a negative, a NaN) is stored as float64, as it was.
- *upper triangle*: of a co-activation ``[L, E, E]`` that is symmetric with a zero diagonal (``LoadWindow``'s
  always is), the ``E * (E - 1) / 2`` entries above the diagonal of each row ``[L, E(E-1)/2]``; one that is not
  is stored whole.

Example::

    >>> a = np.array([[0.0, 3.0], [3.0, 0.0]])[None]
    >>> packed = pack_coactivation(a)
    >>> sorted(packed), packed["coactivation_upper"].dtype.name
    (['coactivation_upper'], 'uint32')
    >>> bool((unpack_coactivation(packed, 2) == a).all())
    True
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = ["pack_counts", "unpack_counts", "pack_coactivation", "unpack_coactivation"]

_UINT32_END = float(1 << 32)


def pack_counts(a: np.ndarray) -> np.ndarray:
    """``a`` as uint32 when it holds whole counts, else as float64 (both read back exactly by ``unpack_counts``)."""
    a = np.asarray(a)
    if a.dtype.kind in "ui" and (a.size == 0 or (a.min() >= 0 and a.max() < _UINT32_END)):
        return a.astype(np.uint32)
    a = a.astype(np.float64, copy=False)
    if a.size and np.all((a >= 0) & (a < _UINT32_END) & (a == np.floor(a))):
        return a.astype(np.uint32)
    return a


def unpack_counts(a: np.ndarray) -> np.ndarray:
    """float64 of what ``pack_counts`` stored (or of a plain float64 array, as older writers stored it)."""
    return np.asarray(a).astype(np.float64)


def pack_coactivation(coactivation: np.ndarray) -> dict[str, np.ndarray]:
    """The ``.npz`` member of a co-activation [L, E, E]: ``coactivation_upper`` [L, E(E-1)/2] when it is symmetric
    with a zero diagonal, else ``coactivation`` [L, E, E]; counts packed (``pack_counts``)."""
    c = np.asarray(coactivation)
    E = c.shape[-1] if c.ndim == 3 else 0
    rows, cols = np.triu_indices(E, k=1)
    symmetric = c.ndim == 3 and c.shape[1] == E and np.array_equal(c, c.transpose(0, 2, 1))
    if symmetric and not np.diagonal(c, 0, 1, 2).any():
        return {"coactivation_upper": pack_counts(c[:, rows, cols])}
    return {"coactivation": pack_counts(c)}


def unpack_coactivation(members: Mapping[str, np.ndarray], num_experts: int) -> np.ndarray:
    """[L, E, E] float64 from the members ``pack_coactivation`` wrote (or an older writer's dense ``coactivation``)."""
    if "coactivation" in members:
        return unpack_counts(members["coactivation"])
    upper = unpack_counts(members["coactivation_upper"])  # [L, E(E-1)/2]
    rows, cols = np.triu_indices(num_experts, k=1)
    out = np.zeros((upper.shape[0], num_experts, num_experts))
    out[:, rows, cols] = upper
    out[:, cols, rows] = upper
    return out
