"""``models.call_statistics.per_expert``: the kernel (``call_statistics.cpp``, built here) gives the plain-Python
loop's statistics to the bit, and both give what ``torch.bincount`` sums in double precision (the tensor path the
kernel replaced), with rows that are not finite, finite rows whose norm overflows, routing weights of 0 and below,
experts without a row, and no row at all."""

from __future__ import annotations

import pytest
import torch

from expertmesh.models import call_statistics
from expertmesh.models.call_statistics import per_expert
from helpers import kernel_or_fallback


@pytest.fixture(params=["kernel", "python"])
def path(request, monkeypatch):
    """Each test on the kernel and on the fallback."""
    return kernel_or_fallback(request.param, monkeypatch, call_statistics)


def _bincount_reference(local: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, n: int) -> list[tuple]:
    """The statistics as the tensor path summed them (``torch.bincount`` in double precision, in row order)."""
    finite = torch.isfinite(rows).all(dim=1)
    scale = weights.abs().double()
    usable = finite & (scale > 0)
    norms = torch.where(usable, rows.float().norm(dim=1).double() / scale, 0.0)
    count = torch.bincount(local, minlength=n).double()
    bad = torch.bincount(local, weights=(~finite).double(), minlength=n)
    normed = torch.bincount(local, weights=usable.double(), minlength=n)
    mean = torch.bincount(local, weights=norms, minlength=n) / normed.clamp(min=1)
    deviation = torch.where(usable, norms - mean[local], 0.0)
    m2 = torch.bincount(local, weights=deviation * deviation, minlength=n)
    table = torch.stack([count, bad, normed, mean, m2], dim=1).tolist()
    return [(e, int(c), int(b), int(k), mu, sq) for e, (c, b, k, mu, sq) in enumerate(table) if c]


@pytest.mark.parametrize("num_rows", [0, 1, 7, 64, 480])
def test_per_expert_gives_the_loop_and_bincount_bits(num_rows: int, path: str) -> None:
    g = torch.Generator().manual_seed(num_rows)
    n = 6
    local = torch.randint(0, n - 1, (num_rows,), generator=g)  # the last expert has no row
    weights = torch.rand(num_rows, generator=g) * torch.logspace(-3, 1, num_rows) if num_rows else torch.rand(0)
    rows = torch.randn(num_rows, 64, generator=g) * torch.logspace(-4, 4, num_rows)[:, None]
    got = per_expert(local, weights, rows, n)
    assert repr(got) == repr(_bincount_reference(local, weights, rows, n))  # repr: every bit of every float
    assert all(e != n - 1 for e, *_ in got) and sum(r for _, r, *_ in got) == num_rows


def test_rows_that_are_not_finite_and_weights_of_zero_or_below(path: str) -> None:
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
    got = per_expert(local, weights, rows, 4)
    assert repr(got) == repr(_bincount_reference(local, weights, rows, 4))  # NaN and Inf alike
    by = {e: rest for e, *rest in got}
    assert by[0][:3] == [2, 1, 1] and by[1][:3] == [2, 1, 0] and by[2][:3] == [3, 0, 3]
    assert by[3][2] == 1 and by[3][3] == float("inf")  # (its m2, Inf - Inf, is NaN)


def test_the_kernel_refuses_a_local_expert_out_of_range() -> None:
    assert call_statistics.load()
    with pytest.raises(RuntimeError, match="out of range"):
        per_expert(torch.tensor([0, 4]), torch.ones(2), torch.ones(2, 3), 4)
