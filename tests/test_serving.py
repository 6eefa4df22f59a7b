"""The public Inference API end to end: real Ray Serve expert groups, the router's
continuous-batching engine, a real gRPC server and clients on loopback."""

import asyncio
import os
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from transformers import AutoModelForCausalLM

from expertmesh.client import AsyncClient, Client, generate_request
from expertmesh.config.settings import DataPlaneConfig, ServingConfig
from expertmesh.models.tiny import make_tiny_checkpoint
from expertmesh.platform.data_plane import DataPlane
from expertmesh.platform.router_apis import serve_plane
from expertmesh.v1 import inference_pb2 as pb
from expertmesh.v1 import inference_pb2_grpc as pb_grpc
from helpers import wait_for

pytestmark = pytest.mark.slow
CONTEXT = 96


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(
        "mixtral", tmp_path_factory.mktemp("ckpt"), with_tokenizer=True, vocab_size=300, max_position_embeddings=CONTEXT
    )


@pytest.fixture(scope="module")
def plane(checkpoint, ray_session):
    plane = DataPlane.start(DataPlaneConfig(model=checkpoint, groups=2))
    yield plane
    plane.close()


@pytest.fixture(scope="module")
def server(plane):
    server = serve_plane(plane, ServingConfig(port=0, max_active_sequences=16, max_new_tokens_cap=64))
    yield server
    server.drain_and_stop()


@pytest.fixture(scope="module")
def client(server):
    with Client(f"127.0.0.1:{server.port}") as c:
        yield c


def _tokens(client, prompt, n):
    chunks = list(client.generate(prompt, max_new_tokens=n, stop_at_eos=False))
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].completion_tokens == n
    return [t for c in chunks for t in c.token_ids]


def test_greedy_matches_stock_transformers(client, checkpoint):
    prompt = [5, 17, 99, 3, 250, 42]
    stock = AutoModelForCausalLM.from_pretrained(checkpoint, experts_implementation="eager").eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):  # plain greedy, EOS included like any token (the request sets stop_at_eos=False)
            ids.append(int(stock(torch.tensor([ids])).logits[0, -1].argmax()))
    assert _tokens(client, prompt, 12) == ids[len(prompt) :]


