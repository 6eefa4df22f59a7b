"""One call's output rows summed into each expert's statistics, what ``HostedExperts`` merges into each expert's
``OutputStats`` after every call: per expert its rows, its non-finite rows, its normed rows (finite, with a
routing weight other than 0) and, over those, the mean of ``norm / |weight|`` (the unweighted output's norm: the
module applies the routing weight itself) and the sum of squared deviations from it.

Why a kernel (``call_statistics.cpp``): every call of every layer records, on the thread that computed it. In
Python the loop over a call's rows held the GIL while the layer's other call wanted it (~200 us a call at 64
sequences), and the tensor path of a prompt's call ran ~15 small ops (~500 us in a serving process for 480
rows). The kernel is the same loop in the same order, in double precision (each square rounded before it is
added, as Python and ``torch.bincount`` do), so the same statistics to the bit. Before ``load``, or where the
kernel does not build (an image without a compiler, as the CUDA one), ``per_expert`` takes the same sums the way
they were taken before it: the loop in Python for up to ``LOOP_ROWS`` rows (``_loop``), ``torch.bincount`` on
the rows' device past that (``_tensors``). The norms are torch's own (``Tensor.norm``), on the rows' device.

Shapes: S rows of a call, H hidden size, n experts of the layer the group holds.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from pathlib import Path

import torch

from expertmesh.infra.finite import finite_rows
from expertmesh.infra.native_kernels import load_cpu_kernel

__all__ = ["ExpertRows", "load", "per_expert"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_suffix(".cpp")
_lock = threading.Lock()
#: whether ``load`` built and registered the kernel (``torch.ops.expertmesh_stats.call_stats``)
_built = False

#: (local expert, rows, non-finite rows, normed rows, mean of norm / |weight|, sum of squared deviations)
ExpertRows = tuple[int, int, int, int, float, float]

#: Without the kernel, calls of up to this many rows (decode steps) are summed in plain Python, larger ones by
#: ``torch.bincount`` (a dozen ops: each 10-20 us, where the loop costs ~1 us a row)
LOOP_ROWS = 64


@functools.cache
def load() -> bool:
    """Whether the kernel is built (once per machine) and ``per_expert`` uses it from now; never raises."""
    global _built
    with _lock:
        _built = load_cpu_kernel(
            "expertmesh_call_statistics",
            _SOURCE,
            "call statistics kernel",
            "expert statistics are summed in Python",
            lambda: torch.ops.expertmesh_stats.call_stats,
            log,
        )
    return _built


def per_expert(local: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, experts: int) -> list[ExpertRows]:
    """local [S] int64 (each row's local expert, < ``experts``), weights [S] (its routing weight), rows [S, H] (its
    weighted output) -> each expert with a row, in ascending order."""
    norms = rows.float().norm(dim=1)  # [S]
    if not _built:
        if len(local) <= LOOP_ROWS:
            return _loop(local.tolist(), weights.tolist(), norms.tolist(), rows)
        return _tensors(local, weights, norms, rows, experts)
    args = (local.to("cpu", torch.long), weights.to("cpu", torch.float32), norms.cpu())
    table = torch.ops.expertmesh_stats.call_stats(*args, None, experts)  # [experts, 5]
    if table.dim() == 1:  # a norm that is not finite: which rows are finite, from their elements
        table = torch.ops.expertmesh_stats.call_stats(*args, finite_rows(rows).cpu(), experts)
    return [(e, int(n), int(bad), int(k), mean, m2) for e, (n, bad, k, mean, m2) in enumerate(table.tolist()) if n]


def _loop(experts: list[int], weights: list[float], norms: list[float], rows: torch.Tensor) -> list[ExpertRows]:
    """``per_expert`` in plain Python: the kernel's loop."""
    scales = [abs(w) for w in weights]
    finite = [True] * len(norms) if all(map(math.isfinite, norms)) else finite_rows(rows).tolist()  # [S]
    count: dict[int, int] = {}
    bad: dict[int, int] = {}
    normed: dict[int, int] = {}
    total: dict[int, float] = {}
    usable = []
    for i, e in enumerate(experts):
        count[e] = count.get(e, 0) + 1
        bad[e] = bad.get(e, 0) + (not finite[i])
        ok = finite[i] and scales[i] > 0
        usable.append(ok)
        if ok:
            normed[e] = normed.get(e, 0) + 1
            total[e] = total.get(e, 0.0) + norms[i] / scales[i]
    mean = {e: total.get(e, 0.0) / max(normed.get(e, 0), 1) for e in count}
    m2: dict[int, float] = {}
    for i, e in enumerate(experts):
        if usable[i]:
            deviation = norms[i] / scales[i] - mean[e]
            m2[e] = m2.get(e, 0.0) + deviation * deviation
    return [(e, count[e], bad[e], normed.get(e, 0), mean[e], m2.get(e, 0.0)) for e in sorted(count)]


def _tensors(
    local: torch.Tensor, weights: torch.Tensor, norms: torch.Tensor, rows: torch.Tensor, n: int
) -> list[ExpertRows]:
    """``per_expert`` in torch ops on the rows' device: ``torch.bincount`` adds in row order in double precision,
    as the loop does."""
    finite = finite_rows(rows)  # [S]
    scale = weights.to(norms.device).abs().double()  # [S]
    usable = finite & (scale > 0)  # [S]
    normed_by = torch.where(usable, norms.double() / scale, 0.0)  # [S]
    local = local.to(norms.device)
    count = torch.bincount(local, minlength=n).double()  # [n]
    bad = torch.bincount(local, weights=(~finite).double(), minlength=n)  # [n]
    normed = torch.bincount(local, weights=usable.double(), minlength=n)  # [n]
    mean = torch.bincount(local, weights=normed_by, minlength=n) / normed.clamp(min=1)  # [n]
    deviation = torch.where(usable, normed_by - mean[local], 0.0)  # [S]
    m2 = torch.bincount(local, weights=deviation * deviation, minlength=n)  # [n]
    table = torch.stack([count, bad, normed, mean, m2], dim=1).tolist()  # [n, 5]
    return [(e, int(c), int(b), int(k), mu, sq) for e, (c, b, k, mu, sq) in enumerate(table) if c]
