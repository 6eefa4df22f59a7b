"""The embedded and tiny models' ChatML chat template (``models.chat_template``), rendered by transformers'
own ``apply_chat_template`` on the byte tokenizer that carries it. Pure: no model, no server."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from expertmesh.models.tokenizer import save_byte_tokenizer
from expertmesh.serving.tool_calls import auto_calls

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    save_byte_tokenizer(path, 320)
    return AutoTokenizer.from_pretrained(path)


def render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def test_turns_in_chatml_and_the_assistants_turn_opened(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    assert render(tokenizer, messages, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(tokenizer, messages[1:2]) == "<|im_start|>user\nHi<|im_end|>\n", "no system turn unless asked"
    developer = render(tokenizer, [{"role": "developer", "content": "Be brief."}, messages[1]])
    assert developer.startswith("<|im_start|>system\nBe brief.<|im_end|>\n"), "OpenAI's developer role is system"


def test_tools_calls_and_answers_in_the_form_the_server_reads_back(tokenizer):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "12 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]
    text = render(tokenizer, messages, tools=[WEATHER], add_generation_prompt=True)
    system, _, rest = text.partition("<|im_end|>\n")
    assert system.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0]
    assert json.loads(listed) == WEATHER["function"], "each offered function as one JSON line"
    turn = rest.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, (read,) = auto_calls(turn, ["get_weather"], new_id=lambda: "x")
    assert content == "" and (read.name, json.loads(read.arguments)) == ("get_weather", {"city": "Oslo"})
    assert rest.endswith(
        "<|im_start|>user\n<tool_response>\n12 C\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    ), "consecutive tool answers share one user turn"


def test_a_name_with_a_quote_stays_json(tokenizer):
    """The template writes names with ``tojson``: a name cannot break the call's JSON (the server refuses such
    names anyway; the template must not depend on it)."""
    call = {"id": "c1", "type": "function", "function": {"name": 'a"b', "arguments": {}}}
    text = render(tokenizer, [{"role": "assistant", "content": "x", "tool_calls": [call]}])
    block = text.split("<tool_call>\n")[1].split("\n</tool_call>")[0]
    assert json.loads(block) == {"name": 'a"b', "arguments": {}}


def test_a_tokenizer_saved_without_one_has_none(tmp_path):
    save_byte_tokenizer(tmp_path, 320, chat_template=None)
    assert not AutoTokenizer.from_pretrained(tmp_path).chat_template
