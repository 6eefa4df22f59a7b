"""A decode step's attention half in one native op (``serving.cpu_decode_attention`` and its C++ source): the
module's own forward's bits (its output and the keys and values it stores) on decode steps of any layout, its
products on the grouped kernel or torch's, with or without biases; the architectures whose attention computes
anything else keep their forward; any other step (a prompt's chunk beside the decode rows) runs the module's own
forward; a weight written in place is used at once; the state dict keeps its names; bad inputs are refused with a
message.

The real op and the kernels it calls, compiled on this machine by torch's extension loader (as ``expertmesh up``
builds them), real transformers modules of tiny checkpoints (random weights), the real pool and attention backend;
nothing is faked."""

from __future__ import annotations

import pytest
import torch

from expertmesh.models.checkpoint import Checkpoint
from expertmesh.router.model import build_router_model
from expertmesh.serving import cpu_decode_attention
from expertmesh.serving.attention_backends import ATTENTION_BACKENDS, StepLayout, attention_metadata
from expertmesh.serving.cpu_decode_attention import fuse_decode_attention
from expertmesh.serving.forward import MaskSpec, _paged_attention
from expertmesh.serving.kv_cache import KVPool
from expertmesh.serving.paged_attention import STEP

pytestmark = pytest.mark.skipif(not cpu_decode_attention.load(), reason="no C++ compiler here: the op cannot build")

#: architecture -> whether its attention modules take the op: the plain ones (Mixtral's, Qwen2-MoE's with its
#: biases, PhiMoE's, GraniteMoE's with its own scaling) do; a norm of queries and keys (Qwen3-MoE, OLMoE) or a
#: rotary embedding of part of each head (GLM-4-MoE) do not
FUSES = {
    "mixtral": True,
    "qwen2_moe": True,
    "phimoe": True,
    "granitemoe": True,
    "qwen3_moe": False,
    "olmoe": False,
    "glm4_moe": False,
}


def _router(tiny_checkpoints, arch: str, **kwargs):
    model = build_router_model(Checkpoint(tiny_checkpoints(arch, **kwargs)), torch.float32)
    return model, MaskSpec.of(model)


def _attention_modules(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "q_proj") and isinstance(getattr(m, "layer_idx", None), int)]


