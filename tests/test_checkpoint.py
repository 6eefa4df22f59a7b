"""Checkpoint split: the router's part never holds routed experts, a group reads
exactly the expert slices it hosts, in per-expert, fused and sharded layouts."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from expertmesh.contracts.errors import CheckpointError
from expertmesh.models.checkpoint import Checkpoint, experts_modules, interface_forward
from expertmesh.models.tiny import MOE_ARCHITECTURES
from expertmesh.router.model import build_router_model


def _stock_experts(path, layer):
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")
    return experts_modules(model)[layer][1]


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_expert_slices_match_stock_loading(tiny_checkpoints, arch):
    path = tiny_checkpoints(arch)
    ckpt = Checkpoint(path)
    layer = ckpt.spec.moe_layers[-1]
    picked = [ckpt.spec.num_experts - 1, 1]
    stock = _stock_experts(path, layer)
    weights = ckpt.expert_weights(layer, picked, torch.float32)
    assert set(weights) == set(ckpt.spec.expert_params)
    for name, tensor in weights.items():
        assert torch.equal(tensor, getattr(stock, name)[picked]), name


def test_sharded_checkpoint_with_index(tiny_checkpoints):
    path = tiny_checkpoints("qwen2_moe", max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 2
    ckpt = Checkpoint(path)
    stock = _stock_experts(path, 1)
    assert torch.equal(ckpt.expert_weights(1, [2, 0], torch.float32)["gate_up_proj"], stock.gate_up_proj[[2, 0]])


def test_spec_of_deepseek_skips_dense_layers(tiny_checkpoints):
    spec = Checkpoint(tiny_checkpoints("deepseek_v3")).spec
    assert spec.moe_layers == (1,)
    assert (spec.num_experts, spec.top_k, spec.hidden_size) == (8, 2, 32)


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_router_model_holds_no_routed_expert_weights(tiny_checkpoints, arch):
    ckpt = Checkpoint(tiny_checkpoints(arch))
    model = build_router_model(ckpt, torch.float32)
    names = [n for n, _ in model.named_parameters()]
    assert not [n for n in names if ".experts." in n]
    for _, module in experts_modules(model).values():
        for p in ckpt.spec.expert_params:
            assert getattr(module, p) is None
    stock = AutoModelForCausalLM.from_pretrained(ckpt.path)
    expert_numel = sum(p.numel() for n, p in stock.named_parameters() if ".experts." in n)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in stock.parameters()) - expert_numel


def test_bfloat16_router_keeps_fp32_gates_like_from_pretrained(tiny_checkpoints):
    ckpt = Checkpoint(tiny_checkpoints("deepseek_v3"))
    model = build_router_model(ckpt, torch.bfloat16)
    stock = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.bfloat16)
    stock_dtypes = {n: p.dtype for n, p in stock.named_parameters() if ".experts." not in n}
    assert {n: p.dtype for n, p in model.named_parameters()} == stock_dtypes
    assert stock_dtypes["model.layers.1.mlp.gate.weight"] == torch.float32


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="has no config.json"):
        Checkpoint(tmp_path)


def test_dense_checkpoint_is_refused(tiny_checkpoints):
    with pytest.raises(CheckpointError, match=r"\(llama\) has no MoE layers"):
        Checkpoint(tiny_checkpoints("llama"))


def test_truncated_safetensors_is_refused(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints("mixtral")
    dst = tmp_path / "truncated"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    weights = dst / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 64)
    with pytest.raises(CheckpointError, match="model.safetensors is truncated or not a safetensors file"):
        Checkpoint(dst)


def test_checkpoint_without_weights_or_with_missing_shard(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints("olmoe", max_shard_size="20KB")
    (tmp_path / "config.json").write_bytes((src / "config.json").read_bytes())
    with pytest.raises(CheckpointError, match="has no .safetensors weights"):
        Checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_bytes((src / "model.safetensors.index.json").read_bytes())
    with pytest.raises(CheckpointError, match="names shards that are missing"):
        Checkpoint(tmp_path)


def test_out_of_range_expert_request(tiny_checkpoints):
    ckpt = Checkpoint(tiny_checkpoints("mixtral"))
    with pytest.raises(CheckpointError, match=r"experts \[9\] do not exist"):
        ckpt.expert_weights(0, [9], torch.float32)
    with pytest.raises(CheckpointError, match="layer 7 is not an MoE layer"):
        ckpt.expert_weights(7, [0], torch.float32)


@pytest.mark.parametrize("family, decorated", [("ergo", "ErgoExpertProjections"), ("mixtral", "MixtralExperts")])
def test_a_group_computes_the_experts_interface_not_a_subclass_wrapped_around_it(family, decorated):
    """Ergo's experts class subclasses the class transformers' experts interface decorates and norms each expert's
    output around the interface's call: stock code the router runs around the dispatch. A group runs the
    decorated class's forward (Mixtral's experts class is that class itself). Meta skeletons: no weights."""
    from expertmesh.models.tiny import family_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(family_config(family))
    (_, module), *_ = experts_modules(model).values()
    forward = interface_forward(module)
    assert forward.__self__ is module and forward.__qualname__ == f"{decorated}.forward"
    with pytest.raises(CheckpointError, match="not an experts class"):
        interface_forward(torch.nn.Linear(2, 2))
