"""Per-request routing policies (router/policy/routing_policy.py, gate_hook.py): pure functions on hand-made
scores, then every policy on every verified architecture through the stock gates of stock transformers
models (the families' own config classes). The experts run locally with transformers' own loop; a
policy's empty slots (the skip sentinel) are given weight 0 there, as the router's dispatch plan skips
them."""

import math
from contextlib import contextmanager

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations.moe import ExpertsInterface

from expertmesh.models.checkpoint import experts_modules
from expertmesh.models.tiny import CONFIG_BUILDERS, MOE_ARCHITECTURES
from expertmesh.router.policy.gate_hook import GateBias
from expertmesh.router.policy.routing_policy import (
    KRules,
    PolicyError,
    RequestRouting,
    apply_k_rules,
    parse_policy,
    policy_names,
    prefer_bias,
    restrict_bias,
    step_routing,
    top2_gap,
    widen_rows,
)
from expertmesh.serving.engine import Engine, EngineLimits, FinishEvent, GenerationRequest, TokenEvent
from helpers import stock_greedy

LOCAL = "expertmesh_test_policy_local"


def _local_experts(module, hidden, index, weights):  # hidden [T, H], index / weights [T, K]
    skip = index >= module.num_experts
    return type(module).forward.__wrapped__(module, hidden, index.masked_fill(skip, 0), weights.masked_fill(skip, 0))


ExpertsInterface.register(LOCAL, _local_experts)


# -- pure ------------------------------------------------------------------------------------


def test_parse_fills_defaults_and_names_the_bad_field():
    policy = parse_policy("prefer+dynamic_k", {"alpha": 2.0}, top_k=2, num_experts=8)
    assert policy.name == "prefer+dynamic_k" and policy.alpha == 2.0 and policy.threshold == 0.15
    assert policy.needs_domain and policy.key == "prefer+dynamic_k(alpha=2,threshold=0.15)"
    assert parse_policy("", {}, 2, 8).is_exact and parse_policy("exact", {}, 2, 8).key == "exact"
    assert parse_policy("delta_gap", {}, 2, 8).delta == 0.18 and parse_policy("restrict", {}, 2, 8).top_n == 4
    cases = [
        ("bogus", {}, "routing_policy.name"),
        ("prefer+restrict", {}, "routing_policy.name"),
        ("dynamic_k+dynamic_k", {}, "routing_policy.name"),
        ("prefer", {"alpha": 5.0}, "routing_policy.alpha"),
        ("prefer", {"alpha": math.nan}, "routing_policy.alpha"),
        ("delta_gap", {"delta": -0.1}, "routing_policy.delta"),
        ("dynamic_k", {"threshold": 1.5}, "routing_policy.threshold"),
        ("restrict", {"top_n": 1}, "routing_policy.top_n"),  # below k
        ("restrict", {"top_n": 9}, "routing_policy.top_n"),  # above E
        ("delta_gap", {"alpha": 1.0}, "routing_policy.alpha"),  # not a parameter of its rules
    ]
    for name, given, field in cases:
        with pytest.raises(PolicyError) as err:
            parse_policy(name, given, top_k=2, num_experts=8)
        assert err.value.field == field, (name, given, str(err.value))
    for name in policy_names():
        assert parse_policy(name, {}, 2, 8).name == name


def test_bias_rules_are_bounded_and_keep_the_top_n():
    lift = torch.tensor([4.0, 2.0, 1.0, 0.5, 0.0])
    bias = prefer_bias(lift, alpha=1.5)
    assert bias[2] == 0 and (bias.abs() <= 1.5).all() and bias[0] > bias[1] > 0 > bias[3] > bias[4]
    assert torch.equal(
        restrict_bias(torch.tensor([0.1, 0.4, 0.2, 0.4]), 2), torch.tensor([float("-inf"), 0, float("-inf"), 0])
    )


