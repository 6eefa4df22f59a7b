"""The grouped experts kernel (``models.grouped_experts`` and its C++ source): every row of a call through its own
expert in one call per stacked weight, what the per-expert products give to float32 rounding, whatever the rows
per expert (none, one, more than a register block, every remainder of one), the output width (a partial last
tile) or the stack's orientation; bad shapes refused with a message; the packed copy follows in-place writes; a
group uses it where it builds and keeps the per-expert products where it does not.

The real kernel, compiled on this machine by torch's extension loader (as ``expertmesh up`` builds it), and real
transformers checkpoints (tiny, random weights); nothing is faked but a failed build (a missing compiler)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from expertmesh.contracts.errors import NotHosted
from expertmesh.infra import row_sums
from expertmesh.models import grouped_experts
from expertmesh.models.checkpoint import Checkpoint
from expertmesh.models.expert_rows import rows_forward
from expertmesh.models.grouped_experts import GroupedRows, grouped_rows_forward, usable
from expertmesh.models.hosted_experts import HostedExperts
from expertmesh.models.linear_kernels import PackedRows

pytestmark = pytest.mark.skipif(not grouped_experts.load(), reason="no C++ compiler here: the kernel cannot build")


def _grouped_linear(x: torch.Tensor, starts: list[int], rows: GroupedRows) -> torch.Tensor:
    return torch.ops.expertmesh_experts.grouped_linear(x, starts, rows.packed(), rows.outputs)


@pytest.mark.parametrize("transposed", [False, True], ids=["out-in", "in-out"])
@pytest.mark.parametrize("outputs", [64, 48, 7], ids=["whole-tiles", "partial-tile", "one-partial-tile"])
def test_each_experts_rows_get_that_experts_product(transposed, outputs):
    g = torch.Generator().manual_seed(outputs)
    experts, inputs = 8, 40
    stacked = torch.randn(experts, outputs, inputs, generator=g)  # [E, N, K]
    stored = stacked.transpose(1, 2).contiguous() if transposed else stacked  # [E, K, N] as a module stores it
    rows = GroupedRows(stored, transposed)
    # an expert with no rows, one with one, one past two register blocks; with the rest every remainder of the
    # kernel's block on any host (3 rows with AVX2, 8 with AVX-512)
    counts = [3, 0, 1, 17, 2, 5, 6, 7]
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    x = torch.randn(starts[-1], inputs, generator=g)  # [S, K], grouped by expert
    expected = torch.cat([x[starts[e] : starts[e + 1]] @ stacked[e].t() for e in range(experts)])  # [S, N]
    got = _grouped_linear(x, starts, rows)
    assert got.shape == (starts[-1], outputs)
    torch.testing.assert_close(got, expected)
    assert _grouped_linear(x[:0], [0] * (experts + 1), rows).shape == (0, outputs)


def test_rows_past_a_register_block_give_each_rows_own_bits():
    """Many rows of an expert go through a tile in chunks of its K rows, every block of rows through each chunk
    before the next (the kernel's ``KC``), where one block takes the whole tile at once: each row's output is, bit
    for bit, what the row gives alone. K of 150 and 160 (two whole chunks of 64 and a partial one), experts of 1, 8
    (one block on AVX-512), 9, 17 and 40 rows; the plain products, scaled products and a whole gated call."""
    g = torch.Generator().manual_seed(7)
    counts, inputs, intermediate = [1, 8, 9, 17, 40], 150, 160
    experts, tokens = len(counts), sum(counts)
    owner = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts))  # [S] each row's expert, grouped
    starts = [0, *torch.tensor(counts).cumsum(0).tolist()]

    def alone(e: int) -> list[int]:  # the starts of a call of one row of expert e
        return [0] * (e + 1) + [1] * (experts - e)

    plain = GroupedRows(torch.randn(experts, 70, inputs, generator=g), transposed=False)  # a partial last tile
    x = torch.randn(tokens, inputs, generator=g)
    together = _grouped_linear(x, starts, plain)
    each = torch.cat([_grouped_linear(x[i : i + 1], alone(int(owner[i])), plain) for i in range(tokens)])
    assert torch.equal(together, each)

    gate_up = GroupedRows(torch.randn(experts, 2 * intermediate, inputs, generator=g) * 0.1, transposed=False)
    down = GroupedRows(torch.randn(experts, inputs, intermediate, generator=g) * 0.1, transposed=False)
    ids, weights = owner.unsqueeze(1), torch.rand(tokens, 1, generator=g)  # [T, 1] top-1: a token a row
    shuffled = torch.randperm(tokens, generator=g)  # tokens out of expert order
    ids, weights, hidden = ids[shuffled], weights[shuffled], torch.randn(tokens, inputs, generator=g)

    def call(rows: slice):
        return torch.ops.expertmesh_experts.grouped_silu_glu_call(
            hidden[rows], ids[rows], weights[rows], torch.arange(experts), gate_up.packed(), 2 * intermediate,
            down.packed(), inputs, True,
        )[0]  # fmt: skip

    assert torch.equal(call(slice(None)), torch.cat([call(slice(i, i + 1)) for i in range(tokens)]))


def test_bad_shapes_are_refused_with_a_message():
    rows = GroupedRows(torch.randn(2, 32, 16), transposed=False)
    x = torch.randn(4, 16)
    with pytest.raises(RuntimeError, match="starts"):
        _grouped_linear(x, [0, 3], rows)  # one start short
    with pytest.raises(RuntimeError, match="starts"):
        _grouped_linear(x, [0, 3, 2], rows)  # not ending at the rows
    with pytest.raises(RuntimeError, match="starts ascending"):
        _grouped_linear(x, [0, 5, 4], rows)
    with pytest.raises(RuntimeError, match="as wide"):
        _grouped_linear(torch.randn(4, 8), [0, 2, 4], rows)
    with pytest.raises(RuntimeError, match="float32"):
        _grouped_linear(x.double(), [0, 2, 4], rows)


def test_the_packed_copy_follows_in_place_writes_and_reads_back():
    g = torch.Generator().manual_seed(0)
    stacked = torch.randn(3, 40, 16, generator=g)  # [E, N, K]
    rows = GroupedRows(stacked, transposed=False)
    assert rows.computed(1) is None  # nothing packed before the first product
    x = torch.randn(2, 16, generator=g)
    before = _grouped_linear(x, [0, 0, 2, 2], rows)
    assert torch.equal(rows.computed(1), stacked[1])
    stacked[1].mul_(2.0)  # a write torch sees (a fault injected, a hot update)
    torch.testing.assert_close(_grouped_linear(x, [0, 0, 2, 2], rows), 2.0 * before)
    transposed = GroupedRows(stacked.transpose(1, 2), transposed=True)
    transposed.packed()
    assert torch.equal(transposed.computed(2), stacked.transpose(1, 2)[2])


def test_a_modules_rows_match_its_per_expert_products(tiny_checkpoints):
    """The module path: rows in any order over any experts give each row its own expert's weighted output, as
    ``expert_rows.rows_forward`` does one product per expert."""
    checkpoint = Checkpoint(tiny_checkpoints("mixtral"))
    spec = checkpoint.spec
    layer = spec.moe_layers[0]
    hosted = HostedExperts(checkpoint, linear_kernel="blas")  # the module, its products torch's own
    hosted.load([(layer, e) for e in range(spec.num_experts)])
    module = hosted._layers[layer].module
    packs = {name: GroupedRows(getattr(module, name), module.is_transposed) for name in ("gate_up_proj", "down_proj")}
    g = torch.Generator().manual_seed(1)
    for size in (1, 2, 13, 70):
        local = torch.randint(0, spec.num_experts, (size,), generator=g).tolist()
        hidden = torch.randn(size, spec.hidden_size, generator=g)
        weights = torch.rand(size, 1, generator=g)
        with torch.no_grad():
            expected = rows_forward(module, hidden, local, weights)
            got = grouped_rows_forward(module, hidden, local, weights, packs)
        torch.testing.assert_close(got, expected)


def test_a_group_uses_it_where_it_can_and_keeps_per_expert_products_elsewhere(tiny_checkpoints, monkeypatch):
    checkpoint = Checkpoint(tiny_checkpoints("mixtral"))
    layer = checkpoint.spec.moe_layers[0]

    def kinds(hosted: HostedExperts) -> set[type]:
        hosted.load([(layer, 0), (layer, 1)])
        return {type(p) for p in hosted._layers[layer].packs.values()}

    hosted = HostedExperts(checkpoint)
    assert kinds(hosted) == {GroupedRows}
    assert kinds(HostedExperts(checkpoint, grouped=False)) == {PackedRows}
    module = hosted._layers[layer].module
    assert usable(module, torch.device("cpu"), torch.float32)
    assert not usable(module, torch.device("cpu"), torch.bfloat16)
    assert not usable(module, torch.device("meta"), torch.float32)  # a GPU's weights stood in for
    monkeypatch.setattr(grouped_experts, "load", lambda: False)  # the kernel did not build (no compiler)
    assert kinds(HostedExperts(checkpoint)) == {PackedRows}


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "gpt_oss"])
def test_a_silu_gated_mlp_is_one_call_with_the_same_bits_and_any_other_gate_stays_op_by_op(tiny_checkpoints, arch):
    """``grouped_silu_glu`` (the gated MLP in one call) gives the op-by-op path's bits, rows in and out of order;
    a group takes it where the module's gate is SiLU's GLU (Mixtral, Qwen2-MoE), and keeps the op-by-op path for
    another gate (GPT-OSS: clamped, with its own activation and biases, never on the grouped kernel at all)."""
    checkpoint = Checkpoint(tiny_checkpoints(arch))
    spec = checkpoint.spec
    layer = spec.moe_layers[0]
    hosted = HostedExperts(checkpoint)
    hosted.load([(layer, e) for e in range(spec.num_experts)])
    held = hosted._layers[layer]
    if arch == "gpt_oss":
        assert not held.silu_glu and not any(isinstance(p, GroupedRows) for p in (held.packs or {}).values())
        return
    assert held.silu_glu and grouped_experts.fuses(held.module, spec.hidden_size, held.packs)
    g = torch.Generator().manual_seed(2)
    for local in ([0], [1, 0], list(range(spec.num_experts)), torch.randint(0, spec.num_experts, (37,)).tolist()):
        hidden = torch.randn(len(local), spec.hidden_size, generator=g)
        weights = torch.rand(len(local), 1, generator=g)
        with torch.no_grad():
            steps = grouped_rows_forward(held.module, hidden, local, weights, held.packs)
            one = grouped_rows_forward(held.module, hidden, local, weights, held.packs, silu_glu=True)
        assert torch.equal(one, steps), local
    held.module.act_fn = torch.nn.GELU()  # another gate: the check sees it
    assert not grouped_experts.fuses(held.module, spec.hidden_size, held.packs)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_a_whole_call_in_one_op_gives_the_step_paths_sums_statistics_and_refusals(tiny_checkpoints, arch):
    """``grouped_call`` (the pairs, the plan, the kernel and the per-token sums in one op, what a group whose module
    fuses runs) gives the Python paths' partial sums and expert statistics to the bit, at decode and prefill sizes
    (plain-Python and tensor paths; sums below and past ``row_sums.SERIAL_LIMIT``), with empty slots, a token no
    held expert serves, one more slot than top-k and no pair at all; and refuses the same ids with the same message."""
    checkpoint = Checkpoint(tiny_checkpoints(arch))
    spec = checkpoint.spec
    layer = spec.moe_layers[0]
    held_ids = [e for e in range(spec.num_experts) if e % 3 != 1]  # a group of some experts, not all

    def group(fused: bool) -> HostedExperts:
        hosted = HostedExperts(checkpoint)
        hosted.load([(layer, e) for e in held_ids])
        if not fused:
            hosted._layers = {layer: dataclasses.replace(hosted._layers[layer], silu_glu=False)}
        return hosted

    one, steps = group(True), group(False)
    assert one._layers[layer].silu_glu
    g = torch.Generator().manual_seed(3)
    held = torch.tensor(held_ids, dtype=torch.int32)
    rows_past_serial = row_sums.SERIAL_LIMIT // spec.hidden_size + 7
    for tokens, slots in ((1, 2), (3, 2), (9, 3), (40, 2), (rows_past_serial, 2), (5, 1)):
        hidden = torch.randn(tokens, spec.hidden_size, generator=g)
        ids = torch.randint(0, spec.num_experts, (tokens, slots), generator=g, dtype=torch.int32)
        ids = torch.where(torch.isin(ids, held), ids, -1)  # another group's slots: empty here
        ids[0] = -1  # a token none of this group's experts serves
        weights = torch.rand(tokens, slots, generator=g)
        got, expected = one.compute(layer, hidden, ids, weights), steps.compute(layer, hidden, ids, weights)
        assert torch.equal(got, expected), (tokens, slots)
    nothing = torch.full((2, 2), -1, dtype=torch.int32)
    assert torch.equal(
        one.compute(layer, torch.randn(2, spec.hidden_size), nothing, torch.rand(2, 2)),
        torch.zeros(2, spec.hidden_size),
    )
    stats = lambda hosted: {e: vars(s) for e, s in hosted._layers[layer].stats.items()}  # noqa: E731
    assert stats(one) == stats(steps) and stats(one)[held_ids[0]]["rows"] > 0
    for bad in ([[1, held_ids[0]]], [[spec.num_experts + 2, held_ids[0]]]):
        ids = torch.tensor(bad, dtype=torch.int32)
        refusals = []
        for hosted in (one, steps):
            with pytest.raises(NotHosted) as refused:
                hosted.compute(layer, torch.randn(1, spec.hidden_size), ids, torch.rand(1, 2))
            refusals.append(str(refused.value))
        assert refusals[0] == refusals[1] and str(bad[0][0]) in refusals[0]


def test_the_kernels_silu_is_at_silus_bits_and_the_check_would_see_another():
    """``exact_silu``: the gated products' epilogue (Sleef's expf at ATen's vector width) gives ``at::silu``'s bits
    here, on the check's whole spread of values; and that spread tells a SiLU a rounding away (the same formula on
    a correctly rounded exp differs on hundreds of its values), so a torch whose SiLU changed would be seen."""
    assert grouped_experts.exact_silu()
    grid = torch.arange(-6400, 6400, dtype=torch.float32) / 64  # the check's spread
    rounded_exp = torch.exp((-grid).double()).float()
    other = grid / (1 + rounded_exp)
    assert (other.view(torch.int32) != torch.nn.functional.silu(grid).view(torch.int32)).sum() > 100


@pytest.mark.parametrize("intermediate", [96, 48], ids=["gate-at-a-tile-edge", "gate-inside-a-tile"])
def test_a_fused_call_gives_the_unfused_calls_bits(intermediate):
    """The whole call with the gate in the gate-and-up products' epilogue and the routing weights in the down
    products' (``fused``) gives the ATen ops' bits: every output of the call, experts with no row, one, and past two
    register blocks, rows in and out of expert order. A gate that does not end at a tile's edge (48 of 32-column
    tiles) takes the unfused path whatever is asked (the same bits, by construction)."""
    g = torch.Generator().manual_seed(intermediate)
    experts, hidden_size, tokens = 3, 40, 29
    gate_up = GroupedRows(torch.randn(experts, 2 * intermediate, hidden_size, generator=g) * 0.3, transposed=False)
    down = GroupedRows(torch.randn(experts, hidden_size, intermediate, generator=g) * 0.3, transposed=False)
    hidden = torch.randn(tokens, hidden_size, generator=g) * 2
    ids = torch.randint(1, experts, (tokens, 2), generator=g)  # local expert 0 gets no row
    ids[3, 0] = 0  # then one
    weights = torch.rand(tokens, 2, generator=g)
    local_of = torch.arange(experts)

    def call(fused: bool):
        return torch.ops.expertmesh_experts.grouped_silu_glu_call(
            hidden, ids, weights, local_of, gate_up.packed(), 2 * intermediate, down.packed(), hidden_size, fused
        )

    fused, unfused = call(True), call(False)
    assert all(torch.equal(a, b) for a, b in zip(fused, unfused, strict=True))
    assert fused[1].shape == (2 * tokens, hidden_size) and fused[0].abs().sum() > 0
    order = torch.randperm(2 * tokens, generator=g)
    rows = torch.randn(2 * tokens, hidden_size, generator=g)
    starts = [0, 11, 11 + 17, 2 * tokens]
    row_weights = torch.rand(2 * tokens, 1, generator=g)
    one = [
        torch.ops.expertmesh_experts.grouped_silu_glu(
            rows, order, starts, gate_up.packed(), 2 * intermediate, down.packed(), hidden_size, row_weights, fused
        )
        for fused in (True, False)
    ]
    assert torch.equal(one[0], one[1])
