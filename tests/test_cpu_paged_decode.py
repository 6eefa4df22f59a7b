"""The CPU decode-attention kernel that reads the KV pool in place through block tables
(``serving/cpu_paged_decode``), as a pure function: built here with the host's g++ and ninja, checked against
torch SDPA over the same keys gathered."""

from __future__ import annotations

import logging

import pytest
import torch

from expertmesh.serving import cpu_paged_decode


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_paged_decode.load(), "the kernel builds on this host (g++ and ninja)"


def _slots(table, first, length, block_size):
    """The pool slots of positions first .. first + length - 1 under ``table`` (the oracle: one at a time)."""
    return [table[p // block_size] * block_size + p % block_size for p in range(first, first + length)]


def _reference(query, keys, values, tables, firsts, lengths, block_size, scale):
    """[B, H, dv]: torch SDPA per row over its own positions' slots, the key heads repeated for their query
    heads."""
    groups = query.shape[1] // keys.shape[1]
    out = []
    for b in range(query.shape[0]):
        own = torch.tensor(_slots(tables[b].tolist(), int(firsts[b]), int(lengths[b]), block_size))
        k, v = (t[own].transpose(0, 1).repeat_interleave(groups, 0) for t in (keys, values))  # [H, n, d]
        out.append(torch.nn.functional.scaled_dot_product_attention(query[b][:, None], k, v, scale=scale)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("d, dv", [(64, 64), (24, 40)], ids=["vector-wide", "ragged-widths"])
def test_each_row_attends_to_its_own_positions_as_sdpa_does(d, dv):
    """Uneven lengths (1 to 40), key ranges starting inside a block and after blocks given back (-1 in the
    table, as behind a sliding window), blocks anywhere in the pool, grouped key heads, a strided query, widths
    that fill the vector unit and widths that leave a tail; every slot a row does not attend to holds NaN, which
    would spoil any output that read it."""
    g = torch.Generator().manual_seed(0)
    heads, key_heads, block_size, blocks = 8, 2, 4, 40
    keys = torch.full((blocks * block_size, key_heads, d), float("nan"))
    values = torch.full((blocks * block_size, key_heads, dv), float("nan"))
    firsts = torch.tensor([0, 3, 0, 9, 8, 17])
    lengths = torch.tensor([1, 7, 33, 20, 1, 23])
    width = int(((firsts + lengths - 1) // block_size).max()) + 2  # a spare -1 column, as a wider table has
    tables = torch.full((len(lengths), width), -1)
    order = torch.randperm(blocks, generator=g).tolist()
    for b, (first, n) in enumerate(zip(firsts.tolist(), lengths.tolist())):
        held = range(first // block_size, (first + n - 1) // block_size + 1)  # the blocks before: given back
        for j in held:
            tables[b, j] = order.pop()
        for slot in _slots(tables[b].tolist(), first, n, block_size):
            keys[slot], values[slot] = torch.randn(key_heads, d, generator=g), torch.randn(key_heads, dv, generator=g)
    query = torch.randn(heads, len(lengths), d, generator=g).transpose(0, 1)  # [B, H, d] strided, as a step's
    scale = 0.37
    out = cpu_paged_decode.paged_decode(query, keys, values, tables, firsts, lengths, block_size, scale)
    assert out.shape == (len(lengths), heads, dv) and not out.isnan().any()
    expected = _reference(query, keys, values, tables, firsts, lengths, block_size, scale)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_inputs_it_would_read_outside_of_are_refused_with_a_message():
    keys = values = torch.zeros(8, 1, 16)  # 4 blocks of 2
    query = torch.zeros(2, 2, 16)
    ok_tables, ok_firsts, ok_lengths = torch.tensor([[0, 1], [-1, 3]]), torch.tensor([0, 2]), torch.tensor([3, 1])
    cases = [
        ("a block outside the pool", torch.tensor([[0, 4], [-1, 3]]), ok_firsts, ok_lengths, 2),
        ("a block outside the pool", ok_tables, torch.tensor([0, 1]), ok_lengths, 2),  # reads the -1 block
        ("a key range outside its block table", ok_tables, ok_firsts, torch.tensor([5, 1]), 2),
        ("a key range outside its block table", ok_tables, ok_firsts, torch.tensor([0, 1]), 2),  # empty
        ("a pool of whole blocks", ok_tables, ok_firsts, ok_lengths, 3),
        ("block_tables [B, M], firsts [B] and lengths [B], int64", ok_tables.int(), ok_firsts, ok_lengths, 2),
    ]
    for message, tables, firsts, lengths, size in cases:
        with pytest.raises(RuntimeError, match=message.replace(".", r"\.").replace("[", r"\[")):
            cpu_paged_decode.paged_decode(query, keys, values, tables, firsts, lengths, size, 1.0)
    with pytest.raises(RuntimeError, match="float32 only"):
        cpu_paged_decode.paged_decode(
            query.double(), keys.double(), values.double(), ok_tables, ok_firsts, ok_lengths, 2, 1.0
        )
    out = cpu_paged_decode.paged_decode(query, keys, values, ok_tables, ok_firsts, ok_lengths, 2, 1.0)
    assert out.shape == (2, 2, 16)


def test_a_host_that_cannot_build_it_says_why_once_and_keeps_serving(monkeypatch, caplog):
    """``load`` never raises: the build's error is logged and the backend chooser falls back (the engine test
    ``test_each_kernel_only_where_it_computes_the_models_attention`` checks that choice)."""
    import torch.utils.cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", no_compiler)
    cpu_paged_decode.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_paged_decode.__name__):
            assert cpu_paged_decode.load() is False and cpu_paged_decode.load() is False
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "Ninja is required" in warnings[0], warnings
    finally:
        cpu_paged_decode.load.cache_clear()
    monkeypatch.undo()
    assert cpu_paged_decode.load(), "built again from torch's extensions folder"