def test_k_rules_narrow_widen_and_leave_other_tokens_bit_identical():
    E = 4
    scores = torch.tensor([[0.70, 0.10, 0.10, 0.10], [0.40, 0.35, 0.15, 0.10], [0.50, 0.30, 0.10, 0.10]])  # [3, E]
    index = torch.tensor([[0, 1], [0, 1], [0, 1]])
    weights = torch.tensor([[0.875, 0.125], [0.53, 0.47], [0.625, 0.375]])
    gap = top2_gap(scores)  # 0.6, 0.05, 0.2
    rules = KRules(
        delta=torch.tensor([0.18, 0.18, math.inf]),
        weight_boost=torch.full((3,), 1.2),
        threshold=torch.tensor([0.15, 0.15, 0.0]),
    )
    widen = widen_rows(gap, rules)
    assert widen.tolist() == [False, True, False]
    wide = (torch.tensor([1]), torch.tensor([[0, 1, 2]]), torch.tensor([[0.44, 0.39, 0.17]]))
    new_index, new_weights = apply_k_rules(index.clone(), weights.clone(), gap, rules, E, wide)
    assert new_index.tolist() == [[0, E, E], [0, 1, 2], [0, 1, E]]
    assert torch.allclose(new_weights[0], torch.tensor([0.875 * 1.2, 0, 0]))
    assert torch.equal(new_weights[1], wide[2][0])
    assert torch.equal(new_weights[2, :2], weights[2]) and new_weights[2, 2] == 0  # no rule: untouched
    # No token widens: the shape stays [T, K].
    none = KRules(rules.delta, rules.weight_boost, torch.zeros(3))
    narrow_index, _ = apply_k_rules(index.clone(), weights.clone(), gap, none, E)
    assert narrow_index.tolist() == [[0, E], [0, 1], [0, 1]]


def test_a_step_of_plain_requests_has_no_routing_and_others_get_per_token_rows():
    assert step_routing([(None, 3), (RequestRouting(), 2)]) is None
    prefer = RequestRouting(parse_policy("prefer+delta_gap", {}, 2, 4), "code", {0: torch.tensor([1.0, 0, 0, -1])})
    tagged = RequestRouting(domain="legal")
    step = step_routing([(None, 2), (prefer, 3), (tagged, 1)])
    assert step.biases[0].shape == (6, 4) and step.biases[0][:2].abs().sum() == 0 and step.biases[0][5].abs().sum() == 0
    assert torch.equal(step.biases[0][2], prefer.biases[0])
    assert step.k_rules.delta.tolist()[:3] == [math.inf, math.inf, pytest.approx(0.18)]
    assert step.k_rules.threshold.abs().sum() == 0 and not step.k_rules.any_widen
    assert step.domains == ("code", "legal") and step.domain_ids.tolist() == [-1, -1, 0, 0, 0, 1]


# -- every policy on every architecture ----------------------------------------------------------


def _model(arch):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIG_BUILDERS[arch](), experts_implementation=LOCAL).eval()


def _route(model, ids, gate_bias, step):
    """layer -> (index [T, K], weights [T, K]) the experts received, and the logits, under ``step``."""
    seen, handles = {}, []
    for layer, (_, experts) in experts_modules(model).items():
        handles.append(
            experts.register_forward_pre_hook(lambda _m, a, layer=layer: seen.__setitem__(layer, (a[1], a[2])))
        )
    try:
        with torch.no_grad(), gate_bias.routing(step):
            logits = model(input_ids=ids).logits
    finally:
        for h in handles:
            h.remove()
    return seen, logits


def _architecture_sum(gate):
    """What a token's routing weights sum to when the architecture normalises them (None: it does not)."""
    if not getattr(gate, "norm_topk_prob", True):
        return None
    return getattr(gate, "routed_scaling_factor", 1.0)


