"""The CPU prefill attention kernel (``serving.cpu_prefill_attention`` and its C++ source): each query over the keys
at or before its position, as torch's SDPA computes it to float32 rounding, at any shape a step hands it (one query
or hundreds, a prompt's first chunk or a later one, grouped and single key heads, key widths that are not a vector's
multiple, strided queries); a row's bits the same alone, as a later chunk and on any number of threads; shapes it
does not take refused with a message.

The real kernel, compiled on this machine by torch's extension loader (as ``expertmesh up`` builds it); nothing is
faked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from expertmesh.serving import cpu_prefill_attention
from expertmesh.serving.cpu_prefill_attention import causal_attention

pytestmark = pytest.mark.skipif(
    not cpu_prefill_attention.load(), reason="no C++ compiler here: the kernel cannot build"
)


def _rows(n: int, length: int, heads: int, key_heads: int, d: int, dv: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    # queries as the step's projections hand them over: [1, H, n, d] viewed from [1, n, H, d]
    query = torch.randn(1, n, heads, d, generator=g).transpose(1, 2)
    keys = torch.randn(1, key_heads, length, d, generator=g)
    values = torch.randn(1, key_heads, length, dv, generator=g)
    return query, keys, values


def _sdpa(query, keys, values, scale):
    n, length = query.shape[2], keys.shape[2]
    allowed = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]  # [n, L] bottom-right
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=allowed, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)  # [1, n, H, dv]


@pytest.mark.parametrize(
    "n, length, heads, key_heads, d, dv",
    [
        (1, 1, 4, 4, 8, 32),  # one query, one key
        (5, 5, 4, 2, 16, 32),  # within one block of keys
        (33, 33, 8, 2, 64, 64),  # a key block and one more, a query block and one more
        (40, 100, 4, 1, 24, 32),  # a later chunk, one key head, keys not a vector wide
        (17, 70, 6, 3, 32, 96),  # three value tiles
        (480, 480, 8, 2, 64, 64),  # the bench model's prompt
    ],
)
def test_each_query_attends_its_keys_as_sdpa_does(n, length, heads, key_heads, d, dv):
    query, keys, values = _rows(n, length, heads, key_heads, d, dv, seed=n + length)
    scale = d**-0.5
    got = causal_attention(query, keys, values, scale)
    assert got.shape == (1, n, heads, dv)
    torch.testing.assert_close(got, _sdpa(query, keys, values, scale), atol=2e-6, rtol=1e-5)


def test_a_rows_bits_are_the_same_as_a_later_chunk_and_on_any_number_of_threads():
    """A prompt's rows computed whole, as its last 37 (a later chunk, a prefix-cached prompt's rest) or its last
    one, on one thread or two: the same bits (the key blocks start at position 0 whatever the chunk)."""
    query, keys, values = _rows(100, 100, 8, 2, 64, 64, seed=7)
    whole = causal_attention(query, keys, values, 0.125)
    for tail in (37, 1):
        part = causal_attention(query[:, :, -tail:], keys, values, 0.125)
        assert torch.equal(part, whole[:, -tail:]), tail
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(causal_attention(query, keys, values, 0.125), whole)
    finally:
        torch.set_num_threads(threads)


def test_shapes_it_does_not_take_are_refused_with_a_message():
    query, keys, values = _rows(4, 8, 4, 2, 16, 32, seed=1)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        causal_attention(query, keys, values[..., :24], 0.25)
    with pytest.raises(RuntimeError, match="multiple of key heads"):
        causal_attention(query[:, :3], keys, values, 0.25)
    with pytest.raises(RuntimeError, match="no more queries than keys"):
        causal_attention(query, keys[:, :, :3], values[:, :, :3], 0.25)
    with pytest.raises(RuntimeError, match="float32"):
        causal_attention(query.double(), keys, values, 0.25)
