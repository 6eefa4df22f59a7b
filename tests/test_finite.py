"""expertmesh.infra.finite answers exactly as torch.isfinite does, its shortcut (a finite sum) included:
large finite values whose sum overflows are finite, a NaN or an Inf anywhere is not."""

import pytest
import torch

from expertmesh.infra.finite import all_finite, finite_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_all_finite_is_isfinite_all(dtype):
    big = torch.finfo(dtype).max
    cases = [
        torch.randn(8, 100, dtype=dtype),
        torch.full((4, 4), big, dtype=dtype),  # finite, but the sum overflows: the exact check answers
        torch.tensor([big, -big, big], dtype=dtype),
        torch.zeros(0, 5, dtype=dtype),
        torch.tensor([1.0, float("nan")], dtype=dtype),
        torch.tensor([float("inf"), 1.0], dtype=dtype),
        torch.tensor([float("-inf"), float("inf")], dtype=dtype),  # the sum is NaN
    ]
    for t in cases:
        assert all_finite(t) == bool(torch.isfinite(t).all()), t


def test_integer_tensors_are_finite():
    assert all_finite(torch.tensor([[1, -2], [3, 4]], dtype=torch.int32))
    assert finite_rows(torch.arange(6).reshape(3, 2)).tolist() == [True, True, True]


def test_finite_rows_is_isfinite_by_row():
    big = torch.finfo(torch.float32).max
    t = torch.randn(6, 10)
    t[1, 3] = float("nan")
    t[3] = big  # finite, its sum overflows
    t[4, 0] = float("-inf")
    assert finite_rows(t).tolist() == [True, False, True, True, False, True]
    assert finite_rows(torch.randn(5, 3, 2)).tolist() == [True] * 5  # rows of any shape
    assert finite_rows(torch.tensor([1.0, float("inf")])).tolist() == [True, False]
    assert finite_rows(torch.zeros(0, 4)).shape == (0,)
    half = torch.full((2, 8), 60000.0, dtype=torch.float16)  # a float16 sum would be Inf
    assert finite_rows(half).tolist() == [True, True] and all_finite(half)
