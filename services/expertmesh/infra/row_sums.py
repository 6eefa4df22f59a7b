"""``out[index[i]] += rows[i]`` for every i, in order: the same bits every call, a few rows at the cost of a few
rows, many at the cost of many.

Two ATen ops add rows by index; which one is right on the CPU depends on the size (on a GPU, ``index_put_``:
it accumulates through a stable sort of the indices there, where ``index_add_`` adds atomically):

- ``index_put_`` with ``accumulate=True`` adds serially in index order below torch's grain (32768 elements,
  TensorIterator's ``GRAIN_SIZE``) and runs no parallel region. From the grain on, with more than one intra-op
  thread, it adds in parallel with atomic adds, in whatever order the threads reach an element: not the loop's
  bits, and not the same bits twice (50 calls on 128 rows of 512 repeating 8 indices, two threads: 50 different
  results), and ~10x slower an element (64 rows of 512, a 32-sequence decode step's pairs: 89 us against 8.5 for
  32 rows; 1024 rows of 512, a 512-token prompt chunk's: 1.4 ms).
- ``Tensor.index_add_`` adds row by row in index order, each row one vectorized add: the loop's bits on any
  number of threads; 7.6 us for 64 rows of 512, 28 us for 1024. But each add is its own parallel region, and
  with the idle OpenMP threads asleep (``OMP_WAIT_POLICY=PASSIVE``, as the CLI sets it where the expert groups run
  in other processes: ``infra.openmp_wait``) waking them costs ~50 us a call: 52.7 us for 16 rows of 512 against
  index_put_'s 10.1.

So on the CPU below the grain ``index_put_``, from it ``index_add_`` (measured on this project's 2-core host, two
threads); ``tests/test_row_sums.py`` checks the loop's bits on both sides, repeated indices included, call after
call. A serving step makes dozens of these calls.

Both ATen ops also allocate on every call (``index_add_`` an expanded index of 8 bytes an element, 2 MB for a
480-token prompt's rows), and in a serving process a fresh allocation of that size is fresh pages: in ``up
--groups-as in-process``, a 480-token prompt's partial sums took ~400 us an add (two a MoE layer) where the same
add alone takes 17. So on the CPU, float32, ``row_sums.cpp`` adds in one serial pass (the loop itself, allocating
nothing) once ``load`` has built it: 1.3 / 2.3 / 8.9 / 18.9 us for 16 / 64 / 256 / 480 rows of 512 (two threads,
hot caches) against 4.8 / 83 / 324 / 622 (``index_put_``) and 5.8 / 6.4 / 11.8 / 16.6 (``index_add_``). Before
``load``, or where the kernel does not build, the ATen ops above.

Shapes: out [T, ...], index [S] int64 on out's device, rows [S, ...].
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path

import torch

from expertmesh.infra.native_kernels import load_cpu_kernel

__all__ = ["add_rows", "load"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_suffix(".cpp")
_lock = threading.Lock()
#: whether ``load`` built and registered the kernel (``torch.ops.expertmesh_rows.add_rows``)
_built = False

#: elements of ``rows`` from which ``index_put_`` accumulates in parallel (TensorIterator's GRAIN_SIZE) and
#: ``index_add_`` takes over
SERIAL_LIMIT = 32768


@functools.cache
def load() -> bool:
    """Whether the serial kernel is built (once per machine) and ``add_rows`` uses it on the CPU from now; never
    raises (a failed build is logged once, and the ATen ops serve)."""
    global _built
    with _lock:
        _built = load_cpu_kernel(
            "expertmesh_row_sums",
            _SOURCE,
            "row sums kernel",
            "partial sums are added by ATen's index ops",
            lambda: torch.ops.expertmesh_rows.add_rows,
            log,
        )
    return _built


def add_rows(out: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """out[index[i]] += rows[i] for every i, in order (``out.index_add_(0, index, rows)``); returns ``out``."""
    rows = rows.to(out.dtype)
    if _built and out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous():
        return torch.ops.expertmesh_rows.add_rows(out, index, rows)
    # (on CUDA index_put_ accumulates through a stable sort of the indices, index_add_ with atomic adds)
    if out.device.type != "cpu" or rows.numel() < SERIAL_LIMIT:
        return out.index_put_((index,), rows, accumulate=True)
    return out.index_add_(0, index, rows)
