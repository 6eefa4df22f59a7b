"""The router's RMS norms in one op (``models.rms_norm`` and its C++ source): the stock module's bits on any rows
(every width's cascade of the mean's sum: one level, several, a scalar tail), in every architecture's router where
its norm is written as transformers' RMS norms are; a norm written another way keeps its own forward; inputs the
kernel does not take go to the module's forward; the state dict's names stay.

The real kernel, compiled on this machine by torch's extension loader (as ``expertmesh up`` builds it), and real
transformers modules and tiny checkpoints (random weights); nothing is faked."""

from __future__ import annotations

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm

from expertmesh.models import rms_norm
from expertmesh.models.checkpoint import Checkpoint
from expertmesh.models.rms_norm import FusedRMSNorm, agreeing_lanes, fuse_rms_norms
from expertmesh.router.model import build_router_model

pytestmark = pytest.mark.skipif(not rms_norm.load(), reason="no C++ compiler here: the kernel cannot build")


def _norm(width: int, seed: int) -> MixtralRMSNorm:
    norm = MixtralRMSNorm(width, eps=1e-5)
    norm.weight.data = torch.rand(width, generator=torch.Generator().manual_seed(seed)) + 0.5
    return norm


@pytest.mark.parametrize("width", [7, 64, 100, 512, 4096, 16384])
def test_the_kernel_gives_the_modules_bits_at_any_width(width):
    """Widths below one sum vector, with a scalar tail, one cascade level and several (4096 and 16384 floats are 512
    and 2048 vectors of 8): rows of new values (not the check's), one row, many, a non-contiguous view, huge and tiny
    values."""
    norm = _norm(width, width)
    lanes = agreeing_lanes(norm)
    assert lanes in rms_norm.SUM_LANES
    fused = FusedRMSNorm(norm, lanes)
    g = torch.Generator().manual_seed(width + 1)
    cases = [
        torch.randn(1, 1, width, generator=g),
        torch.randn(1, 480, width, generator=g) * 5,
        torch.randn(9, width * 2, generator=g)[:, ::2],  # a strided view
        torch.randn(4, width, generator=g) * 1e18,
        torch.randn(4, width, generator=g) * 1e-18,
    ]
    with torch.no_grad():
        for x in cases:
            assert torch.equal(fused(x), norm(x)), x.shape


class _WeightOutside(MixtralRMSNorm):
    """An RMS norm that multiplies the weight in before the scale: the same formula, not the same bits."""

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return hidden_states * (self.weight * torch.rsqrt(variance + self.variance_epsilon))


class _Gated(MixtralRMSNorm):
    """A gated RMS norm (Kimi-Linear's, GraniteMoeHybrid's): the same formula without a gate, a second input."""

    def forward(self, hidden_states, gate=None):
        out = super().forward(hidden_states)
        return out if gate is None else out * torch.sigmoid(gate)


class _GateRequired(MixtralRMSNorm):
    """A gated norm that cannot run without its gate (Lara-Mini's, Kimi-Linear's)."""

    def forward(self, hidden_states, gate):
        return super().forward(hidden_states) * torch.sigmoid(gate)


def test_a_norm_computed_another_way_or_taking_a_gate_keeps_its_own_forward():
    model = torch.nn.Sequential(
        _norm(512, 0), _WeightOutside(512, eps=1e-5), _Gated(512, eps=1e-5), _GateRequired(512, eps=1e-5)
    )
    model[1].weight.data = torch.rand(512, generator=torch.Generator().manual_seed(1)) + 0.5
    assert agreeing_lanes(model[1]) is None and agreeing_lanes(model[2]) is None and agreeing_lanes(model[3]) is None
    assert fuse_rms_norms(model) == 1
    assert isinstance(model[0], FusedRMSNorm)
    assert [type(m) for m in model[1:]] == [_WeightOutside, _Gated, _GateRequired]
    assert fuse_rms_norms(model) == 0  # a fused norm is not fused again


def test_inputs_the_kernel_does_not_take_go_to_the_modules_forward_with_the_weight_as_loaded():
    """A bfloat16 input is the module's forward's; after a load that assigns a new weight parameter, both paths use
    the new one."""
    norm = _norm(64, 2)
    fused = FusedRMSNorm(norm, agreeing_lanes(norm))
    low = torch.randn(3, 64).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(fused(low), norm(low))
        fused.weight = torch.nn.Parameter(torch.full((64,), 2.0))  # load_state_dict(..., assign=True)
        reference = MixtralRMSNorm(64, eps=1e-5)
        reference.weight.data.fill_(2.0)
        x = torch.randn(5, 64)
        assert torch.equal(fused(x), reference(x))
        assert torch.equal(fused(low), reference(low))


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"])
def test_a_routers_norms_are_fused_to_the_bit_and_its_state_dict_keeps_its_names(tiny_checkpoints, arch):
    """Every architecture's router model: its norms replaced where they agree (its layers' and the last one at
    least), each giving the replaced module's bits on fresh rows, the state dict's names and tensors unchanged."""
    checkpoint = Checkpoint(tiny_checkpoints(arch))
    model = build_router_model(checkpoint, torch.float32)
    fused = {name: m for name, m in model.named_modules() if isinstance(m, FusedRMSNorm)}
    assert len(fused) >= 2 * checkpoint.spec.num_layers + 1, sorted(fused)
    stock_names = {name for name, _ in checkpoint.skeleton().state_dict().items()}
    assert set(model.state_dict()) <= stock_names
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, module in fused.items():
            (stock,) = module._stock
            x = torch.randn(6, module.weight.shape[0], generator=g) * 2
            assert torch.equal(module(x), stock(x)), name
