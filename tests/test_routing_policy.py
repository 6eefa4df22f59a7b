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
from expertmesh.router.policy.gate_hook import GateBias, widest_k
from expertmesh.router.policy.routing_policy import (
    PARAMETER_NAMES,
    KRules,
    PolicyError,
    RequestRouting,
    apply_k_rules,
    capacity_route,
    decayed_k,
    gate_scores,
    parse_policy,
    policy_names,
    prefer_bias,
    restrict_bias,
    seeded,
    step_routing,
    temper,
    token_k,
    top2_gap,
    widen_rows,
)
from expertmesh.router.policy.token_rules import (
    QueueSignal,
    RoutingState,
    StickySequence,
    adaptive_narrow,
    confidence_alpha,
    confidence_k,
    gate_confidence,
    gumbel_noise,
    request_seed,
    sticky_scan,
)
from expertmesh.serving.engine import Engine, EngineLimits
from expertmesh.serving.events import FinishEvent, TokenEvent
from expertmesh.serving.request import GenerationRequest
from expertmesh.v1 import inference_pb2 as pb
from helpers import stock_greedy

LOCAL = "expertmesh_test_policy_local"


def _local_experts(module, hidden, index, weights):  # hidden [T, H], index / weights [T, K]
    skip = index >= module.num_experts
    return type(module).forward.__wrapped__(module, hidden, index.masked_fill(skip, 0), weights.masked_fill(skip, 0))


ExpertsInterface.register(LOCAL, _local_experts)


# -- pure ------------------------------------------------------------------------------------


def _assert_refused(cases) -> None:
    """Each (policy name, parameters, field) is refused on a top-2 model of 8 experts, naming that field in a
    message a person can read (under 300 characters)."""
    for name, given, field in cases:
        with pytest.raises(PolicyError) as err:
            parse_policy(name, given, top_k=2, num_experts=8)
        assert err.value.field == field, (name, given, str(err.value))
        assert len(str(err.value)) < 300, str(err.value)


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
        ("decay_k+dynamic_k", {}, "routing_policy.name"),  # two rules that each decide k
        ("decay_k", {"k_start": 0}, "routing_policy.k_start"),
        ("decay_k", {"k_start": 9}, "routing_policy.k_start"),  # above E
        ("decay_k", {"k_start": 4}, "routing_policy.k_start"),  # above top-k + 1: no expert group takes it
        ("decay_k", {"k_start": 2.5}, "routing_policy.k_start"),
        ("decay_k", {"decay": 0.0}, "routing_policy.decay"),
        ("decay_k", {"decay": 1.01}, "routing_policy.decay"),
        ("decay_k", {"k_start": 2, "k_min": 3}, "routing_policy.k_min"),
        ("gate_temperature", {"tau": 0.01}, "routing_policy.tau"),
        ("gate_temperature", {"tau": math.inf}, "routing_policy.tau"),
        ("capacity", {"capacity_factor": 0.5}, "routing_policy.capacity_factor"),
        ("capacity", {"tau": 1.0}, "routing_policy.tau"),
    ]
    _assert_refused(cases)
    for name in policy_names():
        assert parse_policy(name, {}, 2, 8).name == name
    assert "restrict+decay_k+gate_temperature+capacity" in policy_names()
    assert "dynamic_k+decay_k" not in policy_names()
    decay = parse_policy("capacity+decay_k", {"k_start": 3, "decay": 0.5}, 2, 8)
    assert (
        decay.name == "decay_k+capacity"
        and decay.key == "decay_k+capacity(k_start=3,decay=0.5,k_min=1,capacity_factor=1.25)"
    )
    assert parse_policy("decay_k", {}, 2, 3).k_start == 3  # default 4, clamped to E
    assert parse_policy("decay_k", {}, 2, 8).k_start == 3  # and to top-k + 1, what an expert group takes
    assert parse_policy("gate_temperature", {}, 2, 8).tau == 0.85


def test_every_parameter_reaches_the_server_by_grpc_http_and_the_cli():
    from expertmesh.cli.policy import _PARAMETERS
    from expertmesh.serving.openai_schema import RoutingPolicyBody

    assert _PARAMETERS == PARAMETER_NAMES
    assert set(PARAMETER_NAMES) <= set(pb.RoutingPolicy.DESCRIPTOR.fields_by_name)
    assert set(PARAMETER_NAMES) <= set(RoutingPolicyBody.model_fields)


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
    new_index, new_weights = apply_k_rules(index.clone(), weights.clone(), gap, rules, E, [wide])
    assert new_index.tolist() == [[0, E, E], [0, 1, 2], [0, 1, E]]
    assert torch.allclose(new_weights[0], torch.tensor([0.875 * 1.2, 0, 0]))
    assert torch.equal(new_weights[1], wide[2][0])
    assert torch.equal(new_weights[2, :2], weights[2]) and new_weights[2, 2] == 0  # no rule: untouched
    # No token widens: the shape stays [T, K].
    none = KRules(rules.delta, rules.weight_boost, torch.zeros(3))
    narrow_index, _ = apply_k_rules(index.clone(), weights.clone(), gap, none, E)
    assert narrow_index.tolist() == [[0, E], [0, 1], [0, 1]]


