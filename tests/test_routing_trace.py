"""Per-request routing traces (``routing_trace``): the pure parts (a packed step's choices sliced per
sequence, the groups that served each slot, the bound), then one `expertmesh up --http-port 0` on a tiny
Mixtral asked for traces over gRPC and HTTP, whose experts must be what stock transformers' gates pick
for the same tokens (greedy, float32), whose untraced answers carry no trace, and whose over-cap requests
are refused naming the field."""

from __future__ import annotations

import json
from types import SimpleNamespace

import grpc
import httpx2
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from expertmesh.cli.generate import format_trace
from expertmesh.client import Client
from expertmesh.models.tiny import make_tiny_checkpoint
from expertmesh.observability import remote
from expertmesh.router.dispatch.layer_plan import GroupCall, plan_layer, slot_groups
from expertmesh.router.dispatch.step_choices import StepChoices, concat_steps, split_rows
from expertmesh.router.policy.gate_hook import find_gates
from expertmesh.serving.openai_errors import ApiError
from expertmesh.serving.openai_responses import ChoiceRoutingTrace, Completion
from expertmesh.serving.openai_schema import CompletionRequest
from expertmesh.serving.routing_trace import trace_problem
from helpers import Up

# -- pure: slicing, groups, bounds -------------------------------------------------------------------


def test_split_rows_slices_a_packed_step_by_sequence_in_order():
    rows = np.arange(12).reshape(6, 2)  # [T=6, K=2]
    first, second, third = split_rows(rows, [3, 1, 2])
    assert first.tolist() == [[0, 1], [2, 3], [4, 5]] and second.tolist() == [[6, 7]] and third.shape == (2, 2)
    by_layer = np.arange(24).reshape(2, 6, 2)  # [L, T, K]
    assert [a.shape for a in split_rows(by_layer, [3, 1, 2], axis=1)] == [(2, 3, 2), (2, 1, 2), (2, 2, 2)]
    with pytest.raises(ValueError, match="5 tokens per sequence in all, but 6 rows"):
        split_rows(rows, [3, 2])


def _step() -> StepChoices:
    """Two sequences of 2 and 1 tokens, the second traced; two MoE layers of top-2 over 4 experts (4: an empty
    slot, as a dynamic-k policy leaves one)."""
    choices = StepChoices([2, 1], detail=[False, True])
    weights = torch.tensor([[0.6, 0.4], [0.5, 0.5], [1.0, 0.0]])
    for layer, experts, groups in (
        (1, [[0, 1], [2, 3], [1, 4]], [[0, 0], [1, 1], [0, -1]]),
        (3, [[1, 2], [3, 0], [2, 4]], [[0, 1], [1, 0], [1, -1]]),
    ):
        choices.record(layer, 4, torch.tensor(experts), weights, torch.tensor(groups), ("g0", "g1"))
    return choices


def test_each_sequence_gets_its_rows_of_every_layer_and_the_traced_one_its_detail():
    choices = _step()
    assert choices.layers == (1, 3) and choices.wants_detail
    first, second = choices.experts()
    assert first.shape == (2, 2, 2) and second.shape == (2, 1, 2)  # [L, t_i, K]
    assert first[0].tolist() == [[0, 1], [2, 3]] and first[1].tolist() == [[1, 2], [3, 0]]
    assert second[:, 0].tolist() == [[1, 4], [2, 4]]  # the empty slot keeps its sentinel
    one, three = choices.token_routing(1)
    assert (one.layer, one.experts, one.weights, one.groups) == (1, (1,), (1.0,), ("g0",))
    assert (three.layer, three.experts, three.groups) == (3, (2,), ("g1",))
    assert choices.token_routing(0, row=0)[1].groups == ("g0", "g1")
    with pytest.raises(IndexError):
        choices.token_routing(1, row=1)


def test_a_layer_of_another_forward_is_not_recorded_and_nothing_recorded_is_empty():
    choices = StepChoices([2, 1])
    assert choices.experts() == [] and not choices.wants_detail
    choices.record(0, 4, torch.zeros(5, 2, dtype=torch.long))  # 5 rows, the step has 3
    assert choices.layers == ()


def test_steps_of_different_widths_concatenate_padded_with_empty_slots():
    narrow, wide = np.zeros((2, 3, 2), np.int16), np.ones((2, 1, 3), np.int16)
    whole = concat_steps([narrow, wide], num_experts=8)
    assert whole.shape == (2, 4, 3) and whole[:, :3, 2].tolist() == [[8, 8, 8], [8, 8, 8]]


