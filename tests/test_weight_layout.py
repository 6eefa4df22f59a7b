"""Weights stored input-major on CPU (``models.weight_layout``): a group's stacked experts and the router's LM head
keep their shapes and values, only their storage changes, and only where it should.

Real transformers checkpoints (tiny, random weights, built with transformers' own config classes); the GPU case is
the device value alone (``prefers_input_major`` takes a device; no GPU here)."""

from __future__ import annotations

import pytest
import torch

from expertmesh.models.checkpoint import Checkpoint
from expertmesh.models.hosted_experts import HostedExperts
from expertmesh.models.weight_layout import input_major, prefers_input_major
from expertmesh.router.model import build_router_model

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"]


def test_input_major_keeps_shape_and_values_and_transposes_the_storage():
    weight = torch.randn(3, 5, 4)  # [E, out, in]
    laid = input_major(weight)
    assert laid.shape == weight.shape and torch.equal(laid, weight)
    assert laid.transpose(-1, -2).is_contiguous() and not laid.is_contiguous()
    assert laid.data_ptr() != weight.data_ptr()  # a copy: the checkpoint's tensor is not aliased
    assert prefers_input_major(torch.device("cpu")) and not prefers_input_major(torch.device("cuda", 0))


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_groups_experts_are_stored_input_major_where_the_module_multiplies_by_out_in(tiny_checkpoints, arch):
    """Every 3-D expert weight of a module that multiplies by [out, in] (``is_transposed`` false) is input-major on
    CPU, with the checkpoint's values; GPT-OSS's ([in, out] already) and biases stay as read."""
    checkpoint = Checkpoint(tiny_checkpoints(arch))
    layer = checkpoint.spec.moe_layers[0]
    hosted = HostedExperts(checkpoint)
    hosted.load([(layer, e) for e in range(checkpoint.spec.num_experts)])
    module = hosted._layers[layer].module
    read = checkpoint.expert_weights(layer, list(range(checkpoint.spec.num_experts)), torch.float32)
    for name in checkpoint.spec.expert_params:
        param = getattr(module, name)
        assert torch.equal(param, torch.stack(list(read[name]))), name
        if param.dim() == 3 and module.is_transposed is False:
            assert param.transpose(-1, -2).is_contiguous() and not param.is_contiguous(), name
        else:
            assert param.is_contiguous(), name


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_routers_lm_head_is_input_major_unless_tied_to_the_embeddings(tmp_path, tied):
    """Where torch's own kernel multiplies by it (``blas``; the packed kernel reorders the weight anyway)."""
    from expertmesh.models.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint("mixtral", tmp_path / ("tied" if tied else "untied"), tie_word_embeddings=tied)
    checkpoint = Checkpoint(path)
    model = build_router_model(checkpoint, torch.float32, linear_kernel="blas")
    head, embeddings = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    if tied:
        assert head.data_ptr() == embeddings.data_ptr() and head.is_contiguous()
    else:
        assert head.transpose(0, 1).is_contiguous() and not head.is_contiguous()
    if not tied:
        stock = checkpoint.non_expert_state({"lm_head.weight": torch.float32})["lm_head.weight"]
        assert torch.equal(head, stock)
