"""A request's controls on its next-token logits: ``logit_bias``, ``min_tokens``, ``stop_token_ids`` and
the repetition, frequency and presence penalties.

``sampling.controlled`` is tested as a pure function on small hand-worked rows; the engine, with several
controlled requests in one packed step beside plain ones, against transformers' own logits processors
(``RepetitionPenaltyLogitsProcessor``, ``SequenceBiasLogitsProcessor``, ``MinNewTokensLengthLogitsProcessor``)
run in a plain greedy loop over the same tiny checkpoint. transformers has no processor for OpenAI's
frequency and presence penalties; the reference for those is a processor written here from OpenAI's
formula over the generated tokens, with Python counts (not the engine's tensors)."""

import dataclasses
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from expertmesh.serving.engine import Engine, EngineLimits
from expertmesh.serving.events import FinishEvent, TokenEvent
from expertmesh.serving.request import GenerationRequest
from expertmesh.serving.sampling import SamplingParams, controlled, next_token
from helpers import StepDispatcher

# -- the pure function -----------------------------------------------------------------------------------------


def _row(*values):
    return torch.tensor(values, dtype=torch.float32)


def test_no_controls_returns_the_row_itself():
    row = _row(1.0, 2.0)
    assert controlled(row, SamplingParams(), (0,), (1,), {1}) is row


def test_logit_bias_adds_to_its_tokens():
    out = controlled(_row(1.0, 2.0, 3.0), SamplingParams(logit_bias=((0, 5.0), (2, -1.5))), (), (), set())
    assert out.tolist() == [6.0, 2.0, 1.5]


def test_min_tokens_keeps_the_end_ids_out_until_enough_tokens():
    params = SamplingParams(min_tokens=2)
    assert controlled(_row(1.0, 9.0, 3.0), params, (), (0,), {1, 7}).tolist() == [1.0, float("-inf"), 3.0]
    assert controlled(_row(1.0, 9.0, 3.0), params, (), (0, 2), {1}).tolist() == [1.0, 9.0, 3.0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    out = controlled(_row(4.0, -4.0, 4.0, 0.0), SamplingParams(repetition_penalty=2.0), (0,), (1, 1), set())
    assert out.tolist() == [2.0, -8.0, 4.0, 0.0]  # token 2 never occurred


def test_frequency_and_presence_penalties_count_the_generated_tokens_only():
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    out = controlled(_row(0.0, 0.0, 0.0), params, (2, 2, 2), (0, 0, 1), set())
    assert out.tolist() == [-2.0, -1.5, 0.0]  # 0: 2 x 0.5 + 1; 1: 0.5 + 1; 2 was in the prompt only


def test_controls_come_before_greedy_and_sampled_choices():
    row = _row(3.0, 2.0, 1.0)
    params = SamplingParams(logit_bias=((2, 10.0),))
    assert next_token(controlled(row, params, (), (), set()), params, None) == 2


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(logit_bias=((0, 100.5),)), "logit_bias values must be in [-100, 100]"),
        (SamplingParams(logit_bias=((99, 1.0),)), "logit_bias token ids [99] are outside the vocabulary (0-9)"),
        (SamplingParams(logit_bias=tuple((i, 1.0) for i in range(1025))), "at most 1024 tokens"),
        (SamplingParams(min_tokens=-1), "min_tokens must be >= 0"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty must be > 0"),
        (SamplingParams(frequency_penalty=2.5), "frequency_penalty must be in [-2, 2]"),
        (SamplingParams(presence_penalty=float("nan")), "presence_penalty must be in [-2, 2]"),
    ],
)
def test_out_of_range_controls_are_named(params, message):
    assert any(message in p for p in params.problems(vocab_size=10)), params.problems(vocab_size=10)


# -- the engine against transformers' processors ---------------------------------------------------------------


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's frequency and presence penalties over the tokens after the prompt."""

    def __init__(self, prompt_len, frequency, presence):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        for token, count in Counter(input_ids[0, self.prompt_len :].tolist()).items():
            scores[0, token] -= self.frequency * count + self.presence
        return scores


def _reference(model, prompt, n, processors, end_ids=()):
    """transformers' greedy loop with ``processors``; stops before a token of ``end_ids``."""
    ids, cache, feed, out = list(prompt), DynamicCache(config=model.config), list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([feed]), cache=cache, use_cache=True).logits[:, -1].float()
            token = int(processors(torch.tensor([ids]), logits)[0].argmax())
            if token in end_ids:
                break
            out.append(token)
            ids.append(token)
            feed = [token]
    return out


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoints("mixtral"), experts_implementation="eager").eval()