def test_slot_groups_are_the_answering_calls_groups():
    view = SimpleNamespace(num_experts=4, primary={0: torch.tensor([0, 0, 1, 1])}, replicated={})
    index = torch.tensor([[0, 2], [3, 4], [1, 0]])  # 4: an empty slot
    weights = torch.rand(3, 2)
    calls = plan_layer(view, 0, index, weights, [0, 0])
    assert slot_groups(3, 2, calls).tolist() == [[0, 1], [1, -1], [0, 0]]
    one = GroupCall(1, torch.tensor([0]), torch.tensor([[-1, 2]], dtype=torch.int32), torch.ones(1, 2))
    assert slot_groups(3, 2, [one]).tolist() == [[-1, 1], [-1, -1], [-1, -1]]  # a failed call's slots: none


def test_the_bound_counts_tokens_choices_and_layers():
    assert trace_problem(32, 1, 2, 64) is None
    problem = trace_problem(33, 1, 2, 64)
    assert problem.startswith("routing_trace: 33 new tokens x 2 MoE layers is 66 entries") and "64" in problem
    assert "16 new tokens x 3 choices x 2 MoE layers is 96" in trace_problem(16, 3, 2, 64)


def test_a_response_without_a_trace_has_no_trace_field():
    bare = Completion(id="c", created=0, model="m", choices=[])
    assert "routing_trace" not in bare.model_dump(mode="json") and "routing_trace" not in bare.model_dump_json()
    traced = bare.model_copy(update={"routing_trace": [ChoiceRoutingTrace(index=0, tokens=[])]})
    assert json.loads(traced.model_dump_json())["routing_trace"] == [{"index": 0, "tokens": []}]


def test_the_header_and_the_body_ask_for_a_trace():
    from expertmesh.serving.http_api import wants_trace

    body = CompletionRequest.model_validate({"model": "m", "prompt": "x"})
    assert (wants_trace(body, None), wants_trace(body, "1"), wants_trace(body, "true"), wants_trace(body, "0")) == (
        False,
        True,
        True,
        False,
    )
    asked = CompletionRequest.model_validate({"model": "m", "prompt": "x", "routing_trace": True})
    assert wants_trace(asked, None) and not wants_trace(asked.model_copy(update={"routing_trace": False}), "1")
    with pytest.raises(ApiError) as err:
        wants_trace(body, "yes please")
    assert err.value.param == "X-Expertmesh-Routing-Trace"


# -- end to end: expertmesh up, gRPC and HTTP ------------------------------------------------------

MAX_ENTRIES = 64  # the tiny Mixtral has 2 MoE layers: 32 new tokens at most
PROMPT = [5, 17, 99, 3, 250, 42]


