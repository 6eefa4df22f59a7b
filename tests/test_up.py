"""`expertmesh up` as a person runs it (the `make run` path): a real process tree
with local Ray or an existing Ray cluster, queried with the CLI, the client and the
official openai client (the embedded model chats), stopped with SIGTERM, which drains
in-flight requests first."""

import json
import os
import re
import signal
import subprocess
import sys

import grpc
import openai
import pytest
from transformers import AutoTokenizer

from expertmesh.client import Client
from expertmesh.infra.ports import free_port
from expertmesh.models.embedded import NAME as EMBEDDED
from expertmesh.models.tiny import make_tiny_checkpoint
from helpers import RayHead, Up

pytestmark = pytest.mark.slow
BIN = os.path.dirname(sys.executable)


def _chats_through_the_official_client(url: str, checkpoint) -> None:
    """Issue 43: `make run`'s model answers the first call most users make, and streaming chat, a forced tool call
    and ``response_format`` (before: 400, "the model has no chat template"). Its weights are random: what is
    checked is the shape of each answer and that the prompt is the ChatML one the template renders."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    whole = client.chat.completions.create(model=EMBEDDED, messages=messages, max_tokens=8, temperature=0)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay hello.<|im_end|>\n")
    assert rendered.endswith("<|im_start|>assistant\n")
    assert whole.usage.prompt_tokens == len(tokenizer(rendered, add_special_tokens=False).input_ids)
    (choice,) = whole.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    streamed = client.chat.completions.create(
        model=EMBEDDED, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == choice.message.content

    city = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Bergen"]}}}
    city.update(required=["city"], additionalProperties=False)  # else the random model writes keys for ever
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": city}}
    called = client.chat.completions.create(
        model=EMBEDDED,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64,
        temperature=0,
    )
    (call,) = called.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Oslo", "Bergen")
    shaped = client.chat.completions.create(
        model=EMBEDDED,
        messages=messages,
        response_format={"type": "json_schema", "json_schema": {"name": "where", "schema": city}},
        max_tokens=64,
        temperature=0,
    )
    assert json.loads(shaped.choices[0].message.content)["city"] in ("Oslo", "Bergen")


def test_up_with_no_arguments_serves_the_embedded_model_and_drains_on_sigterm(tmp_path):
    up = Up("--http-port", "0", env={"EXPERTMESH_HOME": str(tmp_path)})
    try:
        assert f"on {up.target}" in up.banner and "expertmesh generate" in up.banner
        assert (tmp_path / EMBEDDED / "tokenizer.json").is_file()
        url = up.wait_for_stderr(r"OpenAI-compatible HTTP API on (\S+)/v1").group(1)
        _chats_through_the_official_client(url, tmp_path / EMBEDDED)
        cli = subprocess.run(
            [os.path.join(BIN, "expertmesh"), "generate", "Hello", "--max-tokens", "8", "--target", up.target],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 0, cli.stderr
        assert "completion tokens]" in cli.stderr

        with Client(up.target) as client:
            stream = client.generate([5, 6, 7], max_new_tokens=300, stop_at_eos=False)
            next(stream)
            code = None
            up.proc.send_signal(signal.SIGTERM)
            up.wait_for_stderr("draining in-flight requests")
            try:
                client.generate_text([1, 2], max_new_tokens=2)
            except grpc.RpcError as err:
                code = err.code()
            assert code == grpc.StatusCode.UNAVAILABLE, "new requests are refused while draining"
            rest = list(stream)
            assert rest[-1].finish_reason == "length" and rest[-1].completion_tokens == 300
        assert up.proc.wait(timeout=90) == 0
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
    for line in ("draining in-flight requests", "drained", "stopping expert groups"):
        up.wait_for_stderr(re.escape(line))


def test_up_joins_an_existing_ray_cluster(tmp_path, monkeypatch):
    # A cluster with token authentication, as multi-node Ray runs by default: `up` must present the token.
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", os.urandom(16).hex())
    ray_port = free_port()
    head = RayHead(ray_port)
    try:
        model = make_tiny_checkpoint("olmoe", tmp_path / "olmoe", with_tokenizer=True, vocab_size=300)
        up = Up("--model", str(model), "--groups", "2", "--ray-address", f"127.0.0.1:{ray_port}")
        try:
            with Client(up.target) as client:
                (info,) = client.models()
                assert info.architecture == "olmoe" and list(info.groups) == ["g0", "g1"]
                assert len(client.generate_text("abc", max_new_tokens=4, stop_at_eos=False)) > 0
        finally:
            assert up.stop() == 0
        up.wait_for_stderr(re.escape(f"starting Ray (127.0.0.1:{ray_port})"))
        # The cluster outlives `up`, and `up` took its expert groups with it.
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                "import ray; from ray import serve; ray.init(address=%r, logging_level='ERROR');"
                "print(sorted(serve.status().applications))" % f"127.0.0.1:{ray_port}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert probe.returncode == 0, probe.stderr[-2000:]
        assert "expertmesh-groups" not in probe.stdout
    finally:
        head.stop()


def test_up_with_an_unreachable_ray_cluster_fails_fast():
    proc = subprocess.run(
        [sys.executable, "-m", "expertmesh.cli.main", "up", "--ray-address", f"127.0.0.1:{free_port()}", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("expertmesh up: error: cannot reach the Ray cluster at 127.0.0.1:")
    )
