"""The OpenAI-compatible HTTP API (`expertmesh up --http-port`).

Two halves. First the HTTP layer alone: the real Starlette app on a real uvicorn
server (``HttpServer``) over a scripted engine, for what a real model cannot be
made to do on demand (a full queue, a failing step, a deadline, a stream that
never ends) and for every bad request; fast, no Ray. Then the real thing:
`expertmesh up --http-port 0` on a tiny checkpoint given a chat template, driven
by the official ``openai`` client, streaming and not, with greedy outputs equal
to the gRPC API's for the same prompt.
"""

from __future__ import annotations

import datetime
import json
import queue
import re
import signal
import ssl
import threading
import time
from types import SimpleNamespace

import grpc
import httpx2
import jsonschema
import openai
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from transformers import AutoModelForCausalLM, AutoTokenizer

from expertmesh.client import Client
from expertmesh.config.settings import ServingConfig, TlsConfig
from expertmesh.contracts.errors import Overloaded, ShuttingDown
from expertmesh.models.tiny import make_tiny_checkpoint
from expertmesh.models.tokenizer import save_byte_tokenizer
from expertmesh.serving.events import ErrorEvent, Failure, FinishEvent, TokenEvent
from expertmesh.serving.grammar import Grammars
from expertmesh.serving.http_api import HttpApi
from expertmesh.serving.http_server import HttpServer
from expertmesh.serving.openai_adapter import OpenAIAdapter, ServedModel
from expertmesh.serving.openai_schema import Prompt
from expertmesh.serving.readiness import Readiness
from expertmesh.serving.request import GenerationRequest
from expertmesh.serving.warmup import WarmUpState
from helpers import serving_http

MODEL = "tiny"
VOCAB = 300
CONTEXT = 96
CAP = 64
BODY_LIMIT = 64 * 1024
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# -- the HTTP layer over a scripted engine -------------------------------------------------------


def _finish(request: GenerationRequest, n: int = 1, reason: str = "length") -> FinishEvent:
    return FinishEvent(reason, len(request.prompt_ids), n)


class ScriptedSequence:
    """What the HTTP layer uses of an engine ``Sequence``: its events until the final one, and ``cancel``."""

    def __init__(self, request: GenerationRequest):
        self.request = request
        self.events: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def __iter__(self):
        while True:
            event = self.events.get()
            yield event
            if isinstance(event, (FinishEvent, ErrorEvent)):
                return


class ScriptedEngine:
    """``Engine.submit`` and ``load`` over scripted events: ``script(request, seq)`` fills the queue."""

    def __init__(self):
        self.refuse: Exception | None = None
        self.script = self.hello
        self.submitted: list[ScriptedSequence] = []
        self.warmed = threading.Event()  # as the engine's after its warm-up: the gRPC server waits on it
        self.warmed.set()

    @staticmethod
    def hello(request, seq):
        for text in ("Hel", "lo"):
            seq.events.put(TokenEvent([72], text))
        seq.events.put(_finish(request, 2))

    @staticmethod
    def endless(request, seq):
        """Tokens until the sequence is cancelled, then the engine's CANCELLED error (as at a step boundary)."""

        def run():
            while not seq.cancelled.wait(0.01):
                seq.events.put(TokenEvent([65], "A"))
            seq.events.put(ErrorEvent(Failure.CANCELLED, "the client cancelled the request"))

        threading.Thread(target=run, daemon=True).start()

    def submit(self, request: GenerationRequest) -> ScriptedSequence:
        if self.refuse is not None:
            raise self.refuse
        seq = ScriptedSequence(request)
        self.submitted.append(seq)
        self.script(request, seq)
        return seq

    def load(self) -> tuple[int, int]:
        return sum(not s.cancelled.is_set() for s in self.submitted), 0

    def kv_usage(self):
        return None  # as under the per-sequence fallback: no pool

    warm_up_state = WarmUpState("done", 0.0)


class FakeProbe:
    """GroupProbe's answers, set by the test: health states, and what each group's Describe says it holds."""

    def __init__(self):
        self.states_now = {"g0": "serving", "g1": "serving"}
        self.held = {}

    def states(self, groups, endpoints):
        return {g: self.states_now[g] for g in groups}

    def close(self):
        pass


class FakeWatcher:
    """What readiness reads of the router's table watcher: its view, whether the store answered its latest round,
    and the address the router dials for each group."""

    def __init__(self, view):
        self.view = view
        self.store_problem = None

    def addresses(self):
        return {"g0": "127.0.0.1:1", "g1": "127.0.0.1:2"}


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    save_byte_tokenizer(path, VOCAB, chat_template=None)  # the refusal path; `chat_template` below gives one
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def layer(byte_tokenizer):
    """(base URL, engine, store, probe, readiness) of a served HttpApi over a ScriptedEngine."""
    engine = ScriptedEngine()
    engine.grammars = Grammars(byte_tokenizer, VOCAB)  # the real compiler: what it refuses is what a server refuses
    probe = FakeProbe()
    # Expert 0 of layer 1 only in g0, expert 1 in g0 and g1.
    view = SimpleNamespace(groups=("g0", "g1"), holders={(1, 0): (0,), (1, 1): (0, 1)}, version=7)
    watcher = FakeWatcher(view)
    readiness = Readiness(watcher, engine, probe=probe, cache_s=0)
    config = ServingConfig(port=0, http_port=0, max_new_tokens_cap=CAP, http_max_body_bytes=BODY_LIMIT)
    adapter = OpenAIAdapter(engine, byte_tokenizer, ServedModel(MODEL, VOCAB, CONTEXT), config)
    app = HttpApi(adapter, readiness, config).app
    server = HttpServer(app, "127.0.0.1", 0, tls=TlsConfig()).start()
    yield SimpleNamespace(
        url=server.url, app=app, engine=engine, watcher=watcher, probe=probe, readiness=readiness, adapter=adapter
    )
    server.stop()


@pytest.fixture
def scripted(layer):
    layer.engine.refuse = None
    layer.engine.script = ScriptedEngine.hello
    layer.engine.submitted.clear()
    yield layer
    layer.engine.refuse = None
    layer.engine.script = ScriptedEngine.hello


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


def _post(url: str, path: str, body) -> httpx2.Response:
    return httpx2.post(f"{url}{path}", json=body, timeout=30)


def _sse_data(response: httpx2.Response) -> list[str]:
    return [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]


def _assert_error_shape(response: httpx2.Response, status: int, code: str | None, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["param"] == param, error
    assert error["type"] == (
        "server_error" if status >= 500 else "rate_limit_error" if status == 429 else "invalid_request_error"
    )
    assert error["message"]
    return error


def test_completion_defaults_shape_and_usage(scripted):
    completion = _openai(scripted.url).completions.create(model=MODEL, prompt="Hi there", stop="\n", seed=5)
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-") and completion.model == MODEL
    (choice,) = completion.choices
    assert (choice.text, choice.finish_reason, choice.index) == ("Hello", "length", 0)
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens) == (
        8,
        2,
        10,
    )
    (seq,) = scripted.engine.submitted
    request = seq.request
    assert request.prompt_ids == tuple(ord(c) + 3 for c in "Hi there")  # the byte tokenizer: 3 specials first
    # OpenAI's sampling defaults (temperature 1, top_p 1) and the server's max_new_tokens default.
    assert (request.sampling.temperature, request.sampling.top_p, request.sampling.seed) == (1.0, 1.0, 5)
    assert request.max_new_tokens == ServingConfig().default_max_new_tokens and request.stop == ("\n",)