def test_logits_controls_over_grpc_match_transformers_processors(client, checkpoint):
    """A repetition penalty, and a logit bias, through the platform's groups give the tokens transformers'
    own processors give (each alone: both at once, in vLLM's order, is tests/test_logits_controls.py's); a
    stop token id ends the completion before it."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    prompt = [5, 17, 99, 3, 250, 42]
    stock = AutoModelForCausalLM.from_pretrained(checkpoint, experts_implementation="eager").eval()
    options = dict(max_new_tokens=10, stop_at_eos=False)
    cases = {
        "penalty": ({"repetition_penalty": 1.5}, RepetitionPenaltyLogitsProcessor(1.5)),
        "bias": ({"logit_bias": {17: 1.0, 3: -2.0}}, SequenceBiasLogitsProcessor([[[17], 1.0], [[3], -2.0]])),
    }
    for name, (controls, processor) in cases.items():
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(10):
                scores = LogitsProcessorList([processor])(torch.tensor([ids]), stock(torch.tensor([ids])).logits[:, -1])
                ids.append(int(scores[0].argmax()))
        assert _tokens_with(client, prompt, **controls, **options) == ids[len(prompt) :], name
    plain = _tokens(client, prompt, 10)
    stopped = list(client.generate(prompt, stop_token_ids=[plain[5]], **options))
    assert stopped[-1].finish_reason == "stop"
    assert [t for c in stopped for t in c.token_ids] == plain[: plain.index(plain[5])]


def _tokens_with(client, prompt, **options):
    return [t for c in client.generate(prompt, **options) for t in c.token_ids]


def test_concurrent_requests_share_steps_and_match_running_alone(client, server):
    requests = [([(7 * i + j) % 250 + 3 for j in range(3 + 4 * i)], 6 + 3 * i) for i in range(10)]
    alone = [_tokens(client, prompt, n) for prompt, n in requests]
    steps_before = server.engine.steps
    together = [None] * len(requests)
    barrier = threading.Barrier(len(requests))

    def run(i):
        barrier.wait()
        together[i] = _tokens(client, *requests[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert together == alone
    steps = server.engine.steps - steps_before
    assert steps < sum(n for _, n in requests) / 2, f"{steps} steps for {len(requests)} requests: not batched"


def test_text_prompt_stop_sequence_and_usage(client):
    chunks = list(client.generate("Hello", max_new_tokens=30, stop_at_eos=False))
    text = "".join(c.text for c in chunks)
    assert chunks[-1].prompt_tokens == 5
    if len(text) > 3:
        stop = text[2:4]
        stopped = list(client.generate("Hello", max_new_tokens=30, stop=[stop], stop_at_eos=False))
        assert stopped[-1].finish_reason == "stop"
        assert "".join(c.text for c in stopped) == text[: text.index(stop)]


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(max_new_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    assert client.generate_text([9, 8, 7], **kwargs) == client.generate_text([9, 8, 7], **kwargs)


def test_temperature_floor_and_stop_limits_are_accepted(client):
    """The limits themselves pass: 0.01 arrives as the float32 0.0099999998, and 16 stops of 256 bytes."""
    kwargs = dict(max_new_tokens=3, temperature=0.01, seed=1, stop=["é" * 128] * 16, stop_at_eos=False)
    assert list(client.generate([9, 8, 7], **kwargs))[-1].finish_reason == "length"


def test_score_matches_stock_log_probs(client, checkpoint):
    ids = [3, 44, 120, 7, 9, 250, 31]
    stock = AutoModelForCausalLM.from_pretrained(checkpoint, experts_implementation="eager").eval()
    with torch.no_grad():
        logprobs = stock(torch.tensor([ids])).logits[0].log_softmax(-1)
    expected = [0.0] + [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))]
    response = client.score(ids)
    assert list(response.token_ids) == ids
    assert response.token_scores == pytest.approx(expected, abs=1e-5)


def test_list_models(client, plane):
    _tokens(client, [4, 5, 6], 2)
    (info,) = client.models()
    transports = dict(info.group_transports)  # groups on this host: shared memory ("" if not called yet)
    assert set(transports) == {"g0", "g1"} and "shm" in transports.values() and set(transports.values()) <= {"shm", ""}
    assert (info.architecture, info.num_experts, info.top_k, info.vocab_size) == ("mixtral", 4, 2, 300)
    assert list(info.groups) == ["g0", "g1"] and info.max_context == CONTEXT
    assert info.routing_table_version == plane.store.routing_table_version()
    assert (info.batching, info.batching_note) == (pb.BATCHING_PACKED, "")
    kv = info.kv_pool  # auto-sized: the tiny model's 16 full contexts are far below a quarter of the memory
    assert (kv.block_size, kv.blocks_total) == (16, 16 * -(-CONTEXT // 16))
    assert 1 <= kv.blocks_used_peak <= kv.blocks_total and kv.preemptions == 0
    assert kv.prefix_cache_queries == kv.prefix_cache_hits == 0, "a client cannot read the prefix cache's hits"
    stock = AutoModelForCausalLM.from_pretrained(plane.checkpoint.path)
    assert info.total_parameters == sum(p.numel() for p in stock.parameters())
    experts = sum(p.numel() for n, p in stock.named_parameters() if ".experts." in n)
    assert info.dense_parameters == info.total_parameters - experts
    assert info.parameters_per_expert * 4 * 2 == experts  # 4 experts x 2 MoE layers


def test_async_client(server):
    async def main():
        async with AsyncClient(f"127.0.0.1:{server.port}") as c:
            texts = await asyncio.gather(*[c.generate_text([4, 5, 6], max_new_tokens=5) for _ in range(3)])
            return texts, await c.models()

    texts, models = asyncio.run(main())
    assert len(set(texts)) == 1 and models[0].architecture == "mixtral"


def _bad_generate_requests():
    r = lambda **kw: generate_request(**{"prompt": [1, 2, 3], "max_new_tokens": 4, **kw})
    return {
        "empty text": (pb.GenerateRequest(text=""), "prompt is empty"),
        "no prompt": (pb.GenerateRequest(), "prompt is empty"),
        "too long": (r(prompt=[5] * CONTEXT), f"the prompt has {CONTEXT} tokens; the model's context is {CONTEXT}"),
        "max_new_tokens 0": (r(max_new_tokens=0), "max_new_tokens must be at least 1, got 0"),
        "max_new_tokens negative": (r(max_new_tokens=-3), "max_new_tokens must be at least 1, got -3"),
        "max_new_tokens above cap": (r(max_new_tokens=65), "max_new_tokens 65 is above this server's cap of 64"),
        "negative temperature": (r(temperature=-1.0), "temperature must be >= 0"),
        "temperature below floor": (r(temperature=1e-3), "temperature must be 0 or at least 0.01, got 0.001"),
        "too many stops": (r(stop=["x"] * 17), "stop has 17 sequences; at most 16 are allowed"),
        "empty stop": (r(stop=["ok", ""]), "stop[1] is empty"),
        "stop too long": (r(stop=["é" * 129]), "stop[0] is 258 bytes of UTF-8; at most 256 are allowed"),
        "top_p zero": (r(top_p=0.0), "top_p must be in (0, 1]"),
        "top_p above one": (r(top_p=1.5), "top_p must be in (0, 1]"),
        "token outside vocab": (r(prompt=[1, 300, 7]), "token ids [300] are outside the vocabulary (0-299)"),
        "bias outside vocab": (r(logit_bias={300: 1.0}), "logit_bias token ids [300] are outside the vocabulary"),
        "bias too large": (r(logit_bias={5: 150.0}), "logit_bias values must be in [-100, 100], got 150.0"),
        "stop id outside vocab": (r(stop_token_ids=[301]), "stop_token_ids [301] are outside the vocabulary (0-299)"),
        "min_tokens above max": (r(min_tokens=5), "min_tokens 5 is more than max_new_tokens 4"),
        "repetition penalty 0": (r(repetition_penalty=0.0), "repetition_penalty must be > 0 and finite, got 0.0"),
        "frequency penalty 3": (r(frequency_penalty=3.0), "frequency_penalty must be in [-2, 2], got 3.0"),
    }


@pytest.fixture(scope="module")
def long_stream(server):
    """A generation that keeps streaming while the bad requests arrive."""
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
    return iter(stub.Generate(generate_request([11, 12, 13], max_new_tokens=64, stop_at_eos=False)))


@pytest.mark.parametrize("case", list(_bad_generate_requests()))
def test_bad_generate_is_invalid_argument_and_others_keep_streaming(server, long_stream, case):
    request, message = _bad_generate_requests()[case]
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert next(long_stream).WhichOneof("event") in ("delta", "finished")


def test_long_stream_finished_intact(long_stream):
    rest = list(long_stream)
    assert rest[-1].finished.usage.completion_tokens == 64


def test_invalid_utf8_is_invalid_argument(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    raw = channel.unary_stream("/expertmesh.v1.Inference/Generate")  # raw bytes in, raw bytes out
    bad = pb.GenerateRequest(text="ab").SerializeToString().replace(b"ab", b"a\xff")
    with pytest.raises(grpc.RpcError) as err:
        list(raw(bad))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "valid UTF-8" in err.value.details()


def test_deadline_is_honoured(server, client):
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
    request = generate_request([1, 2], max_new_tokens=64, stop_at_eos=False)
    started = time.monotonic()
    list(stub.Generate(request))  # the whole request, as long as it takes on this host
    whole = time.monotonic() - started
    with pytest.raises(grpc.RpcError) as err:  # a deadline of a quarter of that: it cannot be met
        list(stub.Generate(request, timeout=whole / 4))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_idle(server)
    assert client.generate_text([1, 2], max_new_tokens=3) is not None


def _wait_idle(server, timeout=30):
    end = time.monotonic() + timeout
    while server.engine.load() != (0, 0):
        assert time.monotonic() < end, f"engine still busy: {server.engine.load()}"
        time.sleep(0.05)


def test_cancel_frees_the_sequence(server):
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
    call = stub.Generate(generate_request([1, 2, 3], max_new_tokens=64, stop_at_eos=False))
    next(call)
    assert server.engine.load()[0] == 1
    call.cancel()
    _wait_idle(server)


def test_limits_give_resource_exhausted(plane):
    small = serve_plane(plane, ServingConfig(port=0, max_active_sequences=1, max_queued_requests=1))
    try:
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(f"127.0.0.1:{small.port}"))
        first = stub.Generate(generate_request([1, 2], max_new_tokens=64, stop_at_eos=False))
        next(first)
        second = stub.Generate(generate_request([1, 2], max_new_tokens=2, stop_at_eos=False))
        end = time.monotonic() + 10
        while small.engine.load() != (1, 1):
            assert time.monotonic() < end
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(generate_request([1, 2], max_new_tokens=2)))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1 active sequences, 1 queued" in err.value.details()
        first.cancel()
        assert list(second)[-1].finished.usage.completion_tokens == 2
    finally:
        small.drain_and_stop()


def test_health_and_reflection(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    health = health_pb2_grpc.HealthStub(channel)
    assert (
        health.Check(health_pb2.HealthCheckRequest(service="expertmesh.v1.Inference")).status
        == health_pb2.HealthCheckResponse.SERVING
    )
    db = ProtoReflectionDescriptorDatabase(channel)
    assert "expertmesh.v1.Inference" in db.get_services()
    service = db.FindFileContainingSymbol("expertmesh.v1.Inference")
    assert "expertmesh/v1/inference.proto" == service.name


def test_load_stats_match_the_routing_and_feed_the_planner(server, client, plane, tmp_path):
    """Every routed token is counted once per chosen expert, in every MoE layer, and
    `expertmesh stats export` writes a file `expertmesh plan` accepts."""
    import json
    import subprocess
    import sys

    import yaml

    # Counted from here: earlier tests cut steps short between layers (deadlines), so the window
    # as a whole need not have the same tokens in every layer.
    before = plane.dispatcher.load_window.since_start()  # [L, E]
    for i in range(4):
        client.generate_text([3 + i] * (20 + i), max_new_tokens=16, stop_at_eos=False)
    routed = (plane.dispatcher.load_window.since_start() - before).sum(axis=1) / plane.checkpoint.spec.top_k  # [L]
    # each request feeds its prompt and all but its last new token
    assert routed.tolist() == [sum(20 + i + 15 for i in range(4))] * len(routed), "every layer saw every token"

    out = tmp_path / "stats.json"
    export = subprocess.run(
        [
            sys.executable,
            "-m",
            "expertmesh.cli.main",
            "stats",
            "export",
            "--target",
            f"127.0.0.1:{server.port}",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert export.returncode == 0, export.stderr
    stats = json.loads(out.read_text())
    load = torch.tensor(stats["load"])  # [L, E]
    tokens = load.sum(dim=1) / stats["top_k"]
    assert torch.all(tokens >= routed[0])
    coact = torch.tensor(stats["coactivation"])
    # top-2 without duplicates: each token adds one pair, counted in both directions
    assert torch.all(coact.sum(dim=(1, 2)) == 2 * tokens)
    positions = torch.tensor(stats["position_load"])  # [L, bins, E]: every generated token knows its position
    assert torch.equal(positions.sum(dim=1), load)

    topology = tmp_path / "topo.yaml"
    topology.write_text(
        yaml.safe_dump(
            {
                "nodes": [
                    {
                        "name": "n0",
                        "islands": [
                            {"name": "i0", "numa": 0, "gpus": [{"id": 0, "memory_gb": 80}, {"id": 1, "memory_gb": 80}]}
                        ],
                    }
                ]
            }
        )
    )
    plan = subprocess.run(
        [
            sys.executable,
            "-m",
            "expertmesh.cli.main",
            "plan",
            "--stats",
            str(out),
            "--topology",
            str(topology),
            "--redundant",
            "2",
            "--out",
            str(tmp_path / "placement.json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert plan.returncode == 0, plan.stderr
    placement = json.loads((tmp_path / "placement.json").read_text())
    assert len(placement["layers"]) == stats["num_layers"]


def test_a_restarting_expert_group_under_a_running_server(client, plane):
    """Kill the process of group g0's Serve replica while a request streams. g0 holds the only replica of its
    experts, so the stream fails fast with UNAVAILABLE naming g0, not INTERNAL, and no step waits for the
    restart: the lookup of g0's new address (Serve's directory, which answers once the new replica serves)
    runs off the engine's thread. Serve starts a new replica on a new port, the lookup finds it, and requests
    get the same tokens as before the crash. (Before, the engine's thread made the lookup and every sequence
    waited up to 120 s for it, past its deadline.)"""
    import signal

    from expertmesh.v1 import experts_pb2, experts_pb2_grpc

    prompt, n = [21, 22, 23, 24, 25], 40
    expected = _tokens(client, prompt, n)
    before = plane.store.endpoints()["g0"]
    with grpc.insecure_channel(before) as channel:
        pid = experts_pb2_grpc.ExpertGroupStub(channel).Describe(experts_pb2.DescribeRequest()).pid
    assert pid != os.getpid()
    stream = client.generate(prompt, max_new_tokens=n, stop_at_eos=False)
    next(stream)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert "expert group g0 at " in err.value.details()

    def served_again():
        try:
            return _tokens(client, prompt, 8)
        except grpc.RpcError as failed:
            assert failed.code() == grpc.StatusCode.UNAVAILABLE, failed.details()
            return None

    assert wait_for(served_again, "g0 serving again at its new address", timeout_s=180, poll_s=0.5) == expected[:8]
    assert plane.store.endpoints()["g0"] != before, "the new replica's address was recorded"