def test_decay_k_counts_down_to_k_min_and_clamps_to_what_the_gate_can_choose():
    t = torch.arange(20)
    k = decayed_k(t, torch.full((20,), 4.0), torch.full((20,), 0.92), torch.ones(20))
    expected = [max(1, math.floor(max(1.0, 4 * 0.92**i) + 0.5)) for i in range(20)]
    assert k.tolist() == expected and k[0] == 4 and k[9] == 2 and k[-1] == 1
    assert k.tolist()[:4] == [4, 4, 3, 3]
    # halves round up; k_min is a floor
    half = decayed_k(torch.tensor([0, 1, 2]), torch.full((3,), 4.0), torch.full((3,), 0.625), torch.full((3,), 2.0))
    assert half.tolist() == [4, 3, 2]  # 4, 2.5 -> 3, 1.5625 -> k_min 2
    still = decayed_k(torch.tensor([0, 50]), torch.full((2,), 3.0), torch.ones(2), torch.ones(2))
    assert still.tolist() == [3, 3]  # decay 1: k stays
    # token_k: decay_k's k where set, else top_k; widening adds one; everything within 1..widest
    gap = torch.tensor([0.5, 0.5, 0.01, 0.5])
    rules = KRules(
        delta=torch.full((4,), math.inf),
        weight_boost=torch.ones(4),
        threshold=torch.tensor([0.0, 0.0, 0.15, 0.0]),
        k=torch.tensor([6, 1, 0, 0]),
    )
    assert token_k(gap, rules, top_k=2, widest=4).tolist() == [4, 1, 3, 2]


def test_regated_tokens_take_their_own_width_and_pad_with_the_sentinel():
    E = 4
    index = torch.tensor([[0, 1], [2, 3], [1, 0]])
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    gap = torch.tensor([0.2, 0.4, 0.0])
    rules = KRules(torch.full((3,), 0.1), torch.full((3,), 1.5), torch.zeros(3))  # delta_gap for all
    regated = [
        (torch.tensor([1]), torch.tensor([[2]]), torch.tensor([[1.0]])),  # k' = 1
        (torch.tensor([0]), torch.tensor([[0, 1, 3]]), torch.tensor([[0.5, 0.3, 0.2]])),  # k' = 3
    ]
    new_index, new_weights = apply_k_rules(index.clone(), weights.clone(), gap, rules, E, regated)
    assert new_index.tolist() == [[0, 1, 3], [2, E, E], [1, 0, E]]  # regated rows are not narrowed
    assert new_weights[1].tolist() == [1.0, 0, 0] and torch.equal(new_weights[2, :2], weights[2])


def test_gate_temperature_divides_only_its_rows():
    logits = torch.tensor([[1.0, -2.0, 0.5], [0.3, 0.1, -0.7]])
    out = temper(logits, torch.tensor([1.0, 0.5]))
    assert torch.equal(out[0], logits[0]) and torch.allclose(out[1], logits[1] * 2)
    sharper = temper(logits, torch.tensor([0.25, 0.25])).softmax(-1).max(-1).values
    assert (sharper > logits.softmax(-1).max(-1).values).all()
    ninf = temper(torch.tensor([[float("-inf"), 1.0]]), torch.tensor([2.0]))
    assert ninf[0, 0] == float("-inf")  # a masked expert stays masked


def _capacity_case(choices, ranks, factor, normalised=True):
    """choices [T][K], ranks [T][E] (scores too) -> capacity_route's (index, weights) as lists."""
    scores = torch.tensor(ranks, dtype=torch.float32)
    index = torch.tensor(choices)
    weights = torch.gather(scores, 1, index.clamp(max=scores.shape[1] - 1)).masked_fill(index >= scores.shape[1], 0)
    weights = weights / weights.sum(dim=1, keepdim=True)
    out_index, out_weights = capacity_route(index, weights, scores, scores, torch.tensor(factor), normalised)
    return out_index.tolist(), out_weights, weights


