"""``models.call_statistics.per_expert``: the kernel (``call_statistics.cpp``, built here) and both of its
fallbacks (the loop in plain Python, ``torch.bincount`` in double precision) give the same statistics to the bit,
with rows that are not finite, finite rows whose norm overflows, routing weights of 0 and below, experts without a
row, and no row at all."""

from __future__ import annotations

import pytest
import torch

from expertmesh.models import call_statistics
from expertmesh.models.call_statistics import per_expert
from helpers import kernel_or_fallback

PATHS = ["kernel", "loop", "tensors"]


@pytest.fixture
def take(monkeypatch):
    """take(path): per_expert from now on the kernel (built: a failed build fails the test), the Python loop or
    torch.bincount."""

    def chosen(path: str) -> None:
        kernel_or_fallback("kernel" if path == "kernel" else "fallback", monkeypatch, call_statistics)
        monkeypatch.setattr(call_statistics, "LOOP_ROWS", 1 << 30 if path == "loop" else -1)

    return chosen


def _every_path(take, *args) -> dict[str, str]:
    """per_expert(*args) on each path, as repr (every bit of every float, NaN and Inf included)."""
    got = {}
    for path in PATHS:
        take(path)
        got[path] = repr(per_expert(*args))
    return got


@pytest.mark.parametrize("num_rows", [0, 1, 7, 64, 480])
def test_every_path_gives_the_same_bits(num_rows: int, take) -> None:
    g = torch.Generator().manual_seed(num_rows)
    n = 6
    local = torch.randint(0, n - 1, (num_rows,), generator=g)  # the last expert has no row
    weights = torch.rand(num_rows, generator=g) * torch.logspace(-3, 1, num_rows) if num_rows else torch.rand(0)
    rows = torch.randn(num_rows, 64, generator=g) * torch.logspace(-4, 4, num_rows)[:, None]
    got = _every_path(take, local, weights, rows, n)
    assert got["kernel"] == got["loop"] == got["tensors"], got
    table = eval(got["kernel"])  # noqa: S307 (our own repr of ints and floats)
    assert all(e != n - 1 for e, *_ in table) and sum(r for _, r, *_ in table) == num_rows


def test_rows_that_are_not_finite_and_weights_of_zero_or_below(take) -> None:
    """A NaN or an Inf row counts as non-finite and stays out of the norms; a finite row whose squares overflow
    (its norm is Inf) is finite and counted in (so its expert's mean is Inf, as before); a weight of 0 counts the
    row but not its norm; a negative weight is a weight of its magnitude."""
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(8, 16, generator=g)
    rows[1, 3] = float("nan")
    rows[2, 0] = float("inf")
    rows[5] = 3e30  # finite, its squares overflow float32
    local = torch.tensor([0, 0, 1, 1, 2, 3, 2, 2])
    weights = torch.tensor([0.5, 0.2, 0.3, 0.0, -0.25, 0.5, 0.75, 1.0])
    got = _every_path(take, local, weights, rows, 4)
    assert got["kernel"] == got["loop"] == got["tensors"], got
    take("kernel")
    by = {e: rest for e, *rest in per_expert(local, weights, rows, 4)}
    assert by[0][:3] == [2, 1, 1] and by[1][:3] == [2, 1, 0] and by[2][:3] == [3, 0, 3]
    assert by[3][2] == 1 and by[3][3] == float("inf")  # (its m2, Inf - Inf, is NaN)
    assert by[0][3] == torch.linalg.vector_norm(rows[0]).item() / 0.5  # the mean of one norm / |weight|


def test_the_kernel_refuses_a_local_expert_out_of_range() -> None:
    assert call_statistics.load()
    with pytest.raises(RuntimeError, match="out of range"):
        per_expert(torch.tensor([0, 4]), torch.ones(2), torch.ones(2, 3), 4)
