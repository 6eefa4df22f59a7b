"""The consistency guard (``serving.consistency_guard``): its scorers as pure functions, the widened routing of a
recomputed token on every verified architecture, and the engine's rollback on a real tiny model with local
experts, checked against a hand-driven forward that widens the same position. The embedding scorer runs the
real all-MiniLM-L6-v2 from its PyPI package (offline)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from expertmesh.contracts.errors import InvalidRequest
from expertmesh.models.tiny import MOE_ARCHITECTURES
from expertmesh.router.policy.gate_hook import GateBias
from expertmesh.router.policy.routing_policy import STOCK, RequestRouting, parse_policy, step_routing
from expertmesh.router.policy.token_rules import RoutingState
from expertmesh.serving.consistency_guard import (
    Check,
    EmbeddingScorer,
    GuardError,
    GuardSpec,
    SelfScorer,
    latest_span,
    widened_k,
)
from expertmesh.serving.engine import Engine, EngineLimits
from expertmesh.serving.events import TokenEvent
from expertmesh.serving.request import GenerationRequest
from expertmesh.serving.request_routing import RequestRouter
from expertmesh.v1 import inference_pb2 as pb
from helpers import stock_greedy
from test_routing_policy import _LocalDispatcher, _model, _route


def _check(logits, token, answer="", new=""):
    return Check(torch.tensor(logits), token, "", answer, new)


def test_the_self_score_is_the_chosen_tokens_share_of_the_top_two():
    logits = torch.tensor([0.6, 0.2, 0.15, 0.05]).log().tolist()
    assert SelfScorer().score(_check(logits, 0)) == pytest.approx(0.75)
    assert SelfScorer().score(_check(logits, 1)) == pytest.approx(0.25)  # a sampled runner-up: the top is its rival
    assert SelfScorer().score(_check([1.0, 1.0, 0.0], 1)) == pytest.approx(0.5)


def test_spans_are_judged_at_word_boundaries():
    assert latest_span("The court ruled", " that") == ("ruled that", "The court ")
    assert latest_span("The court rul", "ed") == (None, "The court rul")
    assert latest_span("", " The") == (None, "")


def test_the_embedding_scorer_rates_a_related_span_above_an_unrelated_one():
    scorer = EmbeddingScorer()
    prompt = "Explain the arbitration clause of this contract."
    near = scorer.score(Check(torch.zeros(3), 0, prompt, "The clause requires", " arbitration"))
    far = scorer.score(Check(torch.zeros(3), 0, prompt, "The clause requires", " bananas"))
    assert 0 <= far < near <= 1
    assert scorer.score(Check(torch.zeros(3), 0, prompt, "The clause requi", "res")) is None


def test_a_bad_guard_is_refused_naming_its_field():
    assert GuardSpec.parse("self", None, None, 2) == GuardSpec("self", 0.65, 8, 3)
    assert (widened_k(1), widened_k(2), widened_k(3), widened_k(8)) == (3, 3, 4, 9)
    for args, field in [
        (("cosine", None, None), "consistency_guard.scorer"),
        (("self", 1.5, None), "consistency_guard.threshold"),
        (("self", float("nan"), None), "consistency_guard.threshold"),
        (("self", None, 65), "consistency_guard.max_regenerations"),
    ]:
        with pytest.raises(GuardError) as err:
            GuardSpec.parse(*args, 2)
        assert err.value.field == field
    with pytest.raises(GuardError) as err:
        GuardSpec.parse("self", None, None, 2, recompute="wider")
    assert err.value.field == "consistency_guard.recompute"
    assert GuardSpec.parse("self", None, None, 2, recompute="exact").widen_to == STOCK
    router = RequestRouter(2, 8, (0, 1), "exact", None, 0.1, guard_default=GuardSpec("self"))
    delta = RequestRouting(parse_policy("delta_gap", {}, 2, 8))
    assert router.consistency_guard(None, delta) == GuardSpec("self"), "the server's default"
    assert router.consistency_guard(pb.ConsistencyGuard(scorer=""), delta) is None, "asked for none"
    assert router.consistency_guard(None, RequestRouting()) is None, "exact is never guarded"
    with pytest.raises(InvalidRequest, match="consistency_guard.threshold"):
        router.consistency_guard(pb.ConsistencyGuard(scorer="self", threshold=2), delta)


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_a_widened_sequence_takes_top_3_beside_untouched_ones(arch):
    model = _model(arch)
    gate_bias = GateBias(model)
    K, E = model.config.num_experts_per_tok, next(iter(gate_bias.num_experts.values()))
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(2))
    stock, _ = _route(model, ids, gate_bias, None)
    delta = RequestRouting(parse_policy("delta_gap", {"delta": 0.0}, K, E))  # narrows every token it can
    step = step_routing([(None, 4), (delta, 4), (delta, 4)], widen=[0, widened_k(K), 0])
    routed, _ = _route(model, ids, gate_bias, step)
    first = min(routed)
    index, weights = routed[first]
    chosen = (index < E).sum(dim=1)  # [12]
    assert torch.equal(index[:4, :K], stock[first][0][:4]), "the exact sequence keeps the stock choice"
    assert (chosen[4:8] == min(widened_k(K), E)).all(), f"{arch}: the widened one takes top-{widened_k(K)}"
    assert (chosen[8:] == 1).all(), "the other delta_gap sequence is narrowed as before"
    # recompute="exact": the sequence's tokens take the stock gate, none of its policy's rules
    stock_step = step_routing([(None, 4), (delta, 4), (delta, 4)], widen=[0, STOCK, 0])
    index, weights = _route(model, ids, gate_bias, stock_step)[0][first]
    assert torch.equal(index[:8, :K], stock[first][0][:8]) and torch.equal(weights[:8, :K], stock[first][1][:8])
    assert ((index[8:] < E).sum(dim=1) == 1).all()


def _guarded(threshold, max_regenerations, top_k=2):
    return GuardSpec("self", threshold, max_regenerations, widened_k(top_k))


def _tokens(events):
    return [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]


def _logprobs(events):
    return [t.logprob for e in events if isinstance(e, TokenEvent) for t in e.logprobs]


def test_a_rolled_back_token_is_computed_again_widened_and_the_others_are_untouched():
    """threshold 1: every check fails, so with one regeneration allowed exactly the first new token is computed
    again, its predecessor's position widened to top-3; the oracle drives the same forward by hand."""
    model = _model("mixtral")
    gate_bias = GateBias(model)
    K, E = model.config.num_experts_per_tok, next(iter(gate_bias.num_experts.values()))
    delta = RequestRouting(parse_policy("delta_gap", {}, K, E))
    prompt = (5, 17, 99, 3, 42, 7)

    def run(guard):
        engine = Engine(model, None, _LocalDispatcher(gate_bias), EngineLimits(8, 8), max_context=64).start()
        try:
            exact = engine.submit(GenerationRequest("exact", (9, 8, 7, 6), max_new_tokens=6, stop_at_eos=False))
            guarded = engine.submit(
                GenerationRequest(
                    "g",
                    prompt,
                    max_new_tokens=6,
                    stop_at_eos=False,
                    routing=delta,
                    consistency_guard=guard,
                    logprobs=0,
                )
            )
            events = list(guarded)
            return _tokens(list(exact)), (_tokens(events), _logprobs(events)), guarded.output.rollbacks
        finally:
            engine.stop()

    exact_tokens, plain, _ = run(None)
    assert exact_tokens == stock_greedy(model, (9, 8, 7, 6), 6)
    assert run(_guarded(0.0, 8))[1:] == (plain, 0), "nothing below 0: no rollback, the same tokens"
    exact_beside, guarded, rollbacks = run(_guarded(1.0, 1))
    assert rollbacks == 1 and exact_beside == exact_tokens

    # the oracle: the prompt but its last token under delta_gap, that last token widened, then delta_gap again
    cache, out, logprobs = DynamicCache(config=model.config), [], []
    with torch.no_grad():
        with gate_bias.routing(step_routing([(delta, len(prompt) - 1)])):
            model(input_ids=torch.tensor([prompt[:-1]]), past_key_values=cache)
        last, widen = prompt[-1], [widened_k(K)]
        for _ in range(6):
            with gate_bias.routing(step_routing([(delta, 1)], widen=widen)):
                logits = model(input_ids=torch.tensor([[last]]), past_key_values=cache).logits
            last, widen = int(logits[0, -1].argmax()), [0]
            out.append(last)
            logprobs.append(float(logits[0, -1].float().log_softmax(-1)[last]))
    assert guarded[0] == out
    assert guarded[1] == pytest.approx(logprobs, abs=1e-5)
    assert abs(guarded[1][0] - plain[1][0]) > 1e-4, "the widening moved the first token's logits (else no test)"
    _, all_checked, rollbacks = run(_guarded(1.0, 64))
    assert rollbacks == 6, "every new token failed its check once; a recomputed one is kept unchecked"