def test_capacity_moves_overflow_to_the_next_best_expert_with_room():
    # E 4, three capped tokens choosing {0, 1}: 6 slots, cap ceil(1.0 * 6 / 4) = 2.
    ranks = [[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.1, 0.2], [0.4, 0.3, 0.2, 0.1]]
    index, weights, before = _capacity_case([[0, 1], [0, 1], [0, 1]], ranks, [1.0, 1.0, 1.0])
    assert index == [[0, 1], [0, 1], [2, 3]]  # the first two fill 0 and 1; the third gets its next-best two
    assert torch.allclose(weights[2], torch.tensor([2 / 3, 1 / 3]))  # renormalised: 0.2 / 0.3, 0.1 / 0.3
    assert torch.equal(weights[:2], before[:2])
    # The chain: token 1's move fills expert 2, so token 2's overflow goes on to expert 3.
    ranks = [[0.5, 0.2, 0.2, 0.1], [0.5, 0.1, 0.3, 0.1], [0.5, 0.05, 0.3, 0.15]]
    index, _, _ = _capacity_case([[0], [0], [0]], ranks, [1.0, 1.0, 1.0])  # cap ceil(3 / 4) = 1
    assert index == [[0], [2], [3]]
    # cap = ceil(factor * fair share): 1.25 * 8 / 4 = 2.5 -> 3 per expert
    index, _, _ = _capacity_case([[0, 1]] * 4, [[0.4, 0.3, 0.2, 0.1]] * 4, [1.25] * 4)
    assert index == [[0, 1], [0, 1], [0, 1], [2, 3]]
    # Ties go to the lower id; a token without the rule is neither capped nor counted.
    ranks = [[0.5, 0.25, 0.25, 0.0], [0.5, 0.25, 0.25, 0.0], [0.5, 0.25, 0.25, 0.0]]
    index, weights, before = _capacity_case([[0], [0], [0]], ranks, [0.0, 1.0, 1.0])
    assert index == [[0], [0], [1]]  # 2 slots: cap 1; token 2's 0 is full, 1 and 2 tie: 1
    assert torch.equal(weights[0], before[0])
    # Not normalised: the moved slot's weight is scaled by the score ratio, nothing else changes.
    index, weights, before = _capacity_case([[0], [0]], [[0.6, 0.3, 0.1, 0.0]] * 2, [1.0, 1.0], normalised=False)
    assert index == [[0], [1]] and torch.allclose(weights[1], before[1] * 0.5)


def test_capacity_never_moves_onto_an_expert_the_token_may_not_take():
    inf = float("-inf")
    scores = torch.tensor([[0.6, 0.4, 0.0, 0.0], [0.6, 0.4, 0.0, 0.0]])
    rank = torch.tensor([[0.6, 0.4, inf, inf], [0.6, 0.4, inf, inf]])  # experts 2, 3 restricted away
    index = torch.tensor([[0, 1], [0, 1]])  # 4 slots: cap 1; nowhere to go, so the slots stay
    weights = torch.tensor([[0.6, 0.4], [0.6, 0.4]])
    out_index, out_weights = capacity_route(index, weights, scores, rank, torch.ones(2), True)
    assert torch.equal(out_index, index) and torch.equal(out_weights, weights)
    # Skipped slots (the sentinel) are not slots: one valid slot each, cap ceil(2 / 4) = 1.
    index = torch.tensor([[0, 4], [0, 4]])
    weights = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    out_index, out_weights = capacity_route(index, weights, scores, scores, torch.ones(2), True)
    assert out_index.tolist() == [[0, 4], [1, 4]] and out_weights.tolist() == [[1.0, 0.0], [1.0, 0.0]]


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
    assert step.temperature is None and step.capacity is None and step.k_rules.k is None
    # decay_k reads each token's answer index: a prompt chunk of 3 (its last predicts t 0) and a decode token
    decay = RequestRouting(parse_policy("decay_k+gate_temperature", {"k_start": 3, "decay": 0.5}, 2, 8))
    capped = RequestRouting(parse_policy("capacity", {"capacity_factor": 2.0}, 2, 8))
    step = step_routing([(decay, 3), (None, 1), (decay, 1), (capped, 2)], first_t=[-2, 0, 2, 5])
    assert step.k_rules.k.tolist() == [3, 3, 3, 0, 1, 0, 0]  # t 0, 0, 0 -> 3; t 2 -> round(0.75) = 1
    assert step.temperature.tolist() == [pytest.approx(0.85)] * 3 + [1.0, pytest.approx(0.85), 1.0, 1.0]
    assert step.capacity.tolist() == [0.0] * 5 + [2.0, 2.0]
    assert step.k_rules.delta.isinf().all() and not step.k_rules.any_widen


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
    ("decay_k", {"k_start": 3}),  # t 0 for every token here: 3 experts each
    ("decay_k", {"k_start": 1}),
    ("gate_temperature", {"tau": 0.05}),
    ("capacity", {"capacity_factor": 1.5}),  # slack enough that an overflowing slot always finds room
    ("restrict+capacity", {}),
    ("prefer+decay_k+gate_temperature+capacity", {"k_start": 3, "tau": 2.0}),
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
            where = f"{arch} {name} {given} layer {layer}"
            widened = "dynamic_k" in policy.rules or ("decay_k" in policy.rules and policy.k_start > K)
            width = policy.k_start if "decay_k" in policy.rules else K + 1 if "dynamic_k" in policy.rules else K
            assert index.shape == (24, max(K, width)), where
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
            elif "dynamic_k" in policy.rules and policy.threshold >= 1.0 or "decay_k" in policy.rules:
                assert (counts == width).all(), where
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
            if name == "capacity":
                cap = math.ceil(policy.capacity_factor * int(valid.sum()) / E)
                load = torch.bincount(index[mine][valid], minlength=E)
                assert load.max() <= cap, (where, load.tolist(), cap)
                if layer == min(routed) and torch.bincount(stock_index[mine].flatten(), minlength=E).max() > cap:
                    assert not torch.equal(index[mine], stock_index[mine]), f"{where}: nothing moved"
            if "prefer" in policy.rules:

                def strong(idx, w):
                    return int(((idx < 2) & (w != 0)).sum())

                if layer == min(routed):
                    assert strong(index[mine], weights[mine]) > strong(stock_index[mine], stock_weights[mine]), where
            if name == "gate_temperature":
                if layer == min(routed):
                    assert not torch.allclose(weights[mine], stock_weights[mine]), f"{where}: weights did not change"
            elif name not in ("capacity", "restrict+capacity"):  # capacity moves only what overflows
                changed = not torch.equal(index[mine, :K], stock_index[mine])
                assert changed or widened, f"{where}: routing did not change"
    # decay_k reads each token's answer index: 13 prompt positions (t 0) and one answer token (t 1)
    policy = parse_policy("decay_k", {"k_start": 3, "decay": 0.5}, K, E)
    step = step_routing([(None, 10), (RequestRouting(policy), 14)], first_t=[0, -12])
    for layer, (index, _) in _route(model, ids, gate_bias, step)[0].items():
        assert (index[mine] < E).sum(dim=1).tolist() == [3] * 13 + [2], f"{arch} layer {layer}"


