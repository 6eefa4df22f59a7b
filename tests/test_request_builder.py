"""The request builder both APIs share (``serving.request_builder``), on plain data: every bound refused with
the field at fault named as the asking API spells it, and a request's choices. The grammar compiler is the real
one over a byte tokenizer (what it refuses is what a server refuses); no model, no engine."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from expertmesh.config.settings import ServingConfig
from expertmesh.contracts.errors import InvalidRequest
from expertmesh.models.tokenizer import save_byte_tokenizer
from expertmesh.serving.grammar import Grammars, GrammarSpec
from expertmesh.serving.request import ScoreSpec
from expertmesh.serving.request_builder import (
    MAX_CACHE_SALT_CHARS,
    MAX_REQUEST_ID_CHARS,
    ModelBounds,
    RequestBuilder,
    RequestSpec,
    ScoreRequestSpec,
)
from expertmesh.serving.sampling import SamplingParams

VOCAB, CONTEXT, CAP = 300, 96, 64


@pytest.fixture(scope="module")
def builder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    save_byte_tokenizer(path, VOCAB)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = ServingConfig(max_new_tokens_cap=CAP, max_routing_trace_entries=1000)
    return RequestBuilder(ModelBounds(VOCAB, CONTEXT, 4), config, Grammars(tokenizer, VOCAB), None, tokenizer.decode)


def spec(**fields) -> RequestSpec:
    return RequestSpec(**{"prompt_ids": (5, 6, 7), "max_new_tokens": 4, **fields})


CHAT = {"prompt": "messages", "max_new_tokens": "max_completion_tokens", "logprobs": "top_logprobs"}

REFUSED = {
    "empty prompt": (spec(prompt_ids=()), "prompt", "prompt is empty"),
    "token outside the vocabulary": (spec(prompt_ids=(1, VOCAB)), "prompt", f"token ids [{VOCAB}] are outside"),
    "negative token": (spec(prompt_ids=(1, -1)), "prompt", "token ids [-1] are outside"),
    "no room for a new token": (spec(prompt_ids=(5,) * CONTEXT), "prompt", f"context is {CONTEXT} tokens"),
    "n 0": (spec(n=0), "n", "n takes 1 to 16 choices, got 0"),
    "n 17": (spec(n=17), "n", "got 17"),
    "max_new_tokens 0": (spec(max_new_tokens=0), "max_new_tokens", "at least 1, got 0"),
    "max_new_tokens above the cap": (spec(max_new_tokens=CAP + 1), "max_new_tokens", f"cap of {CAP}"),
    "min_tokens above max": (
        spec(sampling=SamplingParams(min_tokens=5)),
        "min_tokens",
        "min_tokens 5 is more than max_new_tokens 4",
    ),
    "temperature below the floor": (spec(sampling=SamplingParams(temperature=1e-3)), "temperature", "at least 0.01"),
    "bias outside the vocabulary": (
        spec(sampling=SamplingParams(logit_bias=((VOCAB, 1.0),))),
        "logit_bias",
        f"logit_bias token ids [{VOCAB}] are outside the vocabulary",
    ),
    "top_p 0": (spec(sampling=SamplingParams(top_p=0.0)), "top_p", "top_p must be in (0, 1]"),
    "logprobs 21": (spec(logprobs=21), "logprobs", "0 to 20 most likely tokens, got 21"),
    "echo logprobs 21": (spec(prompt_logprobs=21), "logprobs", "got 21"),
    "17 stops": (spec(stop=("x",) * 17), "stop", "at most 16"),
    "empty stop": (spec(stop=("",)), "stop", "stop[0] is empty"),
    "65 stop ids": (spec(stop_token_ids=(1,) * 65), "stop_token_ids", "at most 64 ids, got 65"),
    "stop id outside": (spec(stop_token_ids=(VOCAB,)), "stop_token_ids", f"[{VOCAB}] are outside the vocabulary"),
    "request id too long": (spec(request_id="r" * 129), "request_id", f"1 to {MAX_REQUEST_ID_CHARS} printable"),
    "request id with a newline": (spec(request_id="a\nb"), "request_id", "printable ASCII"),
    "cache salt too long": (spec(cache_salt="s" * 257), "cache_salt", f"at most {MAX_CACHE_SALT_CHARS}"),
    "trace too large": (spec(max_new_tokens=64, n=4, routing_trace=True), "routing_trace", "above this server's cap"),
    "a grammar the compiler refuses": (
        spec(grammar=GrammarSpec.regex("(unclosed", "structured_output.regex")),
        "structured_output.regex",
        "structured_output.regex",
    ),
    "a routing policy on a server without routing": (
        spec(domain="legal"),
        "routing_policy",
        "takes no routing policies",
    ),
    # the HTTP API's chat names
    "chat: max_completion_tokens above the cap": (
        spec(max_new_tokens=CAP + 1, names=CHAT),
        "max_completion_tokens",
        "max_completion_tokens 65 is above",
    ),
    "chat: top_logprobs 21": (spec(logprobs=21, names=CHAT), "top_logprobs", "top_logprobs takes 0 to 20"),
    "chat: empty messages": (spec(prompt_ids=(), names=CHAT), "messages", "messages is empty"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_every_bound_is_refused_naming_the_field(builder, case):
    request, field, message = REFUSED[case]
    with pytest.raises(InvalidRequest) as err:
        builder.build(request)
    assert err.value.field == field and message in str(err.value), (err.value.field, str(err.value))


def test_a_prompt_that_fills_the_context_is_its_own_kind_of_refusal(builder):
    with pytest.raises(InvalidRequest) as err:
        builder.build(spec(prompt_ids=(5,) * CONTEXT))
    assert err.value.reason == "context_length_exceeded"


def test_choices_differ_only_in_id_seed_and_who_reports_the_prompt(builder):
    choices = builder.build(
        spec(n=3, request_id="job-7", sampling=SamplingParams(temperature=1.0, seed=9), prompt_logprobs=2)
    )
    assert [c.request_id for c in choices] == ["job-7-0", "job-7-1", "job-7-2"]
    assert [c.sampling.seed for c in choices] == [9, 10, 11]
    assert [c.prompt_logprobs for c in choices] == [2, None, None], "the first choice reports the prompt"
    (one,) = builder.build(spec(request_id="job-0", cache_salt="tenant-a", client="10.0.0.7"))
    assert (one.request_id, one.cache_salt, one.client) == ("job-0", "tenant-a", "10.0.0.7")
    (chosen,) = builder.build(spec())
    assert chosen.request_id and len(chosen.request_id) <= MAX_REQUEST_ID_CHARS, "the server picks an id"


def test_a_score_request_may_fill_the_context_and_its_distribution_is_bounded(builder):
    scored = builder.build_score(ScoreRequestSpec(prompt_ids=(5,) * CONTEXT))
    assert scored.score_only and scored.score == ScoreSpec()
    big = RequestBuilder(
        ModelBounds(2**20, 64, 4), ServingConfig(), builder._grammars, None, None
    )  # a 1 Mi-token vocabulary: 17 positions are past 16 Mi floats
    with pytest.raises(InvalidRequest) as err:
        big.build_score(ScoreRequestSpec(prompt_ids=(5,) * 17, score=ScoreSpec(full_distribution=True)))
    assert err.value.field == "full_distribution"
    assert big.build_score(ScoreRequestSpec(prompt_ids=(5,) * 17)).score == ScoreSpec(), "token scores only: fine"
    with pytest.raises(InvalidRequest) as err:
        builder.build_score(ScoreRequestSpec(prompt_ids=(5,) * (CONTEXT + 1)))
    assert err.value.field == "prompt"
