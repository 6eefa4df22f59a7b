"""The linear kernels (``models.linear_kernels``): the packed kernel computes what ``nn.functional.linear`` does
(to float32 rounding), follows its weight through in-place writes, and replaces a model's ``nn.Linear`` modules
without changing their parameters; the router's model and a group's experts compute on it where it is chosen.

Real oneDNN kernels of the installed torch and real transformers checkpoints (tiny, random weights); the one
thing faked is the device a weight says it is on (a meta tensor stands in for a GPU's)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from expertmesh.infra.cpu_threads import WIDE_WORK, one_thread_while
from expertmesh.models import grouped_experts, linear_kernels
from expertmesh.models.checkpoint import Checkpoint
from expertmesh.models.grouped_experts import TILE, GroupedRows, GroupedWeight
from expertmesh.models.hosted_experts import HostedExperts
from expertmesh.models.linear_kernels import (
    BLAS_MAX_ELEMENTS,
    PackedLinear,
    PackedRows,
    PackedWeight,
    choose_linear_kernel,
    pack_linears,
)
from expertmesh.router.model import ZeroExperts, bind_dispatcher, build_router_model

pytestmark = pytest.mark.skipif(
    choose_linear_kernel(torch.device("cpu"), torch.float32) != "onednn-packed",
    reason="this torch is built without oneDNN: the packed kernel is never chosen",
)


def test_the_packed_kernel_is_chosen_for_cpu_float_weights_only(monkeypatch):
    assert choose_linear_kernel(torch.device("cpu"), torch.float32) == "onednn-packed"
    assert choose_linear_kernel(torch.device("cpu"), torch.float16) == "blas"
    assert choose_linear_kernel(torch.device("cuda", 0), torch.float32) == "blas"
    # the router's (grouped=True): the grouped kernel for CPU float32 where it builds, else as above
    built = grouped_experts.load()
    assert choose_linear_kernel(torch.device("cpu"), torch.float32, grouped=True) == (
        "grouped" if built else "onednn-packed"
    )
    assert choose_linear_kernel(torch.device("cpu"), torch.bfloat16, grouped=True) != "grouped"
    assert choose_linear_kernel(torch.device("cuda", 0), torch.float32, grouped=True) == "blas"
    monkeypatch.setattr(grouped_experts, "load", lambda: False)  # the kernel did not build (no compiler)
    assert choose_linear_kernel(torch.device("cpu"), torch.float32, grouped=True) == "onednn-packed"


@pytest.mark.parametrize("supported", [True, False], ids=["bf16-cpu", "avx2-only-cpu"])
def test_bfloat16_is_packed_only_where_the_cpu_runs_onednns_bfloat16_path(supported, monkeypatch):
    """On a CPU without AVX-512 BW/VL/DQ or AVX-NE-CONVERT oneDNN refuses to pack a bfloat16 weight: such weights
    stay on torch's own product. The CPU's answer is faked both ways (the one device query)."""
    monkeypatch.setattr(linear_kernels, "_cpu_runs_onednn_bf16", lambda: supported)
    assert choose_linear_kernel(torch.device("cpu"), torch.bfloat16) == ("onednn-packed" if supported else "blas")
    assert choose_linear_kernel(torch.device("cpu"), torch.float32) == "onednn-packed"


def test_a_bfloat16_model_packs_with_the_kernel_chosen_for_this_cpu():
    """What failed on an AVX2-only host before the check: the kernel chosen for bfloat16 weights here (nothing
    faked) packs them and computes what the module did."""
    chosen = choose_linear_kernel(torch.device("cpu"), torch.bfloat16)
    model = nn.Sequential(nn.Linear(32, 48)).to(torch.bfloat16)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    expected = model(x)
    pack_linears(model, chosen)
    assert isinstance(model[0], PackedLinear) == (chosen == "onednn-packed")
    torch.testing.assert_close(model(x), expected, rtol=2e-2, atol=2e-2)


PACKINGS = [PackedWeight] + ([GroupedWeight] if grouped_experts.load() else [])


@pytest.mark.parametrize("packing", PACKINGS, ids=lambda p: p.__name__)
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 100])
def test_packed_products_are_linears_with_any_rows_and_strides(rows, packing):
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(48, 32, generator=g), torch.randn(48, generator=g)  # 48: a tile and a partial one
    x = torch.randn(rows, 32, generator=g)
    packed = packing(weight)
    torch.testing.assert_close(packed.linear(x, bias), nn.functional.linear(x, weight, bias))
    transposed = torch.randn(32, 48, generator=g)  # [in, out] seen as [out, in]: a GPT-OSS-style stored weight
    torch.testing.assert_close(packing(transposed.t()).linear(x), x @ transposed)
    batched = torch.randn(2, rows, 32, generator=g)  # [B, T, in], as a model's hidden states
    torch.testing.assert_close(packed.linear(batched), nn.functional.linear(batched, weight))
    assert torch.equal(packed.computed(), weight)  # what it multiplies by, read back
    strided = torch.randn(rows, 64, generator=g)[:, ::2]  # rows of a wider tensor, every other column
    torch.testing.assert_close(packed.linear(strided), nn.functional.linear(strided, weight))
    with pytest.raises(RuntimeError, match="dtype"):  # torch's own refusal of rows of another dtype
        packed.linear(x.double())


@pytest.mark.parametrize("packing", PACKINGS, ids=lambda p: p.__name__)
def test_a_packed_weight_follows_in_place_writes(packing):
    """A fault injected or a hot update writes the weight in place: the next product uses the new values."""
    weight = torch.randn(40, 16)
    packed, x = packing(weight), torch.randn(3, 16)
    before = packed.linear(x)
    weight.mul_(2.0)
    torch.testing.assert_close(packed.linear(x), 2.0 * before)
    assert torch.equal(packed.computed(), weight)


def test_a_packed_copy_follows_in_place_writes_to_its_weight():
    """A fault injected or a hot update writes a weight in place: the next product uses the new values,
    through a view of a stacked weight too."""
    g = torch.Generator().manual_seed(0)
    stacked = torch.randn(3, 16, 8, generator=g)  # [E, out, in]
    rows = PackedRows(stacked, transposed=False)
    x = torch.randn(2, 8, generator=g)
    before = rows.row(1).linear(x)
    torch.testing.assert_close(before, x @ stacked[1].t())
    stacked[1].mul_(2.0)
    torch.testing.assert_close(rows.row(1).linear(x), 2.0 * before)
    stacked.fill_(float("nan"))
    assert rows.row(0).linear(x).isnan().all()


def test_pack_linears_keeps_every_parameter_and_the_state_dict():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False)))
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    x = torch.randn(5, 8)
    with torch.no_grad():
        expected = model(x)
        assert pack_linears(model, "onednn-packed") == 2
        assert pack_linears(model, "onednn-packed") == 0  # already packed: nothing to replace
        torch.testing.assert_close(model(x), expected)
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert all(p is params[name] for name, p in model.named_parameters())  # the same tensors, the same names
    assert list(model.state_dict()) == keys
    assert pack_linears(nn.Sequential(nn.Linear(2, 2)), "blas") == 0
    small = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2))  # weights of 128 and 32 elements
    assert pack_linears(small, "onednn-packed", blas_max_elements=32) == 1
    assert isinstance(small[0], PackedLinear) and type(small[1]) is nn.Linear


def test_a_packed_linear_follows_a_replaced_parameter():
    """A load with ``assign=True`` replaces the parameter object itself: the packed copy is made again."""
    model = nn.Sequential(nn.Linear(4, 4))
    pack_linears(model, "onednn-packed")
    x = torch.randn(2, 4)
    with torch.no_grad():
        model(x)
        model[0].weight = nn.Parameter(torch.zeros(4, 4), requires_grad=False)
        torch.testing.assert_close(model(x), model[0].bias.expand(2, 4))


@pytest.mark.parametrize("kernel", [None, "onednn-packed"], ids=["the-routers-choice", "onednn-packed"])
def test_the_router_model_computes_on_the_kernel_it_is_given(tiny_checkpoints, kernel):
    """Every ``nn.Linear`` of the router's model (attention, gates, head) on its kernel but the smallest: by default
    (``grouped`` where its kernel builds) each of a tile's outputs or more, the gate of fewer on torch's own; on
    ``onednn-packed`` those above ``BLAS_MAX_ELEMENTS``. Its logits those of the same model on torch's own kernel,
    to float32 rounding."""
    # a vocabulary whose head [8200, 32] is above BLAS_MAX_ELEMENTS: the tiny model's other weights are below it
    checkpoint = Checkpoint(tiny_checkpoints("mixtral", vocab_size=8200))
    packed = build_router_model(checkpoint, torch.float32, linear_kernel=kernel)
    plain = build_router_model(checkpoint, torch.float32, linear_kernel="blas")
    assert any(isinstance(m, PackedLinear) for m in packed.modules())
    assert not any(isinstance(m, PackedLinear) for m in plain.modules())
    chosen = kernel or choose_linear_kernel(torch.device("cpu"), torch.float32, grouped=True)
    assert chosen == ("grouped" if grouped_experts.load() else "onednn-packed") or kernel is not None
    # each product on the kernel its weight's size picks: the largest packed, the smallest on blas
    linears = [m for m in packed.modules() if isinstance(m, nn.Linear)]
    assert {type(m) for m in linears} == {nn.Linear, PackedLinear}
    for m in linears:
        expected = m.out_features >= TILE if chosen == "grouped" else m.weight.numel() > BLAS_MAX_ELEMENTS
        assert isinstance(m, PackedLinear) == expected, m
        if isinstance(m, PackedLinear):
            assert isinstance(m._weight, GroupedWeight if chosen == "grouped" else PackedWeight)
    ids = torch.randint(
        0, checkpoint.config.get_text_config().vocab_size, (1, 12), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        logits = [bind_dispatcher(m, ZeroExperts())(input_ids=ids).logits for m in (packed, plain)]  # [1, 12, V]
    torch.testing.assert_close(logits[0], logits[1])


@pytest.mark.skipif(not grouped_experts.load(), reason="no C++ compiler here: the grouped kernel cannot build")
def test_the_router_models_large_products_take_its_threads_back_in_a_narrowed_step(tiny_checkpoints, monkeypatch):
    """``build_router_model(threads=...)``: every product on the grouped kernel asks ``all_threads_for`` for the
    router's threads with its outputs as its work, so in a step narrowed to one thread the LM head (8200 outputs a
    row) computes on them and the small attention projections stay on one (the rule: ``test_cpu_threads``)."""
    seen: dict[int, int] = {}  # a product's outputs -> the intra-op threads it computed on
    real = grouped_experts.all_threads_for

    @contextlib.contextmanager
    def recording(work: int, threads: int):
        with real(work, threads):
            seen[work] = torch.get_num_threads()
            yield

    monkeypatch.setattr(grouped_experts, "all_threads_for", recording)
    checkpoint = Checkpoint(tiny_checkpoints("mixtral", vocab_size=8200))
    model = build_router_model(checkpoint, torch.float32, linear_kernel="grouped", threads=2)
    weights = [m._weight for m in model.modules() if isinstance(m, PackedLinear)]
    assert weights and all(isinstance(w, GroupedWeight) and w.threads == 2 for w in weights)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with one_thread_while(True), torch.no_grad():
            bind_dispatcher(model, ZeroExperts())(input_ids=torch.tensor([[5]]))  # one token: a decode step of one
    finally:
        torch.set_num_threads(before)
    assert seen[8200] == 2, seen  # the LM head
    assert all(threads == 1 for work, threads in seen.items() if work < WIDE_WORK), seen


@pytest.mark.parametrize("grouped", [False, True], ids=["onednn-per-expert", "grouped"])
def test_a_groups_experts_compute_on_the_packed_kernel_and_a_fault_reaches_them(tiny_checkpoints, grouped):
    """A group's decode- and prefill-sized calls on the packed kernel (oneDNN's per expert, or the grouped
    kernel, ``models.grouped_experts``) agree with torch's own to float32 rounding; an injected fault changes what
    the packed copies compute (they follow the weights)."""
    checkpoint = Checkpoint(tiny_checkpoints("mixtral"))
    spec = checkpoint.spec
    layer = spec.moe_layers[0]
    pairs = [(layer, e) for e in range(spec.num_experts)]
    packed, plain = HostedExperts(checkpoint, grouped=grouped), HostedExperts(checkpoint, linear_kernel="blas")
    packed.load(pairs)
    plain.load(pairs)
    kind = GroupedRows if grouped else PackedRows
    assert all(isinstance(p, kind) for p in packed._layers[layer].packs.values()) and plain._layers[layer].packs is None
    g = torch.Generator().manual_seed(0)
    for tokens in (2, 40):  # the small path and the tensor path
        hidden = torch.randn(tokens, spec.hidden_size, generator=g)
        ids = torch.stack([torch.randperm(spec.num_experts, generator=g)[: spec.top_k] for _ in range(tokens)])
        weights = torch.rand(ids.shape, generator=g)
        mine = packed.compute(layer, hidden, ids, weights)
        torch.testing.assert_close(mine, plain.compute(layer, hidden, ids, weights))
    packed.inject_fault(layer, int(ids[0, 0]), "nan")
    assert packed.compute(layer, hidden[:1], ids[:1], weights[:1]).isnan().all()


def test_a_layer_built_by_a_live_load_or_unload_is_packed_before_it_serves(tiny_checkpoints):
    """Each expert used to be packed by its first product: on a group that a live move had just loaded (or
    unloaded another expert of the same layer from), the first decode step after the table switch paid for every
    expert of the layer (32 ms instead of 4 on the 214M Mixtral). The module is now warmed before it is published."""
    checkpoint = Checkpoint(tiny_checkpoints("mixtral"))
    layer = checkpoint.spec.moe_layers[0]
    hosted = HostedExperts(checkpoint)
    hosted.load([(layer, 0), (layer, 1)])
    hosted.load([(layer, 2)])  # a live move's load onto a layer the group holds
    held = hosted._layers[layer]
    assert all(pack.computed(i) is not None for pack in held.packs.values() for i in range(len(held.ids)))
    hosted.unload([(layer, 0)])  # rebuilt around the kept experts
    held = hosted._layers[layer]
    assert held.ids == (1, 2)
    assert all(pack.computed(i) is not None for pack in held.packs.values() for i in range(len(held.ids)))
    assert all(stats.calls == 0 for stats in held.stats.values())  # the warm-up recorded nothing


@pytest.mark.parametrize("grouped", [False, True], ids=["onednn-per-expert", "grouped"])
def test_a_fault_torch_does_not_see_still_changes_the_fingerprint(tiny_checkpoints, grouped):
    """A write through ``.data`` (a memory fault's stand-in) bypasses the version counter: the stored weights and
    the packed copy the products use are then apart, and the fingerprint says so whichever of them changed (the
    oneDNN per-expert copies and the grouped kernel's, ``models.grouped_experts``)."""
    checkpoint = Checkpoint(tiny_checkpoints("mixtral"))
    spec = checkpoint.spec
    layer = spec.moe_layers[0]
    hosted = HostedExperts(checkpoint, grouped=grouped)
    hosted.load([(layer, e) for e in range(spec.num_experts)])
    hosted.warm_up()  # every expert's products made once: their packed copies exist
    held = hosted._layers[layer]
    assert isinstance(held.packs["down_proj"], GroupedRows if grouped else PackedRows)

    def now() -> str:
        (_, _, at_load, current), *_ = hosted.fingerprints([(layer, 0)])
        return current if current != at_load else "as loaded"

    assert now() == "as loaded"
    loaded = held.module.down_proj.data[0].clone()
    held.module.down_proj.data[0].mul_(3.0)  # the stored rows change; the packed copy still computes the old ones
    assert now() != "as loaded"
    held.module.down_proj.data[0].copy_(loaded)  # back as loaded
    assert now() == "as loaded"
    # the copy the products use changes (its memory is the kernel's: the fault stood in for by other values)
    if grouped:
        held.packs["down_proj"].packed()[0].mul_(2.0)
    else:
        copy = held.packs["down_proj"].row(0)
        copy._packed = torch.ops.mkldnn._reorder_linear_weight(held.module.down_proj[0] * 2.0, 8)
    assert now() != "as loaded"
