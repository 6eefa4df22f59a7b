"""The CPU decode-attention kernel that reads the KV pool in place (``serving/cpu_paged_decode``), as a pure
function: built here with the host's g++ and ninja, checked against torch SDPA over the same keys gathered."""

from __future__ import annotations

import logging

import pytest
import torch

from expertmesh.serving import cpu_paged_decode


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_paged_decode.load(), "the kernel builds on this host (g++ and ninja)"


def _reference(query, keys, values, slots, lengths, scale):
    """[B, H, dv]: torch SDPA per row over its own slots, the key heads repeated for their query heads."""
    groups = query.shape[1] // keys.shape[1]
    out = []
    for b in range(query.shape[0]):
        own = slots[b, : lengths[b]]
        k, v = (t[own].transpose(0, 1).repeat_interleave(groups, 0) for t in (keys, values))  # [H, n, d]
        out.append(torch.nn.functional.scaled_dot_product_attention(query[b][:, None], k, v, scale=scale)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("d, dv", [(64, 64), (24, 40)], ids=["vector-wide", "ragged-widths"])
def test_each_row_attends_to_its_own_slots_as_sdpa_does(d, dv):
    """Uneven lengths (1 to L), grouped key heads, a strided query, widths that fill the vector unit and widths
    that leave a tail; the padding slots point at a row of NaNs, which would spoil any output that read it."""
    g = torch.Generator().manual_seed(0)
    heads, key_heads, slots_n = 8, 2, 96
    keys = torch.randn(slots_n, key_heads, d, generator=g)
    values = torch.randn(slots_n, key_heads, dv, generator=g)
    poisoned = slots_n - 1
    keys[poisoned], values[poisoned] = float("nan"), float("nan")
    lengths = torch.tensor([1, 7, 33, 20, 40])
    slots = torch.full((len(lengths), int(lengths.max())), poisoned)
    for b, n in enumerate(lengths.tolist()):
        slots[b, :n] = torch.randperm(slots_n - 1, generator=g)[:n]
    query = torch.randn(heads, len(lengths), d, generator=g).transpose(0, 1)  # [B, H, d] strided, as a step's
    scale = 0.37
    out = cpu_paged_decode.paged_decode(query, keys, values, slots, lengths, scale)
    assert out.shape == (len(lengths), heads, dv) and not out.isnan().any()
    torch.testing.assert_close(out, _reference(query, keys, values, slots, lengths, scale), rtol=1e-5, atol=1e-6)


def test_inputs_it_would_read_outside_of_are_refused_with_a_message():
    keys = values = torch.zeros(4, 1, 16)
    query = torch.zeros(2, 2, 16)
    ok_slots, ok_lengths = torch.tensor([[0, 1], [2, 3]]), torch.tensor([2, 1])
    cases = {
        "a slot outside the pool": (query, keys, values, torch.tensor([[0, 4], [2, 3]]), ok_lengths),
        "a length outside 1 .. L": (query, keys, values, ok_slots, torch.tensor([3, 1])),
        "float32 only": (query.double(), keys.double(), values.double(), ok_slots, ok_lengths),
        "slots [B, L] and lengths [B]": (query, keys, values, ok_slots.int(), ok_lengths),
    }
    for message, args in cases.items():
        with pytest.raises(RuntimeError, match=message.replace(".", r"\.").replace("[", r"\[")):
            cpu_paged_decode.paged_decode(*args, 1.0)
    assert cpu_paged_decode.paged_decode(query, keys, values, ok_slots, ok_lengths, 1.0).shape == (2, 2, 16)


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