# -- in the engine's packed step ------------------------------------------------------------------


class _LocalDispatcher:
    """What the engine needs of the dispatcher with local experts: refresh, and a step context that
    hands the step's routing to the gates (as LayerDispatcher.step does)."""

    def __init__(self, gate_bias):
        self.gate_bias = gate_bias

    def begin_step(self):
        pass

    def routing_epoch(self):
        return 0

    @contextmanager
    def step(self, context):
        context.epoch = 0
        with self.gate_bias.routing(context.routing):
            yield context


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
    decaying = GenerationRequest(
        "decay",
        (14, 15, 16),
        max_new_tokens=8,
        stop_at_eos=False,
        routing=RequestRouting(parse_policy("decay_k+gate_temperature", {"k_start": K + 1, "decay": 0.7}, K, E)),
    )
    capped = GenerationRequest(
        "capped",
        (17, 18, 19, 20),
        max_new_tokens=8,
        stop_at_eos=False,
        routing=RequestRouting(parse_policy("capacity", {"capacity_factor": 1.0}, K, E)),
    )
    seqs = [engine.submit(r) for r in (exact, widened, narrowed, decaying, capped)]
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


# -- confidence_k, adaptive_k, noisy_topk, sticky (router/policy/token_rules.py) --------------------


def test_the_new_rules_parse_with_their_bounds_and_name_the_bad_field():
    policy = parse_policy("sticky+confidence_k+noisy_topk", {"k_max": 3}, top_k=2, num_experts=8)
    assert policy.name == "confidence_k+noisy_topk+sticky"
    params = "k_min=1,k_max=3,noise_scale=0.1,sticky_strength=0.5,sticky_decay=0.5"
    assert policy.key == f"confidence_k+noisy_topk+sticky({params})"
    assert parse_policy("confidence_k", {}, 2, 8).k_max == 2  # the architecture's top-k
    adaptive = parse_policy("adaptive_k", {"queue_slo_ms": 250, "k_min": 2}, 4, 8)
    assert adaptive.queue_slo_ms == 250 and adaptive.key == "adaptive_k(k_min=2)"  # the record is of its floor
    assert {"confidence_k", "adaptive_k", "prefer+adaptive_k+capacity+noisy_topk+sticky"} <= set(policy_names())
    assert not {"decay_k+confidence_k", "dynamic_k+adaptive_k"} & set(policy_names())
    cases = [
        ("confidence_k+decay_k", {}, "routing_policy.name"),
        ("adaptive_k+confidence_k", {}, "routing_policy.name"),
        ("delta_gap+adaptive_k", {}, "routing_policy.name"),
        ("confidence_k", {"k_max": 0}, "routing_policy.k_max"),
        ("confidence_k", {"k_max": 4}, "routing_policy.k_max"),  # above top-k + 1, what an expert group takes
        ("confidence_k", {"k_max": 1.5}, "routing_policy.k_max"),
        ("confidence_k", {"k_min": 3}, "routing_policy.k_min"),  # above k_max (default top-k 2)
        ("confidence_k", {"k_min": 3, "k_max": 2}, "routing_policy.k_min"),
        ("adaptive_k", {"k_min": 3}, "routing_policy.k_min"),  # above the architecture's top-k
        ("adaptive_k", {"queue_slo_ms": -1}, "routing_policy.queue_slo_ms"),
        ("adaptive_k", {"queue_slo_ms": math.inf}, "routing_policy.queue_slo_ms"),
        ("noisy_topk", {"noise_scale": -0.1}, "routing_policy.noise_scale"),
        ("noisy_topk", {"noise_scale": 5}, "routing_policy.noise_scale"),
        ("noisy_topk", {"k_max": 2}, "routing_policy.k_max"),  # not a parameter of its rules
        ("sticky", {"sticky_strength": math.nan}, "routing_policy.sticky_strength"),
        ("sticky", {"sticky_decay": 1.0}, "routing_policy.sticky_decay"),
        ("sticky", {"noise_scale": 1.0}, "routing_policy.noise_scale"),
        ("delta_gap", {"k_min": 1}, "routing_policy.k_min"),
    ]
    _assert_refused(cases)
    with pytest.raises(PolicyError, match="decay_k or confidence_k or adaptive_k"):
        parse_policy("delta_gap", {"k_min": 1}, 2, 8)