def test_streamed_completion_and_chat_chunks_end_with_done(scripted):
    body = {
        "model": MODEL,
        "prompt": [5, 6],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 2,
    }
    data = _sse_data(_post(scripted.url, "/v1/completions", body))
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["Hel", "lo", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 2,
        "total_tokens": 4,
    }
    assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1

    response = _post(
        scripted.url,
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True},
    )
    # The scripted engine never sees the chat prompt: this tokenizer has no template, so this is a 400.
    _assert_error_shape(response, 400, "chat_template_missing", "messages")


def test_openai_client_streams(scripted):
    stream = _openai(scripted.url).completions.create(model=MODEL, prompt="x", stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == "Hello" and chunks[-1].choices[0].finish_reason == "length"


def test_streamed_text_with_unicode_line_separators_keeps_each_event_on_one_line(scripted):
    """U+2028, U+2029 and U+0085 may stand raw in a JSON string, and ``str.splitlines`` ends a line at each: a client
    reading the stream by lines that way (httpx's ``iter_lines``, which guidellm uses) had an event cut in two
    (guidellm's "Unterminated string" in a CI run, on a tiny model's random text). They go escaped; the text
    the clients put together is the same."""
    said = ("a\u2028b", "c\x85d", "e\u2029f")
    scripted.engine.script = _says(*said, reason="length")
    body = {"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 3}
    with httpx2.stream("POST", f"{scripted.url}/v1/completions", json=body, timeout=30) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines), lines
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(said)
    streamed = _openai(scripted.url).completions.create(model=MODEL, prompt="x", stream=True)
    assert "".join(c.choices[0].text for c in streamed) == "".join(said)


def _says(*texts: str, reason: str = "eos"):
    """A script: these texts, a token each, then the finish ``reason``."""

    def script(request, seq):
        for text in texts:
            seq.events.put(TokenEvent([72], text))
        seq.events.put(_finish(request, len(texts), reason))

    return script


def test_n_choices_each_with_its_seed_and_usage_counting_the_prompt_once(scripted):
    completion = _openai(scripted.url).completions.create(model=MODEL, prompt="Hi", n=3, seed=7, max_tokens=4)
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert all(c.text == "Hello" and c.finish_reason == "length" for c in completion.choices)
    requests = [s.request for s in scripted.engine.submitted]
    assert [r.sampling.seed for r in requests] == [7, 8, 9]
    assert len({r.request_id for r in requests}) == 3 and len({r.prompt_ids for r in requests}) == 1
    assert completion.usage.prompt_tokens == 2 and completion.usage.completion_tokens == 6

    chunks = list(_openai(scripted.url).completions.create(model=MODEL, prompt="Hi", n=2, stream=True))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(c.text for c in mine) == "Hello" and mine[-1].finish_reason == "length"
    assert [s.request.sampling.seed for s in scripted.engine.submitted[3:]] == [None, None]


def test_every_choice_is_served_when_each_ends_on_its_first_token(scripted):
    """As on the gRPC API (tests/test_inference_service.py): a first token that stops a choice is its first event."""
    scripted.engine.script = lambda request, seq: seq.events.put(_finish(request, 1, "stop"))
    completion = _openai(scripted.url).completions.create(model=MODEL, prompt="Hi", n=4, max_tokens=8)
    assert [(c.index, c.finish_reason) for c in completion.choices] == [(i, "stop") for i in range(4)]
    chunks = list(_openai(scripted.url).completions.create(model=MODEL, prompt="Hi", n=4, stream=True))
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1, 2, 3]


def test_the_cache_salt_and_the_client_reach_the_engine_and_are_bounded(scripted):
    _openai(scripted.url).completions.create(model=MODEL, prompt="Hi", extra_body={"cache_salt": "tenant-a"})
    (seq,) = scripted.engine.submitted
    assert seq.request.cache_salt == "tenant-a" and seq.request.client == "127.0.0.1"
    response = _post(scripted.url, "/v1/completions", {"model": MODEL, "prompt": "x", "cache_salt": "s" * 257})
    _assert_error_shape(response, 400, "invalid_value", "cache_salt")


class FrozenStore:
    """A state store whose reads hang until ``thaw`` (Redis under SIGSTOP, until the client's socket timeout)."""

    def __init__(self):
        self.thawed = threading.Event()

    def profiles(self):
        self.thawed.wait(30)
        raise ConnectionError("redis at 127.0.0.1:1: timed out")

    policy_quality = profiles


def test_a_frozen_store_never_stalls_the_event_loop(byte_tokenizer):
    """A ``prefer`` request whose domain has no cached profile used to read the store on the event loop, under a
    lock every such request takes: with Redis frozen, every stream and /health/live waited for the socket
    timeout, and Kubernetes restarted the router. Now the request waits (boundedly, off the loop) for a read that
    a thread of its own makes, and is refused naming the domain; /health/live answers throughout."""
    from expertmesh.serving.request_routing import RequestRouter

    store = FrozenStore()
    classifier = SimpleNamespace(domains=("legal", "code"))
    routing = RequestRouter(2, 4, (1,), "exact", store, kl_bound=0.1, classifier=lambda: classifier)
    engine = ScriptedEngine()
    engine.grammars = Grammars(byte_tokenizer, VOCAB)
    config = ServingConfig(port=0, http_port=0, max_new_tokens_cap=CAP)
    adapter = OpenAIAdapter(engine, byte_tokenizer, ServedModel(MODEL, VOCAB, CONTEXT), config, routing)
    readiness = Readiness(FakeWatcher(None), engine, probe=FakeProbe(), cache_s=0)
    server = HttpServer(HttpApi(adapter, readiness, config).app, "127.0.0.1", 0, tls=TlsConfig()).start()
    answers: queue.Queue = queue.Queue()
    body = {"model": MODEL, "prompt": "x", "routing_policy": "prefer", "domain": "legal"}
    try:
        ask = lambda: answers.put(_post(server.url, "/v1/completions", body))  # noqa: E731
        for _ in range(4):
            threading.Thread(target=ask, daemon=True).start()
        for _ in range(10):
            started = time.monotonic()
            assert httpx2.get(f"{server.url}/health/live", timeout=30).status_code == 200
            assert time.monotonic() - started < 1.0, "the event loop waited on the frozen store"
            time.sleep(0.05)
        for _ in range(4):
            _assert_error_shape(answers.get(timeout=30), 400, "invalid_value", "domain")
    finally:
        store.thawed.set()
        server.stop()