@pytest.fixture(scope="module")
def served(tmp_path_factory, shared_ray_address):
    path = make_tiny_checkpoint(
        "mixtral",
        tmp_path_factory.mktemp("trace-ckpt"),
        with_tokenizer=True,
        vocab_size=300,
        max_position_embeddings=96,
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(path)
    up = Up(
        "--model",
        str(path),
        "--groups",
        "2",
        "--http-port",
        "0",
        "--max-routing-trace-entries",
        str(MAX_ENTRIES),
        "--ray-address",
        shared_ray_address,
    )
    try:
        url = up.wait_for_stderr(r"OpenAI-compatible HTTP API on (\S+)/v1").group(1)
        with Client(up.target, timeout=120) as client:
            (info,) = client.models()
        yield SimpleNamespace(up=up, url=url, model=path.name, path=path, info=info)
    finally:
        if up.proc.poll() is None:
            up.stop()


def stock_routing(path, tokens: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """layer -> (top-k index [T, K], weights [T, K]) stock transformers' gates pick for ``tokens`` (float32)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seen = {}
    for layer, gate in find_gates(model).items():
        gate.register_forward_hook(lambda _m, _a, out, layer=layer: seen.__setitem__(layer, (out[2], out[1])))
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens]))
    return seen


def assert_stock(served, prompt: list[int], trace: list) -> None:
    """Each traced token's experts (in slot order) are the stock gate's at the position that chose it, their
    weights the stock weights, and each expert's group one that holds it."""
    answer = [t.token_id for t in trace]
    assert [t.index for t in trace] == list(range(len(trace)))
    stock = stock_routing(served.path, [*prompt, *answer[:-1]])
    holders = {}
    for group, pairs in remote.expert_groups(served.info, None)[0].items():
        for pair in pairs:
            holders.setdefault(pair, set()).add(group)
    assert sorted(stock) == list(served.info.moe_layers)
    for t in trace:
        assert [r.layer for r in t.layers] == list(served.info.moe_layers)
        for r in t.layers:
            index, weights = stock[r.layer]
            row = len(prompt) - 1 + t.index  # the position whose logits chose answer token t
            assert list(r.experts) == index[row].tolist(), (t.index, r.layer)
            assert list(r.weights) == pytest.approx(weights[row].tolist(), abs=1e-5)
            assert all(g in holders[(r.layer, e)] for e, g in zip(r.experts, r.groups))


def _grpc(served, prompt, **options) -> list:
    with Client(served.up.target, timeout=120) as client:
        return list(client.generate(prompt, temperature=0.0, **options))


@pytest.mark.slow
def test_grpc_traces_equal_stock_routing_choice_by_choice(served):
    chunks = _grpc(served, PROMPT, max_new_tokens=8, stop_at_eos=False, routing_trace=True, n=2)
    for choice in (0, 1):
        mine = [c for c in chunks if c.index == choice]
        trace = [r for c in mine for r in c.routing]
        assert [t.token_id for t in trace] == [i for c in mine for i in c.token_ids]  # one per token, in order
        assert len(trace) == 8 and mine[-1].completion_tokens == 8
        assert_stock(served, PROMPT, trace)
    table = format_trace(trace)
    assert table.splitlines()[0].split()[:3] == ["token", "id", "layer"] and len(table.splitlines()) == 1 + 8 * 2

    # the token that ends a choice (a stop token id) comes with the Finished message, as no delta carries it
    answer = [t.token_id for t in trace]
    stop_at = next(i for i in range(1, 8) if answer[i] not in answer[:i])
    ended = _grpc(served, PROMPT, max_new_tokens=8, stop_token_ids=[answer[stop_at]], routing_trace=True)
    assert ended[-1].finish_reason == "stop" and [t.token_id for t in ended[-1].routing] == [answer[stop_at]]
    assert [t.token_id for c in ended for t in c.routing] == answer[: stop_at + 1]
    assert_stock(served, PROMPT, [t for c in ended for t in c.routing])


@pytest.mark.slow
def test_grpc_without_a_trace_pays_nothing_and_over_the_cap_is_refused(served):
    plain = _grpc(served, PROMPT, max_new_tokens=4, stop_at_eos=False)
    assert all(not c.routing for c in plain) and sum(len(c.token_ids) for c in plain) == 4
    with pytest.raises(grpc.RpcError) as err:
        _grpc(served, PROMPT, max_new_tokens=MAX_ENTRIES // 2 + 1, routing_trace=True)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("routing_trace: 33 new tokens x 2 MoE layers")
    with pytest.raises(grpc.RpcError, match="x 2 choices"):
        _grpc(served, PROMPT, max_new_tokens=20, routing_trace=True, n=2)


def _http(served, path, body, headers=None) -> httpx2.Response:
    return httpx2.post(f"{served.url}{path}", json={"model": served.model, **body}, headers=headers, timeout=120)


def _as_messages(trace: list[dict]) -> list:
    """HTTP trace entries as the gRPC ones read (attributes), for ``assert_stock``."""
    return [
        SimpleNamespace(token_id=t["token_id"], index=t["index"], layers=[SimpleNamespace(**r) for r in t["layers"]])
        for t in trace
    ]


@pytest.mark.slow
def test_http_traces_whole_and_streamed_equal_stock_routing(served):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    whole = _http(served, "/v1/completions", {**body, "routing_trace": True})
    assert whole.status_code == 200, whole.text
    (choice,) = whole.json()["routing_trace"]
    assert choice["index"] == 0 and len(choice["tokens"]) == 8
    assert_stock(served, PROMPT, _as_messages(choice["tokens"]))
    grpc_trace = [
        r for c in _grpc(served, PROMPT, max_new_tokens=8, stop_at_eos=False, routing_trace=True) for r in c.routing
    ]
    assert [t["token_id"] for t in choice["tokens"]] == [t.token_id for t in grpc_trace]

    streamed = _http(served, "/v1/completions", {**body, "stream": True}, {"X-Expertmesh-Routing-Trace": "1"})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    pieces = [c["routing_trace"] for c in chunks if "routing_trace" in c]
    assert all(len(p) == 1 and p[0]["index"] == 0 for p in pieces)
    assert [t for p in pieces for t in p[0]["tokens"]] == choice["tokens"]

    chat = _http(
        served,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0, "routing_trace": True},
    )
    assert (
        chat.status_code == 200
        and len(chat.json()["routing_trace"][0]["tokens"]) == chat.json()["usage"]["completion_tokens"]
    )


@pytest.mark.slow
def test_http_without_a_trace_pays_nothing_and_over_the_cap_is_refused(served):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    plain = _http(served, "/v1/completions", body)
    assert plain.status_code == 200 and "routing_trace" not in plain.json()
    streamed = _http(served, "/v1/completions", {**body, "stream": True})
    assert "routing_trace" not in streamed.text
    for headers, extra in (({}, {"routing_trace": True}), ({"X-Expertmesh-Routing-Trace": "1"}, {})):
        refused = _http(served, "/v1/completions", {**body, "max_tokens": 33, **extra}, headers)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "routing_trace" and error["message"].startswith("routing_trace: 33 new tokens")
