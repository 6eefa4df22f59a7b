"""The decode-sized rows path of an expert group (``models.expert_rows``): the same bits as the stock
experts module, on every verified architecture, or the stock module itself (torch's own products, the ``blas``
linear kernel; the packed kernel's products are ``test_linear_kernels``').

Real transformers checkpoints (tiny, random weights, built with transformers' own config classes); no
stand-ins."""

from __future__ import annotations

import pytest
import torch

from expertmesh.models import hosted_experts as hosted_mod
from expertmesh.models.checkpoint import Checkpoint
from expertmesh.models.expert_rows import matches_stock, rows_forward
from expertmesh.models.hosted_experts import HostedExperts

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"]


def _calls(spec, seed: int):
    """Decode-sized calls of one layer: 1, 2 and 5 tokens, top-k slots each, some empty (-1)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for tokens in (1, 2, 5):
        ids = torch.stack([torch.randperm(spec.num_experts, generator=g)[: spec.top_k] for _ in range(tokens)])
        ids[torch.rand(ids.shape, generator=g) < 0.2] = -1
        out.append((torch.randn(tokens, spec.hidden_size, generator=g), ids.int(), torch.rand(ids.shape, generator=g)))
    return out


def _mixtral_layer(tiny_checkpoints) -> tuple[Checkpoint, HostedExperts, int]:
    """A group holding every expert of the tiny Mixtral's first MoE layer."""
    checkpoint = Checkpoint(tiny_checkpoints("mixtral"))
    hosted = HostedExperts(checkpoint, linear_kernel="blas")  # torch's own products: the stock module's bits
    layer = checkpoint.spec.moe_layers[0]
    hosted.load([(layer, e) for e in range(checkpoint.spec.num_experts)])
    return checkpoint, hosted, layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_rows_path_gives_the_stock_modules_bits(tiny_checkpoints, arch, dtype, monkeypatch):
    """Every layer of every verified architecture takes the rows path, and a decode-sized call gives
    exactly what the stock module gives the same call (the tensor path, SMALL_RECORD_ROWS = 0), with the
    same statistics."""
    checkpoint = Checkpoint(tiny_checkpoints(arch))
    spec = checkpoint.spec
    pairs = [(layer, e) for layer in spec.moe_layers for e in range(spec.num_experts)]
    fast, stock = (HostedExperts(checkpoint, dtype=dtype, linear_kernel="blas") for _ in range(2))
    fast.load(pairs)
    stock.load(pairs)
    assert all(fast._layers[layer].rows_fast for layer in spec.moe_layers)
    for layer in spec.moe_layers:
        for hidden, ids, weights in _calls(spec, seed=layer):
            mine = fast.compute(layer, hidden, ids, weights)
            monkeypatch.setattr(hosted_mod, "SMALL_RECORD_ROWS", 0)
            theirs = stock.compute(layer, hidden, ids, weights)
            monkeypatch.undo()
            assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)
    assert [(layer, e, vars(s)) for layer, e, s in fast.expert_stats()] == [
        (layer, e, vars(s)) for layer, e, s in stock.expert_stats()
    ]


def test_a_module_the_description_does_not_fit_keeps_its_own_forward(tiny_checkpoints, monkeypatch):
    """An experts class whose eager loop computes differently from what its interface attributes say
    (here: a gate the attributes do not describe) fails the check at load, and its calls go through its
    own forward: still the module's bits."""
    checkpoint, hosted, layer = _mixtral_layer(tiny_checkpoints)
    spec = checkpoint.spec
    module = hosted._layers[layer].module
    assert matches_stock(module, spec.hidden_size, torch.float32, torch.device("cpu"))

    module._apply_gate = lambda gate_up: gate_up[..., ::2] * gate_up[..., 1::2]  # not what its forward does
    assert not matches_stock(module, spec.hidden_size, torch.float32, torch.device("cpu"))
    del module._apply_gate
    hosted._templates[layer]._apply_gate = lambda gate_up: gate_up[..., ::2]
    hosted.load([(layer, 0)], reload=True)  # a new build checks again
    held = hosted._layers[layer]
    assert not held.rows_fast
    _, reference, _ = _mixtral_layer(tiny_checkpoints)  # the stock module's forward, by the tensor path
    for hidden, ids, weights in _calls(spec, seed=3):
        mine = hosted.compute(layer, hidden, ids, weights)  # decode-sized: the small path, stock forward
        monkeypatch.setattr(hosted_mod, "SMALL_RECORD_ROWS", 0)
        assert torch.equal(mine, reference.compute(layer, hidden, ids, weights))
        monkeypatch.undo()


def test_rows_forward_keeps_row_order_for_an_expert_with_several_rows(tiny_checkpoints):
    """Rows of one expert are computed in one product, in row order, as the stock loop does; each row's
    weight scales its own output."""
    checkpoint, hosted, layer = _mixtral_layer(tiny_checkpoints)
    spec = checkpoint.spec
    module = hosted._layers[layer].module
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, spec.hidden_size, generator=g)
    weights = torch.rand(4, 1, generator=g)
    local = [1, 0, 1, 1]
    with torch.no_grad():
        stock = module(hidden, torch.tensor(local)[:, None], weights)
        assert torch.equal(rows_forward(module, hidden, local, weights), stock)
        doubled = rows_forward(module, hidden, local, weights * 2)
    assert torch.allclose(doubled, stock * 2, rtol=1e-6, atol=1e-7)