def test_a_failing_choice_fails_the_request_and_cancels_the_others(scripted):
    calls = []

    def script(request, seq):
        calls.append(request)
        if len(calls) == 2:
            seq.events.put(ErrorEvent(Failure.INTERNAL, "the logits held NaN"))
        else:
            ScriptedEngine.endless(request, seq)

    scripted.engine.script = script
    response = _post(scripted.url, "/v1/completions", {"model": MODEL, "prompt": "x", "n": 3})
    _assert_error_shape(response, 500, "internal")
    assert all(s.cancelled.wait(5) for s in scripted.engine.submitted if s.request is not calls[1])


@pytest.fixture
def chat_template(scripted):
    tokenizer = scripted.adapter._tokenizer
    tokenizer.chat_template = CHAT_TEMPLATE
    yield scripted
    tokenizer.chat_template = None


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "choice,said,calls",
    [
        (
            {"type": "function", "function": {"name": "get_weather"}},
            ['{"city":', '"Oslo"}'],
            [("get_weather", {"city": "Oslo"})],
        ),
        ("required", ['[{"name":"get_weather","parameters":{"city":"Lima"}}]'], [("get_weather", {"city": "Lima"})]),
        (
            "auto",
            ["<tool_call>", '{"name": "get_weather", "arguments": {"city": "Rome"}}', "</tool_call>"],
            [("get_weather", {"city": "Rome"})],
        ),
        ("auto", ["It is", " sunny."], None),
    ],
    ids=["named", "required", "auto-call", "auto-text"],
)
def test_tool_calls_in_openais_shapes(chat_template, choice, said, calls, stream):
    """The answer's text (scripted: the grammar that shapes it is the engine's, tested with the model below) read
    back as tool calls, whole and streamed, through the official client."""
    chat_template.engine.script = _says(*said)
    client = _openai(chat_template.url)
    kwargs = dict(
        model=MODEL, messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER_TOOL], tool_choice=choice
    )
    request = None
    if not stream:
        answer = client.chat.completions.create(**kwargs)
        message, reason = answer.choices[0].message, answer.choices[0].finish_reason
        got_calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]
        ids = [c.id for c in message.tool_calls or ()]
        content = message.content
    else:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        deltas = [c.choices[0] for c in chunks if c.choices]
        content = "".join(d.delta.content or "" for d in deltas) or None
        tool_deltas = [t for d in deltas for t in d.delta.tool_calls or ()]
        got_calls = [(t.function.name, json.loads(t.function.arguments)) for t in tool_deltas]
        ids = [t.id for t in tool_deltas]
        reason = deltas[-1].finish_reason
    request = chat_template.engine.submitted[-1].request
    if calls is None:
        assert content == "It is sunny." and not got_calls and reason == "stop"
        assert request.grammar is None  # "auto" lets the model write what it likes
        return
    assert got_calls == calls and reason == "tool_calls" and not content
    assert all(i.startswith("call_") for i in ids)
    assert (request.grammar is None) == (choice == "auto")
    prompt = chat_template.adapter._tokenizer.decode(request.prompt_ids)
    assert prompt.startswith("<|user|>weather?")  # this template has no tools section: transformers leaves them out


def test_a_forced_call_cut_short_is_content_with_its_finish_reason(chat_template):
    chat_template.engine.script = _says('{"city": "Os', reason="length")
    answer = _openai(chat_template.url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], tools=[WEATHER_TOOL], tool_choice="required"
    )
    assert answer.choices[0].finish_reason == "length" and answer.choices[0].message.content == '{"city": "Os'
    assert answer.choices[0].message.tool_calls is None


def test_a_tool_conversation_is_accepted(chat_template):
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    answer = _openai(chat_template.url).chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
    assert answer.choices[0].message.content == "Hello"
    prompt = chat_template.adapter._tokenizer.decode(chat_template.engine.submitted[-1].request.prompt_ids)
    assert "<|tool|>sunny" in prompt


def test_response_format_and_a_forced_call_do_not_combine(chat_template):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
        "response_format": {"type": "json_object"},
    }
    _assert_error_shape(_post(chat_template.url, "/v1/chat/completions", body), 400, "invalid_value", "response_format")