#: policy, parameters that make it act on these tiny random gates
POLICIES = [
    ("delta_gap", {"delta": 0.0}),
    ("dynamic_k", {"threshold": 1.0}),
    ("delta_gap+dynamic_k", {"delta": 0.0, "threshold": 0.02}),
    ("prefer", {"alpha": 4.0}),
    ("restrict", {}),
    ("prefer+dynamic_k", {"threshold": 1.0}),
    ("restrict+delta_gap", {"delta": 0.0}),
]


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_every_policy_on_every_architecture(arch):
    model = _model(arch)
    gate_bias = GateBias(model)
    ids = torch.randint(3, 100, (1, 24), generator=torch.Generator().manual_seed(1))
    stock, stock_logits = _route(model, ids, gate_bias, None)
    assert torch.equal(_route(model, ids, gate_bias, None)[1], stock_logits)
    E = next(iter(gate_bias.num_experts.values()))
    K = next(iter(stock.values()))[0].shape[1]
    favoured = torch.tensor([8.0, 4.0] + [0.25] * (E - 2))  # lift: experts 0 and 1 strong, the rest weak
    share = torch.tensor([0.4, 0.3] + [0.3 / (E - 2)] * (E - 2))
    mine = slice(10, 24)  # tokens 0..9 are an exact request's, 10..23 the policy's
    for name, given in POLICIES:
        policy = parse_policy(name, given, K, E)
        biases = {}
        if "prefer" in policy.rules:
            biases = {layer: prefer_bias(favoured, policy.alpha) for layer in gate_bias.gates}
        if "restrict" in policy.rules:
            biases = {layer: restrict_bias(share, K) for layer in gate_bias.gates}
        step = step_routing([(None, 10), (RequestRouting(policy, "code", biases), 14)])
        routed, _ = _route(model, ids, gate_bias, step)
        for layer, (index, weights) in routed.items():
            stock_index, stock_weights = stock[layer]
            gate = gate_bias.gates[layer]
            where = f"{arch} {name} layer {layer}"
            widened = "dynamic_k" in policy.rules
            assert index.shape == (24, K + 1 if widened else K), where
            if layer == min(routed):
                # the exact request's tokens keep the stock gate's choice and weights, bit for bit (at later
                # layers their inputs may move by a rounding step: the experts loop ran on other row sets)
                assert torch.equal(index[:10, :K], stock_index[:10]), where
                assert torch.equal(weights[:10, :K], stock_weights[:10]), where
                assert (index[:10, K:] == E).all(), where
            valid = index[mine] < E  # [14, K']
            skipped = weights[mine][~valid]
            assert (skipped == 0).all(), where
            counts = valid.sum(dim=1)
            total = _architecture_sum(gate)
            if name == "delta_gap" or name == "restrict+delta_gap":
                assert (counts == 1).all(), where
                top = weights[mine][valid]
                if name == "delta_gap" and layer == min(routed):  # later layers' inputs differ from stock's
                    assert torch.allclose(top, stock_weights[mine].max(dim=1).values * 1.2), where
            elif widened and policy.threshold >= 1.0:
                assert (counts == K + 1).all(), where
                if total is not None:
                    assert torch.allclose(weights[mine].sum(dim=1), torch.full((14,), total), atol=1e-5), where
            elif total is not None and name != "delta_gap+dynamic_k":
                assert torch.allclose(weights[mine].sum(dim=1), torch.full((14,), total), atol=1e-5), where
            if name == "delta_gap+dynamic_k":
                assert set(counts.tolist()) <= {1, K + 1} and (counts == 1).any(), where
            if "restrict" in policy.rules:
                allowed = set(torch.argsort(share, descending=True, stable=True)[:K].tolist())
                chosen = {int(e) for e, w in zip(index[mine].flatten(), weights[mine].flatten()) if w != 0}
                assert chosen <= allowed, where
            if "prefer" in policy.rules:

                def strong(idx, w):
                    return int(((idx < 2) & (w != 0)).sum())

                if layer == min(routed):
                    assert strong(index[mine], weights[mine]) > strong(stock_index[mine], stock_weights[mine]), where
            assert not torch.equal(index[mine, :K], stock_index[mine]) or widened, f"{where}: routing did not change"


# -- in the engine's packed step ------------------------------------------------------------------


class _LocalDispatcher:
    """What the engine needs of the dispatcher with local experts: refresh, and a step context that
    hands the step's routing to the gates (as LayerDispatcher.serving_step does)."""

    step_deadline = None

    def __init__(self, gate_bias):
        self.gate_bias = gate_bias

    def begin_step(self):
        pass

    @contextmanager
    def serving_step(self, positions, links=(), routing=None):
        with self.gate_bias.routing(routing):
            yield


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_exact_requests_stay_token_identical_beside_policy_requests(arch):
    model = _model(arch)
    gate_bias = GateBias(model)
    K, E = model.config.num_experts_per_tok, next(iter(gate_bias.num_experts.values()))
    engine = Engine(model, None, _LocalDispatcher(gate_bias), EngineLimits(8, 8), max_context=64)
    exact = GenerationRequest("exact", (5, 6, 7, 8), max_new_tokens=8, stop_at_eos=False)
    widened = GenerationRequest(
        "dyn",
        (9, 10, 11),
        max_new_tokens=8,
        stop_at_eos=False,
        routing=RequestRouting(parse_policy("dynamic_k", {"threshold": 1.0}, K, E)),
    )
    narrowed = GenerationRequest(
        "gap",
        (12, 13),
        max_new_tokens=8,
        stop_at_eos=False,
        routing=RequestRouting(parse_policy("delta_gap", {"delta": 0.0}, K, E)),
    )
    seqs = [engine.submit(r) for r in (exact, widened, narrowed)]
    engine.start()
    try:
        events = [list(s) for s in seqs]
    finally:
        engine.stop()
    for e in events:
        assert isinstance(e[-1], FinishEvent), e[-1]
    tokens = [[t for e in ev if isinstance(e, TokenEvent) for t in e.token_ids] for ev in events]
    assert tokens[0] == stock_greedy(model, exact.prompt_ids, 8)
    assert all(len(t) == 8 for t in tokens[1:])
