"""``infra.row_sums.add_rows``: the bits of the plain loop, on either side of the size where it switches ops,
repeated indices included, and the same bits every call on several threads (the router's and the groups' partial
sums depend on it)."""

from __future__ import annotations

import pytest
import torch

from expertmesh.infra.row_sums import SERIAL_LIMIT, add_rows


def _loop(out: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """out[index[i]] += rows[i], one row after another, as the reference."""
    out = out.clone()
    for i, t in enumerate(index.tolist()):
        out[t] += rows[i]
    return out


@pytest.mark.parametrize("width", [512, 4096])
@pytest.mark.parametrize("num_rows", [1, 3, 16, 63, 64, 65, 1024])
def test_add_rows_gives_the_loop_bits(num_rows: int, width: int) -> None:
    g = torch.Generator().manual_seed(num_rows * width)
    tokens = max(1, num_rows // 2)
    out = torch.randn(tokens, width, generator=g)
    index = torch.randint(0, tokens, (num_rows,), generator=g)  # repeats: several rows into one token
    # magnitudes far apart, so the order of the additions shows in the last bits
    rows = torch.randn(num_rows, width, generator=g) * torch.logspace(-6, 6, num_rows)[:, None]
    expected = _loop(out, index, rows)
    got = add_rows(out.clone(), index, rows)
    assert torch.equal(got, expected)


def test_add_rows_is_deterministic_on_several_threads() -> None:
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


def test_add_rows_casts_the_rows_and_returns_out() -> None:
    out = torch.zeros(2, 4)
    got = add_rows(out, torch.tensor([1, 1]), torch.ones(2, 4, dtype=torch.float64))
    assert got is out
    assert torch.equal(out, torch.tensor([[0.0] * 4, [2.0] * 4]))