@pytest.mark.parametrize(
    "failure,status,code",
    [
        (Overloaded("the server is at its limits"), 429, "resource_exhausted"),
        (ShuttingDown("the server is draining"), 503, "unavailable"),
        (ErrorEvent(Failure.DEADLINE_EXCEEDED, "the request's deadline passed"), 504, "deadline_exceeded"),
        (ErrorEvent(Failure.UNAVAILABLE, "expert group g1 failed"), 503, "unavailable"),
        (ErrorEvent(Failure.INTERNAL, "the logits held NaN"), 500, "internal"),
        (ErrorEvent(Failure.INVALID_ARGUMENT, "bad"), 400, "invalid_argument"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_engine_errors_keep_their_http_status(scripted, failure, status, code, stream):
    """At submit or as the first event: streamed or not, the status is the error's (nothing was sent yet)."""
    if isinstance(failure, ErrorEvent):
        scripted.engine.script = lambda request, seq: seq.events.put(failure)
    else:
        scripted.engine.refuse = failure
    response = _post(scripted.url, "/v1/completions", {"model": MODEL, "prompt": "x", "stream": stream})
    error = _assert_error_shape(response, status, code)
    assert error["message"] == str(failure) if not isinstance(failure, ErrorEvent) else failure.message


def test_openai_client_raises_the_matching_exceptions(scripted):
    client = _openai(scripted.url)
    scripted.engine.refuse = Overloaded("full")
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt="x")
    scripted.engine.refuse = ShuttingDown("draining")
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model=MODEL, prompt="x", stream=True)
    assert err.value.status_code == 503 and err.value.body["code"] == "unavailable"


def test_an_error_after_the_first_token_is_an_error_event(scripted):
    def script(request, seq):
        seq.events.put(TokenEvent([72], "He"))
        seq.events.put(ErrorEvent(Failure.UNAVAILABLE, "expert group g1 failed"))

    scripted.engine.script = script
    data = _sse_data(_post(scripted.url, "/v1/completions", {"model": MODEL, "prompt": "x", "stream": True}))
    assert json.loads(data[0])["choices"][0]["text"] == "He"
    assert json.loads(data[1])["error"]["code"] == "unavailable" and data[2] == "[DONE]"
    stream = _openai(scripted.url).completions.create(model=MODEL, prompt="x", stream=True)
    with pytest.raises(openai.APIError, match="expert group g1 failed"):
        list(stream)


def _long(n):
    return "".join(chr(97 + i % 26) for i in range(n))


COMPLETION_ERRORS = [
    ({"n": 0}, "n", "invalid_value"),
    ({"n": 17}, "n", "invalid_value"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "invalid_value"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "frob"}}}},
        "response_format.json_schema.schema",
        "invalid_value",
    ),
    ({"best_of": 3}, "best_of", "unsupported_parameter"),
    ({"suffix": "end"}, "suffix", "unsupported_parameter"),
    ({"logprobs": 21}, "logprobs", "invalid_value"),
    ({"frequency_penalty": 2.5}, "frequency_penalty", "invalid_value"),
    ({"presence_penalty": -3}, "presence_penalty", "invalid_value"),
    ({"logit_bias": {"five": 10}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {str(VOCAB): 1}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "invalid_value"),
    ({"repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
    ({"min_tokens": -1}, "min_tokens", "invalid_value"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens", "invalid_value"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "invalid_value"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids", "invalid_value"),
    ({"stop_token_ids": [1] * 65}, "stop_token_ids", "invalid_value"),
    ({"temperature": "hot"}, "temperature", "invalid_type"),
    ({"temperature": 2.5}, "temperature", "invalid_value"),
    ({"temperature": 0.001}, "temperature", "invalid_value"),
    ({"top_p": 0}, "top_p", "invalid_value"),
    ({"top_k": -1}, "top_k", "invalid_value"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"max_tokens": CAP + 1}, "max_tokens", "invalid_value"),
    ({"max_tokens": 1.5}, "max_tokens", "invalid_type"),
    ({"seed": 2**64}, "seed", "invalid_value"),
    ({"stream": "yes"}, "stream", "invalid_type"),
    ({"stop": [""]}, "stop", "invalid_value"),
    ({"stop": ["x"] * 17}, "stop", "invalid_value"),
    ({"stop": 5}, "stop", "invalid_type"),
    ({"prompt": ["one", "two"]}, "prompt", "unsupported_value"),
    ({"prompt": {"text": "x"}}, "prompt", "invalid_type"),
    ({"prompt": [1, -2]}, "prompt", "invalid_value"),
    ({"prompt": ""}, "prompt", "invalid_value"),
    ({"prompt": []}, "prompt", "invalid_value"),
    ({"prompt": [VOCAB]}, "prompt", "invalid_value"),
    ({"prompt": _long(CONTEXT)}, "prompt", "context_length_exceeded"),
    ({"model": 5}, "model", "invalid_type"),
]

_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

CHAT_ERRORS = [
    ({"messages": []}, "messages", "invalid_value"),
    ({"messages": [{"role": "robot", "content": "42"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id", "missing_required_parameter"),
    (
        {"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
        "messages[0].tool_call_id",
        "invalid_value",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content",
        "unsupported_value",
    ),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name", "invalid_value"),
    ({"tools": [_TOOL] * 129}, "tools", "invalid_value"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),  # no tools to choose from
    (
        {"tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        "tool_choice",
        "invalid_value",
    ),
    ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
    ({"top_logprobs": 2}, "top_logprobs", "invalid_value"),  # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ({"max_completion_tokens": CAP + 1}, "max_completion_tokens", "invalid_value"),
    ({}, "messages", "chat_template_missing"),  # a valid request: this tokenizer has no chat template
]


@pytest.mark.parametrize("fields,param,code", COMPLETION_ERRORS, ids=[p + ":" + c for _, p, c in COMPLETION_ERRORS])
def test_bad_completion_requests_are_400_naming_the_field(scripted, fields, param, code):
    response = _post(scripted.url, "/v1/completions", {"model": MODEL, "prompt": "x", **fields})
    _assert_error_shape(response, 400, code, param)
    assert scripted.engine.submitted == [], "a bad request never reaches the engine"


@pytest.mark.parametrize("fields,param,code", CHAT_ERRORS, ids=[p + ":" + c for _, p, c in CHAT_ERRORS])
def test_bad_chat_requests_are_400_naming_the_field(scripted, fields, param, code):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    _assert_error_shape(_post(scripted.url, "/v1/chat/completions", body), 400, code, param)
    assert scripted.engine.submitted == []


def test_missing_fields_unknown_model_and_unknown_fields(scripted):
    _assert_error_shape(
        _post(scripted.url, "/v1/completions", {"prompt": "x"}), 400, "missing_required_parameter", "model"
    )
    _assert_error_shape(
        _post(scripted.url, "/v1/completions", {"model": MODEL}), 400, "missing_required_parameter", "prompt"
    )
    error = _assert_error_shape(
        _post(scripted.url, "/v1/completions", {"model": "gpt-4", "prompt": "x"}), 404, "model_not_found", "model"
    )
    assert MODEL in error["message"]
    # Fields OpenAI does not define, or defines as harmless, are ignored as OpenAI ignores them.
    body = {
        "model": MODEL,
        "prompt": "x",
        "user": "u1",
        "metadata": {"a": "b"},
        "vendor_extra": [1, 2],
        "n": 1,
        "best_of": 1,
    }
    assert _post(scripted.url, "/v1/completions", body).status_code == 200


@pytest.mark.parametrize("raw", [b"{bad json", b"", b"\xff\xfe"])
def test_bad_json_is_400(scripted, raw):
    response = httpx2.post(f"{scripted.url}/v1/completions", content=raw, headers={"content-type": "application/json"})
    _assert_error_shape(response, 400, "invalid_json")


def test_a_json_body_that_is_not_an_object_is_400(scripted):
    _assert_error_shape(_post(scripted.url, "/v1/chat/completions", [1, 2]), 400, "invalid_type")


def test_a_huge_body_is_413(scripted):
    big = {"model": MODEL, "prompt": "x" * BODY_LIMIT}
    _assert_error_shape(_post(scripted.url, "/v1/completions", big), 413, "request_too_large")

    def chunks():  # no Content-Length: the limit holds while the body streams in
        for _ in range(BODY_LIMIT // 1024 + 2):
            yield b" " * 1024

    response = httpx2.post(f"{scripted.url}/v1/completions", content=chunks(), timeout=30)
    _assert_error_shape(response, 413, "request_too_large")
    assert scripted.engine.submitted == []


def test_unknown_routes_and_methods_answer_in_openai_shape(scripted):
    _assert_error_shape(httpx2.get(f"{scripted.url}/v1/engines"), 404, "unknown_url")
    response = httpx2.get(f"{scripted.url}/v1/completions")
    _assert_error_shape(response, 405, "method_not_allowed")
    assert "POST" in response.headers["allow"]


def test_models(scripted):
    client = _openai(scripted.url)
    (model,) = client.models.list().data
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "expertmesh") and model.created > 0
    assert model.max_model_len == CONTEXT  # vLLM's extension, which lm-eval and guidellm read
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_tokenize_and_detokenize_in_vllms_shapes(scripted):
    """vLLM's /tokenize and /detokenize, which lm-eval and guidellm probe: the ids /v1/completions feeds."""
    tokenized = _post(scripted.url, "/tokenize", {"model": MODEL, "prompt": "Hi!", "return_token_strs": True})
    assert tokenized.status_code == 200, tokenized.text
    body = tokenized.json()
    ids = scripted.adapter.completion_prompt(Prompt(text="Hi!"))
    assert body == {
        "count": len(ids),
        "max_model_len": CONTEXT,
        "tokens": ids,
        "token_strs": scripted.adapter._tokenizer.convert_ids_to_tokens(ids),
    }
    assert _post(scripted.url, "/tokenize", {"prompt": "Hi!"}).json()["token_strs"] is None  # model optional
    back = _post(scripted.url, "/detokenize", {"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "Hi!"}
    for path, request, status, param, code in (
        ("/detokenize", {"tokens": [VOCAB + 5]}, 400, "tokens", "invalid_value"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]", "invalid_value"),
        ("/detokenize", {"tokens": "12"}, 400, "tokens", "invalid_type"),
        ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
        ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}, 400, "messages", "chat_template_missing"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens", "invalid_type"),
    ):
        _assert_error_shape(_post(scripted.url, path, request), status, code, param)
    assert _post(scripted.url, "/tokenize", {"prompt": "x", "temperature": 1}).status_code == 200  # as vLLM: ignored


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_hangs_up_cancels_its_sequence(scripted, stream):
    scripted.engine.script = ScriptedEngine.endless
    body = {"model": MODEL, "prompt": "x", "stream": stream}
    if stream:
        with httpx2.stream("POST", f"{scripted.url}/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            assert next(response.iter_lines()).startswith("data: ")
    else:
        with pytest.raises(httpx2.ReadTimeout):
            httpx2.post(f"{scripted.url}/v1/completions", json=body, timeout=0.5)
    (seq,) = scripted.engine.submitted
    assert seq.cancelled.wait(10), "the engine sequence outlived its client"


def test_health_reflects_store_groups_and_draining(scripted):
    def health():
        response = httpx2.get(f"{scripted.url}/health")
        return response.status_code, response.json()

    status, body = health()
    assert status == 200 and body["status"] == "ready" and body["reasons"] == [] and body["degraded"] == []
    assert body["groups"] == {"g0": "serving", "g1": "serving"} and body["routing_table_version"] == 7
    assert body["kv_blocks_used"] is None and body["kv_blocks_total"] is None
    # g1 down: every expert still has a serving replica in g0.
    scripted.probe.states_now["g1"] = "unreachable"
    status, body = health()
    assert status == 200 and body["degraded"] == ["expert group g1 is unreachable"]
    # g0 down: expert 0 of layer 1 has no other replica.
    scripted.probe.states_now.update(g0="not_serving", g1="serving")
    status, body = health()
    assert status == 503 and body["status"] == "not_ready" and "expert group g0 is not serving" in body["reasons"][0]
    scripted.probe.states_now["g0"] = "serving"
    # The store not answering: the router serves its last good table, so it stays ready (a Redis outage must not
    # take every router out of its Service), and says it is degraded.
    scripted.watcher.store_problem = "redis at 127.0.0.1:1 refused the connection"
    status, body = health()
    assert status == 200 and body["status"] == "ready" and body["reasons"] == []
    assert body["degraded"] == [
        "the state store is unreachable: redis at 127.0.0.1:1 refused the connection; serving on routing table "
        "version 7"
    ]
    assert [o.value for o in scripted.readiness._degraded_gauge(None)] == [1]  # expertmesh_router_degraded
    view, scripted.watcher.view = scripted.watcher.view, None  # ... but without a table to serve on, not ready
    try:
        status, body = health()
        assert status == 503 and "state store is unreachable" in body["reasons"][0]
    finally:
        scripted.watcher.view = view
    scripted.watcher.store_problem = None
    health()
    assert [o.value for o in scripted.readiness._degraded_gauge(None)] == [0]
    scripted.readiness.draining = True
    try:
        status, body = health()
        assert status == 503 and body["status"] == "draining"
    finally:
        scripted.readiness.draining = False
    assert health()[0] == 200
    # g1 listed for expert 1 but no longer holding it (unloaded in a move the table does not know of): its
    # tokens would fail NOT_FOUND, though every group is serving
    scripted.probe.held = {"g0": frozenset({(1, 0), (1, 1)}), "g1": frozenset()}
    try:
        status, body = health()
        assert status == 503 and body["reasons"] == [
            "expert group g1 does not hold 1 of the experts the routing table lists on it (layer/expert 1/1): "
            "their tokens fail NOT_FOUND"
        ]
    finally:
        scripted.probe.held = {}
    assert health()[0] == 200
    live = httpx2.get(f"{scripted.url}/health/live")
    assert live.status_code == 200 and live.json() == {"status": "alive"}


def test_metrics_speak_prometheus_text(scripted):
    response = httpx2.get(f"{scripted.url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain; version=")


def test_a_taken_port_fails_at_start(layer):
    port = int(layer.url.rpartition(":")[2])
    with pytest.raises(OSError, match=f"cannot bind the HTTP API to 127.0.0.1:{port}"):
        HttpServer(layer.app, "127.0.0.1", port, tls=TlsConfig())


def _issue(cn: str, issuer=None, *, ca: bool = False):
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    signer_key, signer = issuer or (key, None)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(signer.subject if signer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
    return key, builder.sign(signer_key, hashes.SHA256())


def _write(path, key, cert):
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return path.with_suffix(".crt"), path.with_suffix(".key")


def test_https_with_the_grpc_servers_certificate(layer, tmp_path):
    """EXPERTMESH_TLS_* makes the HTTP API HTTPS, as it makes the gRPC API TLS; require_client_cert demands one."""
    ca = _issue("test CA", ca=True)
    ca_file, _ = _write(tmp_path / "ca", *ca)
    cert, key = _write(tmp_path / "server", *_issue("localhost", ca))
    client_cert = _write(tmp_path / "client", *_issue("client", ca))
    for require in (False, True):
        tls = TlsConfig(cert_file=cert, key_file=key, ca_file=ca_file, require_client_cert=require)
        server = HttpServer(layer.app, "127.0.0.1", 0, tls=tls).start()
        url = f"https://localhost:{server.port}/health/live"
        try:
            assert server.url.startswith("https://")
            trusting = ssl.create_default_context(cafile=str(ca_file))
            if require:
                with pytest.raises(httpx2.HTTPError):
                    httpx2.get(url, verify=trusting)
                trusting.load_cert_chain(*map(str, client_cert))
            assert httpx2.get(url, verify=trusting).status_code == 200
            with pytest.raises(httpx2.HTTPError):
                httpx2.get(url.replace("https", "http"))
        finally:
            server.stop()


# -- the real thing: `expertmesh up --http-port 0` and the openai client -----------------------------

REAL_CONTEXT = 512


@pytest.fixture(scope="module")
def served(tmp_path_factory, shared_ray_address):
    """`expertmesh up --http-port 0` over a tiny Mixtral whose tokenizer carries a chat template."""
    path = make_tiny_checkpoint(
        "mixtral",
        tmp_path_factory.mktemp("chat-ckpt"),
        with_tokenizer=True,
        vocab_size=VOCAB,
        max_position_embeddings=REAL_CONTEXT,
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    with serving_http(path, shared_ray_address, tokenizer) as served:
        yield served


def _grpc(served, prompt, **kwargs):
    """(text, last chunk) of the gRPC API for the same request."""
    with Client(served.up.target, timeout=120) as client:
        chunks = list(client.generate(prompt, **kwargs))
    return "".join(c.text for c in chunks), chunks[-1]


_REASON = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


@pytest.mark.slow
@pytest.mark.parametrize("prompt", ["Hello", [5, 17, 99, 3, 250, 42]], ids=["text", "token_ids"])
def test_greedy_completions_equal_the_grpc_apis(served, prompt):
    text, done = _grpc(served, prompt, max_new_tokens=16)
    client = _openai(served.url)
    whole = client.completions.create(model=served.model, prompt=prompt, max_tokens=16, temperature=0)
    assert whole.choices[0].text == text
    assert whole.choices[0].finish_reason == _REASON[done.finish_reason]
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (done.prompt_tokens, done.completion_tokens)
    stream = client.completions.create(
        model=served.model,
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == _REASON[done.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == done.completion_tokens


@pytest.mark.slow
def test_logits_controls_equal_the_grpc_apis(served):
    """OpenAI's logit_bias and penalties, and vLLM's extras, through the official client: the gRPC API's
    tokens for the same controls (which tests/test_serving.py holds to transformers' processors)."""
    prompt = [5, 17, 99, 3, 250, 42]
    text, done = _grpc(
        served,
        prompt,
        max_new_tokens=12,
        stop_at_eos=False,
        logit_bias={17: 3.0, 99: -5.0},
        frequency_penalty=0.8,
        presence_penalty=0.4,
        repetition_penalty=1.2,
        min_tokens=6,
    )
    client = _openai(served.url)
    whole = client.completions.create(
        model=served.model,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        logit_bias={"17": 3.0, "99": -5.0},
        frequency_penalty=0.8,
        presence_penalty=0.4,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.2, "min_tokens": 6},
    )
    assert whole.choices[0].text == text and whole.usage.completion_tokens == done.completion_tokens == 12
    plain, _ = _grpc(served, prompt, max_new_tokens=12, stop_at_eos=False)
    assert text != plain, "the controls changed the completion"
    a = served.tokenizer.convert_tokens_to_ids("A")
    forced = client.completions.create(
        model=served.model, prompt=prompt, max_tokens=5, temperature=0, logit_bias={str(a): 100}
    )
    assert forced.choices[0].text == "A" * 5  # +100 outweighs any logit of the random model


@pytest.mark.slow
def test_logprobs_equal_the_grpc_apis_and_stock_transformers(served):
    """Completions (``logprobs``: N) and chat (``logprobs``, ``top_logprobs``), whole and streamed, through the
    official client: the gRPC API's log-probabilities, which are stock transformers' log-softmax."""
    prompt = [5, 17, 99, 3, 250, 42]
    with Client(served.up.target, timeout=120) as grpc_client:
        chunks = list(grpc_client.generate(prompt, max_new_tokens=6, stop_at_eos=False, logprobs=3))
    tokens = [t for c in chunks for t in c.token_ids]
    entries = [e for c in chunks for e in c.logprobs]
    assert [e.token_id for e in entries] == tokens and all(len(e.top) == 3 for e in entries)
    stock = AutoModelForCausalLM.from_pretrained(served.path, experts_implementation="eager").eval()
    with torch.no_grad():
        expected = stock(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    for i, e in enumerate(entries):
        assert abs(e.logprob - float(expected[i, e.token_id])) < 1e-4
        assert [t.token_id for t in e.top] == expected[i].topk(3).indices.tolist()
        assert tokens[i] == e.top[0].token_id  # greedy: the chosen token is the most likely one
    client = _openai(served.url)
    whole = client.completions.create(
        model=served.model, prompt=prompt, max_tokens=6, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = whole.choices[0].logprobs
    assert lp.tokens == [served.tokenizer.decode([t]) for t in tokens]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in entries], abs=1e-6)
    assert [list(top.values()) for top in lp.top_logprobs] == [
        pytest.approx([t.logprob for t in e.top], abs=1e-6) for e in entries
    ]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(tokens))]
    streamed = client.completions.create(
        model=served.model,
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        logprobs=3,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    pieces = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for p in pieces for t in p.token_logprobs] == lp.token_logprobs
    assert [o for p in pieces for o in p.text_offset] == lp.text_offset
    chat = client.chat.completions.create(
        model=served.model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.bytes == list(c.token.encode()) and c.logprob <= 0 for c in content)
    plain = client.completions.create(model=served.model, prompt=prompt, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


@pytest.mark.slow
def test_echo_returns_the_prompt_with_its_logprobs_as_the_score_api_gives_them(served):
    """lm-eval's loglikelihood request (``echo``, ``logprobs``, one new token): the prompt's tokens carry the
    gRPC Score API's log-probabilities (the first none), then the completion's own."""
    prompt = [5, 17, 99, 3, 250, 42]
    client = _openai(served.url)
    with Client(served.up.target, timeout=120) as grpc_client:
        scores = list(grpc_client.score(prompt).token_scores)
    plain = client.completions.create(model=served.model, prompt=prompt, max_tokens=3, temperature=0, logprobs=1)
    echoed = client.completions.create(
        model=served.model, prompt=prompt, max_tokens=3, temperature=0, logprobs=1, echo=True
    )
    choice, generated = echoed.choices[0], plain.choices[0]
    assert choice.text == served.tokenizer.decode(prompt) + generated.text
    lp = choice.logprobs
    assert lp.tokens[: len(prompt)] == [served.tokenizer.decode([t]) for t in prompt]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1 : len(prompt)] == pytest.approx(scores[1:], abs=1e-5)
    assert lp.token_logprobs[len(prompt) :] == pytest.approx(generated.logprobs.token_logprobs, abs=1e-6)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    text = client.completions.create(model=served.model, prompt="Hello", max_tokens=2, temperature=0, echo=True)
    assert text.choices[0].text.startswith("Hello") and text.choices[0].logprobs is None
    stream = client.completions.create(
        model=served.model, prompt="Hello", max_tokens=2, temperature=0, echo=True, stream=True
    )
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert pieces[0] == "Hello" and "".join(pieces) == text.choices[0].text


BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["city", "days", "tags"],
    "additionalProperties": False,
}


@pytest.mark.slow
def test_structured_output_validates_on_the_model_and_equals_the_grpc_apis(served):
    """Random weights, so only the mask makes the answer JSON: every seed's answer validates against the
    schema, over HTTP (completions, chat, streamed) and gRPC alike."""
    client = _openai(served.url)
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": BOUNDED_SCHEMA, "strict": True}}
    for seed in range(3):
        common = dict(model=served.model, max_tokens=96, temperature=1.0, seed=seed)
        answer = client.completions.create(prompt="Plan a trip:", extra_body={"response_format": fmt}, **common)
        assert answer.choices[0].finish_reason == "stop", answer.choices[0].text
        jsonschema.validate(json.loads(answer.choices[0].text), BOUNDED_SCHEMA)
        text, done = _grpc(
            served, "Plan a trip:", max_new_tokens=96, temperature=1.0, seed=seed, json_schema=BOUNDED_SCHEMA
        )
        assert text == answer.choices[0].text and done.finish_reason == "stop"
        chat = client.chat.completions.create(
            messages=[{"role": "user", "content": "Plan a trip"}], response_format=fmt, **common
        )
        jsonschema.validate(json.loads(chat.choices[0].message.content), BOUNDED_SCHEMA)
        streamed = client.chat.completions.create(
            messages=[{"role": "user", "content": "Plan a trip"}], stream=True, response_format=fmt, **common
        )
        assert (
            "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat.choices[0].message.content
        )
    anything = client.completions.create(
        model=served.model,
        prompt="x",
        max_tokens=48,
        seed=1,
        temperature=1.0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    text = anything.choices[0].text
    assert text.startswith("{") and (
        anything.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict)
    )
    with Client(served.up.target, timeout=60) as grpc_client, pytest.raises(grpc.RpcError) as err:
        list(grpc_client.generate("x", json_schema={"type": "frob"}))
    assert (
        err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "structured_output.json_schema" in err.value.details()
    )


@pytest.mark.slow
def test_forced_tool_calls_on_the_model_follow_the_tools_schemas(served):
    client = _openai(served.url)
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": BOUNDED_SCHEMA}},
        {
            "type": "function",
            "function": {
                "name": "ping",
                "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
            },
        },
    ]
    messages = [{"role": "user", "content": "weather?"}]
    named = client.chat.completions.create(
        model=served.model,
        messages=messages,
        tools=tools,
        max_tokens=96,
        seed=3,
        temperature=1.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and named.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), BOUNDED_SCHEMA)
    for seed in range(3):
        required = client.chat.completions.create(
            model=served.model,
            messages=messages,
            tools=tools,
            max_tokens=200,
            seed=seed,
            temperature=1.0,
            tool_choice="required",
            parallel_tool_calls=False,
        )
        choice = required.choices[0]
        if choice.finish_reason == "length":  # a random model may pick a long enum path; cut short is content
            assert choice.message.tool_calls is None
            continue
        (call,) = choice.message.tool_calls
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.slow
def test_n_choices_share_the_prompts_kv_blocks_and_equal_single_requests(served):
    """Greedy choices are the single request's answer, each of them; seeded ones are single requests with seed
    + i. The later choices find the first's prompt blocks in the prefix cache."""
    client = _openai(served.url)
    prompt = "A long prompt that fills more than one KV block of sixteen tokens, twice over at least: " * 2

    def hits():  # the operator's aggregate counter (ListModels reports none: clients must not probe the cache)
        metrics = httpx2.get(f"{served.url}/metrics", timeout=30).text
        (line,) = [line for line in metrics.splitlines() if line.startswith("expertmesh_kv_prefix_cache_hits_total")]
        return float(line.rsplit(" ", 1)[1])

    one = client.completions.create(model=served.model, prompt=prompt + "0", max_tokens=8, temperature=0)
    before = hits()
    three = client.completions.create(model=served.model, prompt=prompt + "1", max_tokens=8, temperature=0, n=3)
    assert hits() - before >= 2 * 16, "choices 1 and 2 found the first's full blocks"
    single = client.completions.create(model=served.model, prompt=prompt + "1", max_tokens=8, temperature=0)
    assert [c.text for c in three.choices] == [single.choices[0].text] * 3
    assert three.usage.prompt_tokens == single.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * single.usage.completion_tokens
    del one
    seeded = client.completions.create(model=served.model, prompt="Hi", max_tokens=8, temperature=1.0, seed=40, n=3)
    for i, choice in enumerate(seeded.choices):
        alone = client.completions.create(model=served.model, prompt="Hi", max_tokens=8, temperature=1.0, seed=40 + i)
        assert choice.text == alone.choices[0].text
    # The gRPC API's choices: every chunk names its choice, each choice ends with its own finish.
    with Client(served.up.target, timeout=120) as grpc_client:
        chunks = list(grpc_client.generate("Hi", max_new_tokens=8, temperature=1.0, seed=40, n=3))
        with pytest.raises(grpc.RpcError) as err:
            list(grpc_client.generate("Hi", n=17))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n takes 1 to 16" in err.value.details()
    for i, choice in enumerate(seeded.choices):
        mine = [c for c in chunks if c.index == i]
        assert "".join(c.text for c in mine) == choice.text
        assert [c for c in mine if c.finish_reason] == [mine[-1]], "one finish per choice, its last chunk"


@pytest.mark.slow
def test_a_new_token_that_is_eos_keeps_its_logprob(served):
    """lm-eval's loglikelihood request (``echo``, ``logprobs``, ``max_tokens`` 1) reads the continuation as
    every entry but the last, the new token's: when that token is EOS it must be listed too, as OpenAI and
    vLLM list it (one entry per completion token), else the continuation's last token is dropped. Whole and
    streamed, completions and chat; EOS forced with ``logit_bias``, its log-probability the model's."""
    prompt = [5, 17, 99, 3, 250, 42]
    eos = served.tokenizer.eos_token_id
    with Client(served.up.target, timeout=120) as grpc_client:
        scores = list(grpc_client.score([*prompt, eos]).token_scores)
    client = _openai(served.url)
    forced = dict(model=served.model, max_tokens=1, temperature=0, logit_bias={str(eos): 100})
    echoed = client.completions.create(prompt=prompt, echo=True, logprobs=1, **forced)
    choice, lp = echoed.choices[0], echoed.choices[0].logprobs
    assert choice.finish_reason == "stop" and echoed.usage.completion_tokens == 1
    assert len(lp.token_logprobs) == len(prompt) + 1 and lp.tokens[-1] == served.tokenizer.eos_token
    assert lp.token_logprobs[1:] == pytest.approx(scores[1:], abs=1e-5)
    streamed = client.completions.create(prompt=prompt, logprobs=1, stream=True, **forced)
    pieces = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for p in pieces for t in p.token_logprobs] == pytest.approx(lp.token_logprobs[-1:], abs=1e-6)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], logprobs=True, **forced)
    content = chat.choices[0].logprobs.content
    assert chat.usage.completion_tokens == len(content) == 1 and content[0].token == served.tokenizer.eos_token


@pytest.mark.slow
def test_stop_ignore_eos_and_seeded_sampling_equal_the_grpc_apis(served):
    client = _openai(served.url)
    text, done = _grpc(served, "Hello", max_new_tokens=40, stop_at_eos=False)
    whole = client.completions.create(
        model=served.model, prompt="Hello", max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    assert whole.choices[0].text == text and whole.usage.completion_tokens == done.completion_tokens == 40
    stop = text.strip()[2:4]
    if stop:  # the random model's text decides what can be a stop sequence
        stopped, done = _grpc(served, "Hello", max_new_tokens=40, stop_at_eos=False, stop=[stop])
        whole = client.completions.create(
            model=served.model,
            prompt="Hello",
            max_tokens=40,
            temperature=0,
            stop=[stop],
            extra_body={"ignore_eos": True},
        )
        assert (
            whole.choices[0].text == stopped and whole.choices[0].finish_reason == "stop" == _REASON[done.finish_reason]
        )
    # 0.5 is exact in float32, so both APIs divide the logits by the same number.
    sampled, _ = _grpc(served, [9, 8, 7], max_new_tokens=12, temperature=0.5, seed=1234, top_k=50)
    for _ in range(2):
        whole = client.completions.create(
            model=served.model, prompt=[9, 8, 7], max_tokens=12, temperature=0.5, seed=1234, extra_body={"top_k": 50}
        )
        assert whole.choices[0].text == sampled


@pytest.mark.slow
def test_tokenize_chat_uses_the_checkpoints_template(served):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    ids = served.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    body = httpx2.post(f"{served.url}/tokenize", json={"model": served.model, "messages": messages}, timeout=30).json()
    assert body["tokens"] == list(ids) and body["count"] == len(ids) and body["max_model_len"] == REAL_CONTEXT
    bare = httpx2.post(
        f"{served.url}/tokenize", json={"messages": messages, "add_generation_prompt": False}, timeout=30
    ).json()
    assert bare["tokens"] == list(
        served.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    )
    text = httpx2.post(f"{served.url}/detokenize", json={"tokens": body["tokens"]}, timeout=30).json()["prompt"]
    assert text == served.tokenizer.decode(ids)


def test_chat_applies_the_checkpoints_template(served):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    ids = served.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    assert len(ids) > len("Be brief.Hi there!"), "the template adds its role markers"
    text, done = _grpc(served, list(ids), max_new_tokens=16)
    client = _openai(served.url)
    chat = client.chat.completions.create(model=served.model, messages=messages, max_tokens=16, temperature=0)
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    assert chat.usage.prompt_tokens == len(ids)
    (choice,) = chat.choices
    assert (choice.message.role, choice.message.content) == ("assistant", text)
    assert choice.finish_reason == _REASON[done.finish_reason]
    stream = client.chat.completions.create(
        model=served.model,
        messages=messages,
        max_completion_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.prompt_tokens == len(ids)


@pytest.mark.slow
def test_bad_requests_through_the_openai_client(served):
    client = _openai(served.url)
    cases = [
        ({"n": 17}, openai.BadRequestError, "n"),
        ({"logprobs": 30}, openai.BadRequestError, "logprobs"),
        ({"best_of": 2}, openai.BadRequestError, "best_of"),
        ({"suffix": "!"}, openai.BadRequestError, "suffix"),
        ({"temperature": -1}, openai.BadRequestError, "temperature"),
        ({"max_tokens": ServingConfig().max_new_tokens_cap + 1}, openai.BadRequestError, "max_tokens"),
        ({"prompt": "x" * REAL_CONTEXT}, openai.BadRequestError, "prompt"),
        ({"model": "gpt-4o"}, openai.NotFoundError, "model"),
    ]
    for fields, exc, param in cases:
        with pytest.raises(exc) as err:
            client.completions.create(**{"model": served.model, "prompt": "x", **fields})
        assert err.value.body["param"] == param, fields
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=served.model,
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
            tool_choice="required",
        )
    assert err.value.body["param"] == "tools" and "frob" in err.value.body["message"]
    raw = httpx2.post(f"{served.url}/v1/completions", content=b'{"model": ', timeout=30)
    _assert_error_shape(raw, 400, "invalid_json")
    huge = httpx2.post(
        f"{served.url}/v1/completions", content=b" " * (ServingConfig().http_max_body_bytes + 1), timeout=30
    )
    _assert_error_shape(huge, 413, "request_too_large")


@pytest.mark.slow
def test_health_and_metrics_on_the_same_port(served):
    health = httpx2.get(f"{served.url}/health", timeout=30)
    assert health.status_code == 200, health.text
    body = health.json()
    assert body["status"] == "ready" and body["groups"] == {"g0": "serving", "g1": "serving"}
    assert body["routing_table_version"] >= 1
    assert 0 <= body["kv_blocks_used"] <= body["kv_blocks_total"] and body["kv_blocks_total"] > 0
    _openai(served.url).completions.create(model=served.model, prompt="x", max_tokens=2)
    metrics = httpx2.get(f"{served.url}/metrics", timeout=30).text
    assert re.search(r'expertmesh_http_responses_total\{[^}]*route="/v1/completions"[^}]*status="200"', metrics), (
        metrics[-3000:]
    )
    assert "expertmesh_expert_tokens" in metrics  # the router's own meters, on the same port


def _first_chunk(lines) -> dict:
    return json.loads(next(line for line in lines if line.startswith("data: "))[len("data: ") :])


@pytest.mark.slow
def test_a_client_gone_mid_stream_frees_its_slot(served):
    body = {"model": served.model, "prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx2.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60) as response:
        first = _first_chunk(response.iter_lines())
    served.up.wait_for_stderr(rf"request {first['id']} cancelled: the client went away")
    for _ in range(600):  # its slot frees at the next step boundary
        if httpx2.get(f"{served.url}/health", timeout=30).json()["active_sequences"] == 0:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the cancelled sequence still holds its slot")


@pytest.mark.slow
def test_sigterm_lets_http_streams_finish_and_refuses_new_requests(served):
    """Last: it stops the server. In-flight streams finish; new requests and /health answer 503."""
    up = served.up
    body = {"model": served.model, "prompt": "x", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx2.stream("POST", f"{served.url}/v1/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        _first_chunk(lines)
        up.proc.send_signal(signal.SIGTERM)
        for _ in range(600):
            health = httpx2.get(f"{served.url}/health", timeout=30)
            if health.status_code == 503:
                break
            time.sleep(0.05)
        assert health.json()["status"] == "draining"
        with pytest.raises(openai.InternalServerError) as err:
            _openai(served.url).completions.create(model=served.model, prompt="x", max_tokens=2)
        assert err.value.status_code == 503
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: ") :])["choices"][0]["finish_reason"] == "length"
    assert up.proc.wait(timeout=90) == 0
    up.wait_for_stderr("drained")


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_span_joins_the_callers_trace_and_the_engine_runs_under_it(scripted, monkeypatch, stream):
    """W3C traceparent in, one SERVER span per request (an SDK tracer provider local to this test),
    and the engine's submit sees that span as current, so its step spans join the same trace."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from expertmesh.serving import http_api

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(http_api, "tracer", lambda: provider.get_tracer("test"))
    seen = []

    def hello_seeing_the_span(request, seq):
        seen.append(trace.get_current_span().get_span_context())
        ScriptedEngine.hello(request, seq)

    scripted.engine.script = hello_seeing_the_span
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    response = httpx2.post(
        f"{scripted.url}/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "stream": stream},
        headers={"traceparent": f"00-{trace_id}-{parent}-01"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "expertmesh.http.generate"]
    assert format(span.context.trace_id, "032x") == trace_id and format(span.parent.span_id, "016x") == parent
    assert span.kind == trace.SpanKind.SERVER and span.attributes["expertmesh.request_id"].startswith("cmpl-")
    assert seen == [span.context]