def test_confidence_is_one_minus_normalised_entropy_and_sets_k_within_its_bounds():
    E = 4
    flat, sure = torch.full((E,), 0.25), torch.tensor([1.0, 0.0, 0.0, 0.0])
    mid = torch.tensor([0.7, 0.1, 0.1, 0.1])
    conf = gate_confidence(torch.stack([flat, sure, mid]))
    h = -(0.7 * math.log(0.7) + 3 * 0.1 * math.log(0.1))
    assert conf.tolist() == [pytest.approx(0.0, abs=1e-12), 1.0, pytest.approx(1 - h / math.log(E))]
    assert gate_confidence(torch.tensor([[2.0, 2.0, 0.0, 0.0]]))[0] == pytest.approx(0.5)  # sigmoid scores, normalised
    alpha = confidence_alpha(torch.tensor([0.0, 0.5, 1.0]))
    assert alpha.tolist() == pytest.approx([0.5, 0.5 + 0.3 * math.log2(1.5), 0.8])
    # k = min(k_max, max(k_min, round(k_max / (2 alpha)))), halves up
    c = torch.tensor([0.0, 0.4, 0.5, 1.0])
    assert confidence_k(c, torch.ones(4), torch.full((4,), 2)).tolist() == [2, 2, 1, 1]  # 2, 1.6, 1.48, 1.25
    assert confidence_k(torch.tensor([0.0, 1.0]), torch.ones(2), torch.full((2,), 8)).tolist() == [8, 5]
    assert confidence_k(torch.tensor([1.0]), torch.full((1,), 3), torch.full((1,), 4)).tolist() == [3]  # 2.5 -> 3
    assert confidence_k(torch.tensor([1.0]), torch.full((1,), 4), torch.full((1,), 4)).tolist() == [4]  # k_min floor
    rng = torch.Generator().manual_seed(0)
    c = torch.rand(200, generator=rng, dtype=torch.float64)
    k_min, k_max = torch.randint(1, 3, (200,), generator=rng), torch.randint(3, 9, (200,), generator=rng)
    k = confidence_k(c, k_min, k_max)
    assert ((k >= k_min) & (k <= k_max)).all() and k.dtype == torch.int64
    # surer never means more experts
    order = torch.argsort(c)
    k = confidence_k(c[order], torch.ones(200), torch.full((200,), 8))
    assert (k[1:] <= k[:-1]).all()
    # token_k reads the confidence only for confidence_k's tokens; the others keep the gate's top-k
    rules = KRules(
        delta=torch.full((2,), math.inf),
        weight_boost=torch.ones(2),
        threshold=torch.zeros(2),
        k_min=torch.ones(2, dtype=torch.long),
        k_max=torch.tensor([4, 0]),
    )
    assert token_k(torch.zeros(2), rules, top_k=2, widest=8, confidence=torch.tensor([0.0, 1.0])).tolist() == [4, 2]
    assert token_k(torch.zeros(2), rules, top_k=2, widest=3, confidence=torch.tensor([0.0, 1.0])).tolist() == [3, 2]


