"""Structured output's pure parts: the grammar compiler and matcher (``serving.grammar``) on a real tiny
checkpoint's tokenizer with the real llguidance, sampling from random logits as a model with random weights
would; the tool-call schemas and readers (``serving.tool_calls``); the chat template's tools. The served
path (HTTP and gRPC, the official client) is in ``test_http_api``."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from expertmesh.contracts.errors import InvalidRequest
from expertmesh.serving import tool_calls
from expertmesh.serving.chat import chat_prompt_ids
from expertmesh.serving.grammar import MAX_GRAMMAR_BYTES, GrammarError, Grammars, GrammarSpec
from expertmesh.serving.openai_schema import ChatMessage
from expertmesh.serving.sampling import SamplingParams, next_token

VOCAB = 1000

#: every field bounded, so any output the grammar allows ends well inside the token budget
BOUNDED = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 0, "maximum": 99},
        "metric": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["city", "days", "metric", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints):
    return AutoTokenizer.from_pretrained(tiny_checkpoints("mixtral", with_tokenizer=True, vocab_size=VOCAB))


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, VOCAB, {tokenizer.eos_token_id})


def _sample(grammars, spec: GrammarSpec, seed: int, budget: int = 200) -> tuple[list[int], bool]:
    """Tokens drawn from random logits through the grammar's mask, as the engine draws them; (tokens,
    whether the grammar finished within ``budget``)."""
    matcher = grammars.compile(spec).matcher()
    generator = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0)
    tokens = []
    for _ in range(budget):
        logits = torch.randn(VOCAB, generator=generator) * 3
        token = next_token(matcher.mask(logits), params, generator, masked=True)
        assert bool(matcher.allowed()[token])
        matcher.accept(token)
        tokens.append(token)
        if matcher.finished:
            return tokens, True
    return tokens, False


def _text(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode([t for t in tokens if t != tokenizer.eos_token_id])


@pytest.mark.parametrize("seed", range(8))
def test_a_schemas_outputs_always_validate(grammars, tokenizer, seed):
    tokens, finished = _sample(grammars, GrammarSpec.json_schema(BOUNDED), seed)
    assert finished, "a bounded schema's output ends inside the budget"
    jsonschema.validate(json.loads(_text(tokenizer, tokens)), BOUNDED)


def test_json_objects_and_regexes_hold_to_their_grammar(grammars, tokenizer):
    finished_objects = 0
    for seed in range(8):
        tokens, finished = _sample(grammars, GrammarSpec.json_object(), seed, budget=120)
        text = _text(tokenizer, tokens)
        assert text.startswith("{")
        if finished:
            assert isinstance(json.loads(text), dict)
            finished_objects += 1
        tokens, finished = _sample(grammars, GrammarSpec.regex(r"(yes|no), [0-9]{1,3}"), seed)
        assert finished and re.fullmatch(r"(yes|no), [0-9]{1,3}", _text(tokenizer, tokens))
    assert finished_objects, "some random objects close inside 120 tokens"


def test_compiled_once_per_schema_whatever_its_key_order(tokenizer):
    grammars = Grammars(tokenizer, VOCAB)
    first = grammars.compile(GrammarSpec.json_schema(BOUNDED))
    reordered = json.dumps(dict(reversed(list(BOUNDED.items()))))
    assert grammars.compile(GrammarSpec.json_schema(reordered, "elsewhere")) is first
    assert grammars.compiled == 1
    # Each sequence starts at the beginning: matchers are copies, never the cached one advancing.
    a, b = first.matcher(), first.matcher()
    a.accept(tokenizer.convert_tokens_to_ids("{"))
    assert not torch.equal(a.allowed(), b.allowed())


def test_what_cannot_be_compiled_is_refused_naming_its_field(grammars, tokenizer):
    with pytest.raises(GrammarError, match=r"^response_format\.json_schema\.schema: .*frob") as err:
        grammars.compile(GrammarSpec.json_schema({"type": "frob"}))
    assert isinstance(err.value, InvalidRequest) and err.value.field == "response_format.json_schema.schema"
    with pytest.raises(GrammarError, match="not JSON"):
        GrammarSpec.json_schema("{oops", "structured_output.json_schema")
    with pytest.raises(GrammarError, match="is an object"):
        GrammarSpec.json_schema([1, 2])
    with pytest.raises(GrammarError, match=f"at most {MAX_GRAMMAR_BYTES}"):
        GrammarSpec.json_schema({"description": "x" * MAX_GRAMMAR_BYTES})
    with pytest.raises(GrammarError, match="regular expression cannot be compiled"):
        grammars.compile(GrammarSpec.regex("(unclosed", "structured_output.regex"))
    with pytest.raises(GrammarError, match="needs the model's tokenizer"):
        Grammars(None, VOCAB).compile(GrammarSpec.json_object())


# -- tool calls --------------------------------------------------------------------------------

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [("get_weather", WEATHER), ("ping", None)]


def _ids():
    counter = iter(range(100))
    return lambda: f"call_{next(counter)}"


def test_a_forced_calls_schema_is_the_functions_or_an_array_of_named_calls():
    assert tool_calls.call_schema(TOOLS, "get_weather", True) == WEATHER
    assert tool_calls.call_schema(TOOLS, "ping", True) == tool_calls.ANY_OBJECT
    many = tool_calls.call_schema(TOOLS, None, True)
    assert many["minItems"] == 1 and "maxItems" not in many
    assert tool_calls.call_schema(TOOLS, None, False)["maxItems"] == 1
    call = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "ping", "parameters": {}}]
    jsonschema.validate(call, many)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], many)  # city is required
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "other", "parameters": {}}], many)


def test_forced_answers_read_back_as_calls():
    assert tool_calls.named_calls('{"city": "Oslo"}', "get_weather", _ids()) == [
        tool_calls.Call("call_0", "get_weather", '{"city": "Oslo"}')
    ]
    assert tool_calls.named_calls('{"city": "Os', "get_weather") is None  # cut short by max_tokens
    calls = tool_calls.required_calls(
        '[{"name":"ping","parameters":{}},{"name":"get_weather","parameters":{"city":"Lima"}}]', _ids()
    )
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("ping", {}), ("get_weather", {"city": "Lima"})]
    assert tool_calls.required_calls("[]") is None and tool_calls.required_calls('[{"name": "ping"') is None


@pytest.mark.parametrize(
    "text,content,calls",
    [
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
            "",
            [("get_weather", {"city": "Oslo"})],
        ),
        ('Let me look.<tool_call>{"name": "ping", "arguments": {}}</tool_call>', "Let me look.", [("ping", {})]),
        ('{"name": "get_weather", "parameters": {"city": "Lima"}}', "", [("get_weather", {"city": "Lima"})]),
        ('[TOOL_CALLS] [{"name": "ping", "arguments": "{}"}]', "", [("ping", {})]),
        ("It is sunny.", None, None),
        ('{"name": "launch_rockets", "arguments": {}}', None, None),  # not one of the tools
        ('{"city": "Oslo"}', None, None),  # JSON, but not a call
    ],
)
def test_auto_answers_are_calls_only_in_a_templates_call_forms(text, content, calls):
    read = tool_calls.auto_calls(text, ["get_weather", "ping"], _ids())
    if calls is None:
        assert read is None
        return
    assert read[0] == content
    assert [(c.name, json.loads(c.arguments)) for c in read[1]] == calls


def test_a_streamed_auto_answer_is_held_only_while_it_may_be_a_call():
    assert all(tool_calls.may_be_a_call(t) for t in ("", " ", "<tool", "<tool_call>{", "{", "[TOOL"))
    assert not any(tool_calls.may_be_a_call(t) for t in ("It", " Sure", "<b>"))


TOOL_TEMPLATE = (
    "{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}call {{ c.function.name }} city={{ c.function.arguments.city }}"
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_the_chat_template_writes_the_tools_and_reads_earlier_calls_as_mappings(tokenizer):
    tokenizer.chat_template = TOOL_TEMPLATE
    messages = [
        ChatMessage(role="user", content="weather?"),
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "tool_calls": [{"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}],
            }
        ),
        ChatMessage(role="tool", tool_call_id="c1", content="sunny"),
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    text = tokenizer.decode(chat_prompt_ids(tokenizer, messages, "m", tools=tools))
    assert '<|tools|>[{"type": "function", "function": {"name": "get_weather"' in text
    assert "<|assistant|>call get_weather city=Oslo<|tool|>sunny<|assistant|>" in text
    assert "<|tools|>" not in tokenizer.decode(chat_prompt_ids(tokenizer, messages, "m"))