def _serve(model, requests):
    engine = Engine(model, None, StepDispatcher(), EngineLimits(8, 8, max_step_tokens=16), max_context=64)
    seqs = [engine.submit(r) for r in requests]
    engine.start()
    try:
        return {r.request_id: list(s) for r, s in zip(requests, seqs)}
    finally:
        engine.stop()


def _tokens(events):
    assert isinstance(events[-1], FinishEvent), events[-1]
    return [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]


def test_controlled_requests_in_one_step_get_transformers_tokens(model):
    prompt, n = (5, 6, 7, 5, 6), 12
    plain = _reference(model, prompt, n, LogitsProcessorList())
    biased = plain[1]  # a token greedy would choose anyway, pushed to the front
    end = plain[3]  # made the model's EOS below: the plain request stops before it
    model.generation_config.eos_token_id = end
    cases = {
        "plain": (SamplingParams(), LogitsProcessorList(), (end,)),
        "repetition": (
            SamplingParams(repetition_penalty=1.8),
            LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.8)]),
            (end,),
        ),
        "bias": (
            SamplingParams(logit_bias=((biased, 2.5), (plain[0], -3.0))),
            LogitsProcessorList([SequenceBiasLogitsProcessor([[[biased], 2.5], [[plain[0]], -3.0]])]),
            (end,),
        ),
        "min_tokens": (
            SamplingParams(min_tokens=8),
            LogitsProcessorList([MinNewTokensLengthLogitsProcessor(len(prompt), 8, end)]),
            (end,),
        ),
        "penalties": (
            SamplingParams(frequency_penalty=1.2, presence_penalty=0.7),
            LogitsProcessorList([OpenAIPenalties(len(prompt), 1.2, 0.7)]),
            (end,),
        ),
    }
    requests = [GenerationRequest(name, prompt, max_new_tokens=n, sampling=p) for name, (p, _, _) in cases.items()]
    events = _serve(model, requests)
    got = {name: _tokens(e) for name, e in events.items()}
    expected = {name: _reference(model, prompt, n, procs, ends) for name, (_, procs, ends) in cases.items()}
    assert got == expected
    assert got["plain"] == plain[: plain.index(end)] and events["plain"][-1].reason == "eos"
    assert len(set(map(tuple, got.values()))) > 2, "the controls changed the tokens"
    assert len(got["min_tokens"]) >= 8


def test_a_stop_token_id_ends_the_completion_before_it(model):
    prompt = (9, 4, 50, 42)
    plain = _reference(model, prompt, 10, LogitsProcessorList())
    request = GenerationRequest("s", prompt, max_new_tokens=10, stop_at_eos=False, stop_token_ids=(plain[4],))
    events = _serve(model, [request])["s"]
    assert _tokens(events) == plain[: plain.index(plain[4])] and events[-1].reason == "stop"


def test_seeded_sampling_with_controls_is_the_same_alone_and_batched(model):
    params = SamplingParams(temperature=0.9, seed=7, repetition_penalty=1.3, frequency_penalty=0.5)
    mine = GenerationRequest("mine", (3, 4, 5), max_new_tokens=10, sampling=params, stop_at_eos=False)
    others = [GenerationRequest(f"o{i}", (i + 10, i + 11), max_new_tokens=8, stop_at_eos=False) for i in range(3)]
    alone = _tokens(_serve(model, [mine])["mine"])
    batched = _tokens(_serve(model, [*others, mine])["mine"])
    assert alone == batched and len(alone) == 10


def test_logprobs_are_the_models_log_softmax_batched_or_alone(model):
    """Each new token's log-probability and the top 4, from the model's logits (before the controls: a
    repetition penalty changes which token comes, not what the model gave it)."""
    prompt = (3, 9, 27, 81)
    request = GenerationRequest(
        "lp", prompt, max_new_tokens=6, stop_at_eos=False, logprobs=4, sampling=SamplingParams(repetition_penalty=1.4)
    )
    others = [GenerationRequest(f"o{i}", (i + 5,), max_new_tokens=4, stop_at_eos=False) for i in range(2)]
    events = _serve(model, [*others, request])["lp"]
    tokens = _tokens(events)
    entries = [e for ev in events if isinstance(ev, TokenEvent) for e in ev.logprobs]
    with torch.no_grad():
        expected = model(torch.tensor([[*prompt, *tokens]])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    assert [e.token_id for e in entries] == tokens
    for i, e in enumerate(entries):
        assert e.logprob == pytest.approx(float(expected[i, e.token_id]), abs=1e-5)
        assert [t for t, _ in e.top] == expected[i].topk(4).indices.tolist()
    assert _serve(model, [dataclasses.replace(request, logprobs=None)])["lp"][0].logprobs == ()
