"""Biasing the stock gate before its top-k (router/policy/gate_hook.py), on every verified architecture:
stock transformers models from the families' own config classes, eager experts."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from expertmesh.models.checkpoint import experts_modules
from expertmesh.models.tiny import CONFIG_BUILDERS, MOE_ARCHITECTURES
from expertmesh.router.policy.gate_hook import GateBias, masked


def _model(arch):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIG_BUILDERS[arch](), experts_implementation="eager").eval()


def _routing(model, ids):
    """layer -> (top_k_index [T, K], top_k_weights [T, K]) the experts modules received, and the logits."""
    seen, handles = {}, []
    for layer, (_, experts) in experts_modules(model).items():
        handles.append(
            experts.register_forward_pre_hook(lambda _m, args, layer=layer: seen.__setitem__(layer, (args[1], args[2])))
        )
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    for h in handles:
        h.remove()
    return seen, logits


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_no_bias_is_the_stock_forward_and_a_masked_expert_is_never_chosen(arch):
    model = _model(arch)
    ids = torch.randint(3, 100, (1, 24), generator=torch.Generator().manual_seed(1))
    before, stock_logits = _routing(model, ids)
    bias = GateBias(model)
    after, logits = _routing(model, ids)
    assert torch.equal(logits, stock_logits)

    layer = sorted(bias.gates)[-1]
    index, weights = before[layer]
    expert = int(index.flatten().mode().values)  # the most chosen expert of that layer
    num_experts = experts_modules(model)[layer][1].num_experts
    bias.set({layer: masked(num_experts, frozenset({expert}))})
    steered, _ = _routing(model, ids)
    new_index, new_weights = steered[layer]
    assert not bool(((new_index == expert) & (new_weights != 0)).any()), "the masked expert still got weight"
    assert (new_index != index).any(), "nothing changed: the bias did not reach the gate"
    if arch != "deepseek_v3":  # group-limited selection may regroup other tokens too
        untouched = ~(index == expert).any(dim=1)  # tokens that never chose it keep their experts
        assert torch.equal(new_index[untouched].sort(dim=1).values, index[untouched].sort(dim=1).values)
    for other in set(bias.gates) - {layer}:  # other layers' gates see no bias (their inputs may differ)
        assert other in steered
    bias.set({})
    _, again = _routing(model, ids)
    assert torch.equal(again, stock_logits)


def test_a_per_token_bias_steers_each_token():
    model = _model("mixtral")
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(2))
    bias = GateBias(model)
    layer = sorted(bias.gates)[0]
    forced = torch.full((6, 4), float("-inf"))
    forced[torch.arange(6), torch.tensor([0, 1, 2, 3, 0, 1])] = 0.0
    forced[torch.arange(6), torch.tensor([1, 2, 3, 0, 1, 2])] = 0.0
    bias.set({layer: forced})
    steered, _ = _routing(model, ids)
    chosen = steered[layer][0].sort(dim=1).values
    assert chosen.tolist() == [[0, 1], [1, 2], [2, 3], [0, 3], [0, 1], [1, 2]]