def test_adaptive_k_narrows_past_the_slo_comes_back_and_never_goes_below_its_floor():
    assert adaptive_narrow(QueueSignal(0, 0.0), 100) == 0
    assert [adaptive_narrow(QueueSignal(3, w), 100) for w in (0.1, 0.15, 0.2, 0.25, 2.0)] == [0, 1, 1, 2, 19]
    assert adaptive_narrow(QueueSignal(), 0) == math.inf  # SLO 0: always the floor (what policy eval measures)
    policy = parse_policy("adaptive_k", {"queue_slo_ms": 100, "k_min": 2}, 4, 8)
    other = parse_policy("delta_gap", {}, 4, 8)
    parts = [(RequestRouting(policy), 2), (None, 1), (RequestRouting(other), 1)]

    def ks(wait):
        step = step_routing(parts, queue=QueueSignal(5, wait))
        return token_k(torch.ones(4), step.k_rules, top_k=4, widest=8).tolist()

    assert ks(0.0) == [4, 4, 4, 4]  # no queue: the architecture's top-k
    assert ks(0.15) == [3, 3, 4, 4]  # past the SLO: one fewer, for adaptive_k's tokens only
    assert ks(0.25) == [2, 2, 4, 4]
    assert ks(60.0) == [2, 2, 4, 4]  # never below k_min
    assert ks(0.05) == [4, 4, 4, 4]  # and back as soon as the queue waits less
    assert step_routing(parts).k_rules.narrow is None  # no signal: nothing queued, no narrowing
    floor = parse_policy("adaptive_k", {"queue_slo_ms": 0}, 4, 8)
    step = step_routing([(RequestRouting(floor), 3)])
    assert token_k(torch.ones(3), step.k_rules, top_k=4, widest=8).tolist() == [1, 1, 1]


def test_gumbel_noise_is_a_pure_function_of_seed_position_and_layer():
    seed, t = torch.tensor([7, 7, 8, 7]), torch.tensor([-3, 5, 5, 5])
    noise = gumbel_noise(seed, t, layer=2, num_experts=6)
    assert noise.shape == (4, 6) and noise.dtype == torch.float32 and torch.isfinite(noise).all()
    # the same token's noise in any batch, alone or beside others
    assert torch.equal(gumbel_noise(seed[1:2], t[1:2], 2, 6), noise[1:2])
    assert torch.equal(gumbel_noise(seed.flip(0), t.flip(0), 2, 6), noise.flip(0))
    assert not torch.equal(noise[1], noise[2])  # another seed
    assert not torch.equal(noise[1], noise[0])  # another position
    assert not torch.equal(gumbel_noise(seed, t, 3, 6), noise)  # another layer
    many = gumbel_noise(torch.full((4000,), 3), torch.arange(4000), 0, 8)
    assert many.mean().item() == pytest.approx(0.5772, abs=0.03)  # Euler-Mascheroni: Gumbel's mean
    assert many.std().item() == pytest.approx(math.pi / math.sqrt(6), abs=0.05)
    assert request_seed(42, "x") == request_seed(42, "y") == 42
    assert request_seed(None, "req-1") == request_seed(None, "req-1") != request_seed(None, "req-2")
    assert 0 <= request_seed(2**64 - 1, "") < 2**63
    routing = RequestRouting(parse_policy("noisy_topk", {}, 2, 8))
    assert seeded(routing, 9, "a").seed == 9 and seeded(routing, None, "a").seed == request_seed(None, "a")
    plain = RequestRouting(parse_policy("delta_gap", {}, 2, 8))
    assert seeded(plain, 9, "a") is plain and seeded(None, 9, "a") is None
    step = step_routing([(None, 2), (seeded(routing, 9, "a"), 3)], first_t=[0, -1])
    assert step.noise.scale.tolist() == [0, 0] + [pytest.approx(0.1)] * 3
    assert step.noise.seed.tolist()[2:] == [9, 9, 9] and step.noise.t.tolist()[2:] == [-1, 0, 1]


