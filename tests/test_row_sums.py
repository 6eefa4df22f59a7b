"""``infra.row_sums.add_rows``: the bits of the plain loop, by the serial kernel (``row_sums.cpp``, built here) and
by the ATen ops it falls back to on either side of the size where they switch, repeated indices included, and the
same bits every call on several threads (the router's and the groups' partial sums depend on it)."""

from __future__ import annotations

import pytest
import torch

from expertmesh.infra import row_sums
from expertmesh.infra.row_sums import SERIAL_LIMIT, add_rows
from helpers import kernel_or_fallback


@pytest.fixture(params=["kernel", "aten"])
def path(request, monkeypatch):
    """Each test on the kernel and on the fallback."""
    return kernel_or_fallback(request.param, monkeypatch, row_sums)


def _loop(out: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """out[index[i]] += rows[i], one row after another, as the reference."""
    out = out.clone()
    for i, t in enumerate(index.tolist()):
        out[t] += rows[i]
    return out


@pytest.mark.parametrize("width", [512, 4096])
@pytest.mark.parametrize("num_rows", [1, 3, 16, 63, 64, 65, 1024])
def test_add_rows_gives_the_loop_bits(num_rows: int, width: int, path: str) -> None:
    g = torch.Generator().manual_seed(num_rows * width)
    tokens = max(1, num_rows // 2)
    out = torch.randn(tokens, width, generator=g)
    index = torch.randint(0, tokens, (num_rows,), generator=g)  # repeats: several rows into one token
    # magnitudes far apart, so the order of the additions shows in the last bits
    rows = torch.randn(num_rows, width, generator=g) * torch.logspace(-6, 6, num_rows)[:, None]
    expected = _loop(out, index, rows)
    got = add_rows(out.clone(), index, rows)
    assert torch.equal(got, expected)


def test_add_rows_is_deterministic_on_several_threads(path: str) -> None:
    """Past the switch, on two threads, every call gives the loop's bits. ``index_put_``'s accumulating path there
    adds in parallel (atomic adds in whatever order the threads reach them): on this project's 2-core host, 50
    calls on these rows gave 50 different results, none the loop's, which is why add_rows does not use it there."""
    g = torch.Generator().manual_seed(0)
    num_rows = 2 * SERIAL_LIMIT // 512
    out = torch.randn(8, 512, generator=g)
    index = torch.randint(0, 8, (num_rows,), generator=g)
    rows = torch.randn(num_rows, 512, generator=g) * torch.logspace(-6, 6, num_rows)[:, None]
    expected = _loop(out, index, rows)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        results = [add_rows(out.clone(), index, rows) for _ in range(20)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, expected) for r in results)


def test_add_rows_casts_the_rows_and_returns_out(path: str) -> None:
    out = torch.zeros(2, 4)
    got = add_rows(out, torch.tensor([1, 1]), torch.ones(2, 4, dtype=torch.float64))
    assert got is out
    assert torch.equal(out, torch.tensor([[0.0] * 4, [2.0] * 4]))


def test_the_kernel_refuses_an_index_out_of_range_and_leaves_out_as_it_was() -> None:
    """Every index is checked before any row is added: a bad one is an IndexError (as ATen's ops give) and out is
    untouched."""
    assert row_sums.load()
    out = torch.zeros(3, 4)
    for bad in (3, -1):
        with pytest.raises(IndexError, match="out of range"):
            add_rows(out, torch.tensor([0, bad]), torch.ones(2, 4))
        assert torch.equal(out, torch.zeros(3, 4))


def test_the_kernel_takes_rows_of_any_trailing_shape_and_leaves_other_devices_and_dtypes_to_aten() -> None:
    assert row_sums.load()
    out = torch.zeros(2, 3, 4)
    add_rows(out, torch.tensor([1, 1]), torch.ones(2, 3, 4))
    assert torch.equal(out[1], torch.full((3, 4), 2.0)) and torch.equal(out[0], torch.zeros(3, 4))
    doubles = torch.zeros(2, 4, dtype=torch.float64)  # not the kernel's dtype: index_put_ adds
    add_rows(doubles, torch.tensor([0]), torch.ones(1, 4))
    assert torch.equal(doubles[0], torch.ones(4, dtype=torch.float64))
