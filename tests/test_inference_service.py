"""The gRPC Inference API's handling of a request's choices and bounds, over a scripted engine (what a real
model cannot be made to do on demand: every choice ending on its first token) on a real gRPC server on
loopback, driven by the project's own ``Client``. Fast: no Ray, no model."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest
from transformers import AutoTokenizer

from expertmesh.client import Client, generate_request
from expertmesh.config.settings import ServingConfig
from expertmesh.models.tokenizer import save_byte_tokenizer
from expertmesh.serving.engine import EngineLimits
from expertmesh.serving.events import FinishEvent
from expertmesh.serving.grammar import Grammars
from expertmesh.serving.service import InferenceServer, InferenceServicer
from expertmesh.v1 import inference_pb2 as pb
from expertmesh.v1 import inference_pb2_grpc as pb_grpc
from test_http_api import ScriptedEngine

VOCAB, CONTEXT = 300, 96


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    save_byte_tokenizer(path, VOCAB)
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = ScriptedEngine()
    engine.grammars = Grammars(tokenizer, VOCAB)
    engine.limits = EngineLimits(8, 8)
    engine.start = engine.stop = lambda: None
    engine.drain = lambda timeout=None: True
    info = pb.ModelInfo(name="tiny", vocab_size=VOCAB, max_context=CONTEXT, top_k=2, num_experts=4, moe_layers=[1])
    config = ServingConfig(port=0, max_new_tokens_cap=64)
    servicer = InferenceServicer(engine, tokenizer, info, config, lambda: 1, load_window=None)
    server = InferenceServer(servicer, engine, config).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    with Client(f"127.0.0.1:{server.port}", timeout=30) as client:
        yield SimpleNamespace(engine=engine, client=client, stub=pb_grpc.InferenceStub(channel))
    channel.close()
    server.drain_and_stop()


def test_every_choice_is_served_when_the_first_ends_on_its_first_token(served):
    """The issue's reproduction: n=4 with the first greedy token as a stop token id. Each choice's first event
    is its end; the API used to submit the later choices only after the first choice's first token, so it
    answered choice 0 alone, status OK."""
    served.engine.submitted.clear()
    served.engine.script = lambda request, seq: seq.events.put(FinishEvent("stop", len(request.prompt_ids), 1))
    chunks = list(served.client.generate("Hello", max_new_tokens=8, n=4, stop_token_ids=[72]))
    finished = sorted(c.index for c in chunks if c.finish_reason)
    assert finished == [0, 1, 2, 3]
    assert [s.request.request_id.rsplit("-", 1)[1] for s in served.engine.submitted] == ["0", "1", "2", "3"]


def test_the_request_id_is_echoed_as_given_and_bounded(served):
    served.engine.script = ScriptedEngine.hello
    responses = list(served.stub.Generate(generate_request("Hi", max_new_tokens=2, request_id="job-0"), timeout=30))
    assert {r.request_id for r in responses} == {"job-0"}, "an id ending in -0 is not a choice's"
    with pytest.raises(grpc.RpcError) as err:
        list(served.client.generate("Hi", max_new_tokens=2, request_id="r" * 10_000))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id takes 1 to 128" in err.value.details()


def test_the_cache_salt_and_the_client_reach_the_engine(served):
    served.engine.submitted.clear()
    served.engine.script = ScriptedEngine.hello
    list(served.client.generate("Hi", max_new_tokens=2, cache_salt="tenant-a"))
    (seq,) = served.engine.submitted
    assert seq.request.cache_salt == "tenant-a" and seq.request.client == "127.0.0.1"
    with pytest.raises(grpc.RpcError) as err:
        list(served.client.generate("Hi", max_new_tokens=2, cache_salt="s" * 257))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in err.value.details()