def test_sticky_leans_on_earlier_tokens_experts_with_a_decaying_trace():
    E = 4
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0], [0.0, 0.0, 2.0, 1.9], [0.0, 0.0, 0.0, 0.0]])
    one = [StickySequence(0, 3, 0, strength=1.0, decay=0.0)]
    bias = sticky_scan(logits, one, layer=0, top_k=2)
    # decay 0: a token's bias is strength on exactly the previous token's top-2 by biased logit
    assert bias.tolist() == [[0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1]]
    slow = sticky_scan(logits, [StickySequence(0, 3, 0, strength=2.0, decay=0.5)], 0, 2)
    # m1 = 0.5 onehot{0, 1}; token 1 biased: {2: 2.0, 3: 1.9, 0: 1, 1: 1} -> {2, 3}; m2 = 0.25 {0, 1} + 0.5 {2, 3}
    assert slow.tolist() == [[0, 0, 0, 0], [1, 1, 0, 0], [0.5, 0.5, 1, 1]]
    assert (slow <= 2.0).all()  # bounded by the strength
    strong = sticky_scan(logits, [StickySequence(0, 3, 0, strength=4.0, decay=0.0)], 0, 2)
    assert strong[1].tolist() == [4, 4, 0, 0]  # token 1 now keeps {0, 1} (4 > 2), so token 2 leans on them too
    assert strong[2].tolist() == [4, 4, 0, 0]
    # two sequences side by side do not see each other; other rows get no bias
    two = [StickySequence(0, 2, 0, 1.0, 0.0), StickySequence(3, 4, 0, 1.0, 0.0)]
    both = sticky_scan(torch.cat([logits[:2], torch.zeros(1, E), logits[2:]]), two, 0, 2)
    assert both[3].abs().sum() == 0 and both[2].abs().sum() == 0 and both[1].tolist() == [1, 1, 0, 0]


def test_sticky_state_carries_across_steps_and_a_recomputed_position_starts_from_the_one_before():
    torch.manual_seed(3)
    logits = torch.randn(6, 5)
    whole = sticky_scan(logits, [StickySequence(0, 6, -3, 1.5, 0.6)], layer=1, top_k=2)
    state = RoutingState()
    first = sticky_scan(logits[:4], [StickySequence(0, 4, -3, 1.5, 0.6, state)], 1, 2)
    second = sticky_scan(logits[4:], [StickySequence(0, 2, 1, 1.5, 0.6, state)], 1, 2)
    assert torch.allclose(torch.cat([first, second]), whole)  # chunked as the scheduler may: the same biases
    assert set(state.traces) == {0, 1, 2}  # what the step started from and its last two
    # the consistency guard computes t 2 again: it starts from t 1's trace, as the first time
    again = sticky_scan(logits[5:], [StickySequence(0, 1, 2, 1.5, 0.6, state)], 1, 2)
    assert torch.allclose(again, whole[5:])
    assert torch.equal(state.before(99, 1, 5), torch.zeros(5))  # nothing kept: zeros
    routing = RequestRouting(parse_policy("sticky", {"sticky_strength": 2.0}, 2, 5))
    step = step_routing([(None, 2), (routing, 3)], first_t=[0, -2], states=[None, state])
    assert step.sticky == (StickySequence(2, 5, -2, 2.0, 0.5, state),) and step.noise is None