def test_a_rolled_back_token_under_sticky_starts_from_its_predecessors_trace():
    """sticky's trace lives in the request's RoutingState: the engine's first new token is rolled back (threshold
    1, one regeneration), its predecessor's position computed again widened from the trace before it, and the
    answer equals a hand-driven forward that carries one state through prompt, the widened position and decode."""
    model = _model("mixtral")
    gate_bias = GateBias(model)
    K, E = model.config.num_experts_per_tok, next(iter(gate_bias.num_experts.values()))
    sticky = RequestRouting(parse_policy("sticky", {"sticky_strength": 4.0, "sticky_decay": 0.9}, K, E))
    prompt = (5, 17, 99, 3, 42, 7)
    engine = Engine(model, None, _LocalDispatcher(gate_bias), EngineLimits(8, 8), max_context=64).start()
    try:
        request = GenerationRequest(
            "s",
            prompt,
            max_new_tokens=6,
            stop_at_eos=False,
            routing=sticky,
            consistency_guard=_guarded(1.0, 1),
            logprobs=0,
        )
        guarded = engine.submit(request)
        events = list(guarded)
        assert guarded.output.rollbacks == 1
    finally:
        engine.stop()

    def oracle(state: RoutingState | None) -> tuple[list[int], list[float]]:
        """The greedy tokens and their log-probabilities; ``state`` None: none kept, each step's trace from zeros."""
        cache, out, logprobs, P = DynamicCache(config=model.config), [], [], len(prompt)
        with torch.no_grad():
            with gate_bias.routing(step_routing([(sticky, P - 1)], first_t=[1 - P], states=[state])):
                model(input_ids=torch.tensor([prompt[:-1]]), past_key_values=cache)
            last, widen = prompt[-1], [widened_k(K)]
            for t in range(6):
                with gate_bias.routing(step_routing([(sticky, 1)], first_t=[t], widen=widen, states=[state])):
                    logits = model(input_ids=torch.tensor([[last]]), past_key_values=cache).logits
                last, widen = int(logits[0, -1].argmax()), [0]
                out.append(last)
                logprobs.append(float(logits[0, -1].float().log_softmax(-1)[last]))
        return out, logprobs

    tokens, logprobs = oracle(RoutingState())
    assert _tokens(events) == tokens
    assert _logprobs(events) == pytest.approx(logprobs, abs=1e-5)
    _, stateless = oracle(None)
    assert max(abs(a - b) for a, b in zip(stateless, logprobs)) > 1e-4, "the trace across steps counts (else no test)"