def _step(model, spec, module, pasts: list[int], prompt: int = 0, seed: int = 0):
    """A packed step of the model's layout: one decode row per past in ``pasts`` (and a prompt chunk of ``prompt``
    tokens first, when not 0), blocks of 4 from a seeded pool; the rows, the model's own rotary embedding at each
    row's position, and (cache, step, pool) planned by the ``cpu-paged-decode`` backend."""
    g = torch.Generator().manual_seed(seed)
    sequences = ([(0, prompt)] if prompt else []) + [(p, 1) for p in pasts]
    tables, next_block = [], 0
    for start, n in sequences:
        blocks = -(-(start + n) // 4)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    pool = KVPool(num_blocks=next_block + 1, block_size=4)
    kv_heads = module.k_proj.out_features // module.head_dim
    pool.allocate(module.layer_idx + 1, ((kv_heads, module.head_dim), (kv_heads, module.head_dim)), torch.float32)
    for tensor in pool.tensors(module.layer_idx):
        tensor.normal_(generator=g)
    metadata = attention_metadata(tables, [s for s, _ in sequences], [n for _, n in sequences], 4)
    layout = StepLayout(spec.implementation, spec.kinds, spec.window, torch.float32)
    cache, step = ATTENTION_BACKENDS["cpu-paged-decode"].plan(metadata, pool, layout)
    hidden = torch.randn(1, len(metadata.positions), module.q_proj.in_features, generator=g)
    positions = torch.from_numpy(metadata.positions)[None]
    embeddings = model.model.rotary_emb(hidden, positions)
    return hidden, embeddings, cache, step, pool


def _forward(model, module, hidden, embeddings, cache, step, stock: bool):
    with _paged_attention(model), torch.no_grad():
        if stock:  # the module's own class's forward
            own = super(cpu_decode_attention._FusedDecodeAttention, module) if _fused(module) else module
            return own.forward(
                hidden_states=hidden, position_embeddings=embeddings, attention_mask=None, cache=cache, **{STEP: step}
            )[0]
        return module(
            hidden_states=hidden, position_embeddings=embeddings, attention_mask=None, cache=cache, **{STEP: step}
        )[0]


def _fused(module) -> bool:
    return type(module).__name__.startswith("FusedDecode")


@pytest.fixture
def op_calls(monkeypatch) -> list[bool]:
    """Each call the fused modules made of the op's path: whether the op computed it (False: it fell back)."""
    calls: list[bool] = []
    real = cpu_decode_attention._fused

    def spy(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cpu_decode_attention, "_fused", spy)
    return calls


@pytest.mark.parametrize("arch", sorted(FUSES))
def test_the_plain_attention_modules_take_the_op_and_the_others_keep_their_forward(tiny_checkpoints, arch):
    model, spec = _router(tiny_checkpoints, arch)
    modules = _attention_modules(model)
    stock_class = type(modules[0])
    names = set(model.state_dict())
    fused = fuse_decode_attention(model, spec.kinds, spec.window)
    assert fused == (len(modules) if FUSES[arch] else 0)
    assert all(_fused(m) == FUSES[arch] and isinstance(m, stock_class) for m in modules)
    assert set(model.state_dict()) == names, "the same parameters under the same names"
    assert fuse_decode_attention(model, spec.kinds, spec.window) == fused, "a fused module is not fused again"


@pytest.mark.parametrize("arch", ["mixtral", "mixtral-sliding", "qwen2_moe", "granitemoe"])
@pytest.mark.parametrize("pasts", [[0], [5, 17, 31, 2, 9, 64, 1, 12], [100]])
def test_a_decode_step_gives_the_modules_own_bits_and_stores_the_same_keys_and_values(
    tiny_checkpoints, op_calls, arch, pasts
):
    """Rows that start a sequence, cross blocks and fill one, one long past (beyond a sliding window, where the model
    has one); fresh seeds and the model's own rotary embedding (not the check's)."""
    if arch == "mixtral-sliding":
        model, spec = _router(tiny_checkpoints, "mixtral", sliding_window=8)
        assert spec.window == 8 and set(spec.kinds) == {"sliding_attention"}
    else:
        model, spec = _router(tiny_checkpoints, arch)
    assert fuse_decode_attention(model, spec.kinds, spec.window) > 0
    op_calls.clear()  # the checks' own
    modules = _attention_modules(model)
    for module in modules:
        results = []
        for stock in (True, False):
            hidden, embeddings, cache, step, pool = _step(model, spec, module, pasts, seed=len(pasts))
            out = _forward(model, module, hidden, embeddings, cache, step, stock)
            results.append((out, [t.clone() for t in pool.tensors(module.layer_idx)]))
        (stock_out, stock_pool), (fused_out, fused_pool) = results
        assert torch.equal(fused_out, stock_out)
        assert all(torch.equal(a, b) for a, b in zip(fused_pool, stock_pool))
    assert op_calls == [True] * len(modules), "every fused call computed by the op"


def test_the_grouped_kernels_products_agree_too(tiny_checkpoints, op_calls):
    """Widths whose products are on the grouped kernel (32 outputs or more each), not torch's."""
    model, spec = _router(
        tiny_checkpoints, "mixtral", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32
    )
    module = _attention_modules(model)[0]
    assert cpu_decode_attention._products(module)[1][0] is not None, "the key product is packed for the grouped kernel"
    assert fuse_decode_attention(model, spec.kinds, spec.window) == len(_attention_modules(model))
    outs = []
    for stock in (True, False):
        hidden, embeddings, cache, step, _ = _step(model, spec, module, [3, 40, 7], seed=3)
        outs.append(_forward(model, module, hidden, embeddings, cache, step, stock))
    assert torch.equal(outs[0], outs[1])
    assert op_calls[-1] is True


def test_a_step_with_a_prompt_chunk_runs_the_modules_own_forward(tiny_checkpoints, monkeypatch):
    model, spec = _router(tiny_checkpoints, "mixtral")
    fuse_decode_attention(model, spec.kinds, spec.window)
    module = _attention_modules(model)[0]

    def never(*args):
        raise AssertionError("the op was used for a step with a prompt chunk")

    monkeypatch.setattr(cpu_decode_attention, "_fused", never)
    hidden, embeddings, cache, step, _ = _step(model, spec, module, [4, 9], prompt=6)
    out = _forward(model, module, hidden, embeddings, cache, step, stock=False)
    assert out.shape == (1, 8, module.o_proj.out_features)


def test_a_weight_written_in_place_is_used_at_once(tiny_checkpoints):
    """A hot update or an injected fault (``PackedLinear``'s copies follow their weight's version): the op's output
    changes with it and still equals the module's own."""
    model, spec = _router(
        tiny_checkpoints, "mixtral", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32
    )
    fuse_decode_attention(model, spec.kinds, spec.window)
    module = _attention_modules(model)[0]
    before = _forward(model, module, *_step(model, spec, module, [5, 6])[:4], stock=False)
    with torch.no_grad():
        module.q_proj.weight[3] += 1.0
        module.o_proj.weight[:, 0] *= 2.0
    after = [_forward(model, module, *_step(model, spec, module, [5, 6])[:4], stock=s) for s in (True, False)]
    assert not torch.equal(before, after[1])
    assert torch.equal(after[0], after[1])


def test_bad_inputs_are_refused_with_a_message(tiny_checkpoints):
    model, spec = _router(tiny_checkpoints, "mixtral")
    module = _attention_modules(model)[0]
    q, k, v, o = cpu_decode_attention._products(module)
    keys = torch.zeros(8, 2, module.head_dim)
    x = torch.zeros(2, module.q_proj.in_features)
    cos = torch.ones(2, module.head_dim)
    table, firsts, lengths = torch.tensor([[0], [1]]), torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.long)
    heads = module.q_proj.out_features // module.head_dim

    def call(slots, pool=keys, width=cos):
        return torch.ops.expertmesh_decode.decode_attention(
            x, *q, *k, *v, *o, width, width, pool, pool.clone(), slots, table, firsts, lengths, heads, 4, 1.0
        )

    with pytest.raises(RuntimeError, match="write slot outside the pool"):
        call(torch.tensor([0, 8]))
    with pytest.raises(RuntimeError, match="cos and sin"):
        call(torch.tensor([0, 4]), width=torch.ones(2, module.head_dim // 2))
    with pytest.raises(RuntimeError, match="widths"):
        call(torch.tensor([0, 4]), pool=torch.zeros(8, 1, module.head_dim))


def test_a_host_where_the_op_does_not_build_keeps_every_modules_forward(tiny_checkpoints, monkeypatch):
    model, spec = _router(tiny_checkpoints, "mixtral")
    monkeypatch.setattr(cpu_decode_attention, "load", lambda: False)
    assert fuse_decode_attention(model, spec.kinds, spec.window) == 0
    assert not any(_fused(m) for m in _attention_modules(model))