def _gate_logits(model, ids, gate_bias, step):
    """layer -> the gate's logits [T, E] (the linear's, before any policy), and what ``_route`` gives."""
    logits, handles = {}, []
    for layer, gate in gate_bias.gates.items():
        handles.append(gate.register_forward_hook(lambda _m, _a, out, layer=layer: logits.__setitem__(layer, out[0])))
    try:
        return logits, _route(model, ids, gate_bias, step)[0]
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_confidence_k_adaptive_k_noisy_topk_and_sticky_on_every_architecture(arch):
    model = _model(arch)
    gate_bias = GateBias(model)
    ids = torch.randint(3, 100, (1, 24), generator=torch.Generator().manual_seed(1))
    stock_logits, stock = _gate_logits(model, ids, gate_bias, None)
    E = next(iter(gate_bias.num_experts.values()))
    K = next(iter(stock.values()))[0].shape[1]
    first = min(stock)
    gate = gate_bias.gates[first]
    sigmoid = hasattr(gate, "e_score_correction_bias")
    mine = slice(10, 24)  # tokens 0..9 are an exact request's, 10..23 the policy's

    def run(name, given, **kwargs):
        policy = parse_policy(name, given, K, E)
        step = step_routing([(None, 10), (seeded(RequestRouting(policy), 5, "r"), 14)], **kwargs)
        routed = _route(model, ids, gate_bias, step)[0]
        index, weights = routed[first]
        # the exact request's tokens keep the stock gate's choice and weights, bit for bit
        assert torch.equal(index[:10, :K], stock[first][0][:10]), (arch, name)
        assert torch.equal(weights[:10, :K], stock[first][1][:10]), (arch, name)
        assert (index[:10, K:] == E).all() and (weights[mine][index[mine] >= E] == 0).all(), (arch, name)
        return routed, index[mine], weights[mine]

    # confidence_k: each token's k from its gate's entropy, within [k_min, k_max] and what the gate can choose
    k_max = min(K + 1, E)
    _, index, _ = run("confidence_k", {"k_max": k_max})
    confidence = gate_confidence(gate_scores(stock_logits[first], sigmoid)[mine, :E])
    expected = confidence_k(confidence, torch.ones(14), torch.full((14,), k_max)).clamp(max=widest_k(gate, E))
    assert (index < E).sum(dim=1).tolist() == expected.tolist(), arch
    _, index, weights = run("confidence_k", {"k_max": K, "k_min": K})  # k_min = k_max = top-k: the stock choice
    assert torch.equal(index, stock[first][0][mine]) and torch.equal(weights, stock[first][1][mine]), arch
    # adaptive_k: nothing queued, the stock gate bit for bit; at its floor (SLO 0) and past an SLO, fewer experts
    _, index, weights = run("adaptive_k", {"queue_slo_ms": 100}, queue=QueueSignal(0, 0.0))
    assert torch.equal(index, stock[first][0][mine]) and torch.equal(weights, stock[first][1][mine]), arch
    _, index, _ = run("adaptive_k", {"queue_slo_ms": 0})
    assert ((index < E).sum(dim=1) == 1).all(), arch
    _, index, _ = run("adaptive_k", {"queue_slo_ms": 100}, queue=QueueSignal(4, 0.15))
    assert ((index < E).sum(dim=1) == max(1, K - 1)).all(), arch
    # noisy_topk: the same seed routes the same way; a strong noise moves choices; k and normalisation stay
    routed, index, weights = run("noisy_topk", {"noise_scale": 4.0})
    again, _, _ = run("noisy_topk", {"noise_scale": 4.0})
    assert all(torch.equal(routed[layer][0], again[layer][0]) for layer in routed), arch
    assert not torch.equal(index, stock[first][0][mine]) and ((index < E).sum(dim=1) == K).all(), arch
    total = _architecture_sum(gate)
    if total is not None:
        assert torch.allclose(weights.sum(dim=1), torch.full((14,), total), atol=1e-5), arch
    # sticky: consecutive tokens share more experts than the stock gate's do
    _, index, _ = run("sticky", {"sticky_strength": 4.0, "sticky_decay": 0.0})

    def shared(idx):
        return sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(idx[1:], idx[:-1]))

    assert shared(index) > shared(stock[first][0][mine]), arch
    # everything at once, beside the exact request
    run(
        "prefer+confidence_k+noisy_topk+sticky",
        {"k_max": k_max, "noise_scale": 1.0, "sticky_strength": 1.0},
    )
    run("restrict+adaptive_k+capacity+noisy_topk+sticky", {"queue_slo_ms": 0})


def _serve(engine, requests):
    """Each request's generated tokens, all submitted before the engine starts (one batch)."""
    seqs = [engine.submit(r) for r in requests]
    engine.start()
    try:
        events = [list(s) for s in seqs]
    finally:
        engine.stop()
    for e in events:
        assert isinstance(e[-1], FinishEvent), e[-1]
    return [[t for e in ev if isinstance(e, TokenEvent) for t in e.token_ids] for ev in events]


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_the_new_rules_in_the_engine_leave_exact_identical_and_noise_reproducible(arch):
    model = _model(arch)
    gate_bias = GateBias(model)
    K, E = model.config.num_experts_per_tok, next(iter(gate_bias.num_experts.values()))

    def request(request_id, prompt, name="exact", given=None, seed=None):
        routing = RequestRouting(parse_policy(name, given or {}, K, E))
        return GenerationRequest(
            request_id,
            prompt,
            max_new_tokens=8,
            stop_at_eos=False,
            routing=seeded(routing, seed, request_id),
        )

    exact = request("exact", (5, 6, 7, 8))
    noisy = request("noisy", (9, 10, 11), "noisy_topk", {"noise_scale": 2.0}, seed=11)
    others = [
        exact,
        noisy,
        request("conf", (12, 13), "confidence_k", {"k_max": K + 1}),
        request("sticky", (14, 15, 16), "sticky", {"sticky_strength": 2.0}),
        request("adaptive", (17, 18, 19, 20), "adaptive_k", {"queue_slo_ms": 0}),
    ]
    tokens = _serve(Engine(model, None, _LocalDispatcher(gate_bias), EngineLimits(8, 8), max_context=64), others)
    assert tokens[0] == stock_greedy(model, exact.prompt_ids, 8)
    assert all(len(t) == 8 for t in tokens[1:])
    # the noisy request alone, under another id but the same seed: the same noise, hence the same answer
    alone = _serve(
        Engine(model, None, _LocalDispatcher(gate_bias), EngineLimits(8, 8), max_context=64),
        [request("noisy-again", (9, 10, 11), "noisy_topk", {"noise_scale": 2.0}, seed=11)],
    )
    assert alone[0] == tokens[1]
