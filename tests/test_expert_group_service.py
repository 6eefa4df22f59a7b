"""The ExpertGroup gRPC service: a real server and client on loopback (no Ray),
checked against the architecture's stock experts module, and fed bad requests
that must be refused with the right status while the server keeps serving."""

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoModelForCausalLM

from expertmesh.contracts import wire
from expertmesh.expert_group.service import start_server
from expertmesh.models.checkpoint import Checkpoint, experts_modules
from expertmesh.models.hosted_experts import HostedExperts
from expertmesh.v1 import experts_pb2 as pb
from expertmesh.v1 import experts_pb2_grpc as pb_grpc

LAYER = 1


@pytest.fixture(scope="module", params=["mixtral", "gpt_oss"])
def served(request, tiny_checkpoints):
    path = tiny_checkpoints(request.param)
    hosted = HostedExperts(Checkpoint(path))
    hosted.load([(LAYER, 1), (LAYER, 3), (0, 0)])
    server, port = start_server("g-test", hosted)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stock = experts_modules(AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager"))
    yield pb_grpc.ExpertGroupStub(channel), stock, channel
    channel.close()
    server.stop(0)


def _request(hidden, ids, weights, layer=LAYER):
    return pb.DispatchRequest(
        layer=layer,
        hidden_states=wire.encode(hidden),
        expert_ids=wire.encode(ids.to(torch.int32)),
        routing_weights=wire.encode(weights),
    )


def _good_request():
    torch.manual_seed(0)
    hidden = torch.randn(5, 32)  # [T, H]
    ids = torch.tensor([[1, 3], [3, -1], [-1, 1], [1, -1], [-1, 3]])  # [T, K]
    weights = torch.rand(5, 2)
    return hidden, ids, weights


def _expected(stock, hidden, ids, weights):
    module = stock[LAYER][1]
    # The stock module over all experts; empty slots (-1) get weight 0 on expert 0.
    return module(hidden, ids.clamp(min=0), torch.where(ids >= 0, weights, 0.0))


def test_dispatch_matches_stock_experts_module(served):
    stub, stock, _ = served
    hidden, ids, weights = _good_request()
    response = stub.Dispatch(_request(hidden, ids, weights))
    got = wire.decode(response.partial_sums)
    assert got.shape == (5, 32)
    torch.testing.assert_close(got, _expected(stock, hidden, ids, weights), rtol=0, atol=1e-6)


def test_dispatch_with_no_experts_returns_zeros(served):
    stub, _, _ = served
    response = stub.Dispatch(_request(torch.randn(2, 32), torch.full((2, 2), -1), torch.zeros(2, 2)))
    assert torch.equal(wire.decode(response.partial_sums), torch.zeros(2, 32))


def _bad_requests():
    hidden, ids, weights = _good_request()
    truncated = _request(hidden, ids, weights)
    truncated.hidden_states.data = truncated.hidden_states.data[:-3]
    float_ids = _request(hidden, ids, weights)
    float_ids.expert_ids.CopyFrom(wire.encode(ids.float()))
    return [
        (
            "wrong hidden size",
            _request(torch.randn(5, 16), ids, weights),
            grpc.StatusCode.INVALID_ARGUMENT,
            "must be [tokens, 32]",
        ),
        ("unknown layer", _request(hidden, ids, weights, layer=9), grpc.StatusCode.NOT_FOUND, "layer 9 has no experts"),
        (
            "expert not hosted",
            _request(hidden, torch.full((5, 2), 2), weights),
            grpc.StatusCode.NOT_FOUND,
            r"experts [2] of layer 1 are not held",
        ),
        ("expert does not exist", _request(hidden, torch.full((5, 2), 99), weights), grpc.StatusCode.NOT_FOUND, "[99]"),
        (
            "mismatched lengths",
            _request(hidden, ids[:3], weights[:3]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "to match 5 tokens",
        ),
        (
            "weights shape",
            _request(hidden, ids, weights[:, :1]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "must match expert_ids",
        ),
        (
            "bytes vs shape",
            truncated,
            grpc.StatusCode.INVALID_ARGUMENT,
            "hidden_states: 637 bytes do not match shape [5, 32]",
        ),
        ("no tensors at all", pb.DispatchRequest(layer=LAYER), grpc.StatusCode.INVALID_ARGUMENT, "unset dtype"),
        ("float ids", float_ids, grpc.StatusCode.INVALID_ARGUMENT, "expert_ids must be int32 or int64"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_requests())), ids=[c[0] for c in _bad_requests()])
def test_bad_dispatch_is_refused_and_server_keeps_serving(served, case):
    stub, stock, _ = served
    _, request, code, message = _bad_requests()[case]
    with pytest.raises(grpc.RpcError) as err:
        stub.Dispatch(request)
    assert err.value.code() == code
    assert message in err.value.details()
    test_dispatch_matches_stock_experts_module(served)


def test_load_unload_describe(served):
    stub, stock, _ = served
    described = stub.Describe(pb.DescribeRequest())
    assert described.group == "g-test" and described.device == "cpu" and described.hidden_size == 32
    assert [(r.layer, r.expert) for r in described.experts] == [(0, 0), (LAYER, 1), (LAYER, 3)]
    before = described.weight_bytes

    loaded = stub.LoadExperts(
        pb.LoadExpertsRequest(experts=[pb.ExpertRef(layer=LAYER, expert=2), pb.ExpertRef(layer=LAYER, expert=1)])
    )
    assert [(r.layer, r.expert) for r in loaded.loaded] == [(LAYER, 2)]
    assert loaded.weight_bytes == before * 4 // 3
    hidden = torch.randn(3, 32)
    ids = torch.tensor([[2, 1], [3, 2], [2, -1]])
    weights = torch.rand(3, 2)
    got = wire.decode(stub.Dispatch(_request(hidden, ids, weights)).partial_sums)
    torch.testing.assert_close(got, _expected(stock, hidden, ids, weights), rtol=0, atol=1e-6)

    unloaded = stub.UnloadExperts(pb.UnloadExpertsRequest(experts=[pb.ExpertRef(layer=LAYER, expert=2)]))
    assert [(r.layer, r.expert) for r in unloaded.unloaded] == [(LAYER, 2)]
    assert unloaded.weight_bytes == before
    with pytest.raises(grpc.RpcError) as err:
        stub.Dispatch(_request(hidden, ids, weights))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_load_of_nonexistent_expert_is_refused(served):
    stub, _, _ = served
    with pytest.raises(grpc.RpcError) as err:
        stub.LoadExperts(pb.LoadExpertsRequest(experts=[pb.ExpertRef(layer=LAYER, expert=42)]))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "expert 42 of layer 1 does not exist" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.UnloadExperts(pb.UnloadExpertsRequest(experts=[pb.ExpertRef(layer=5, expert=0)]))
    assert "layer 5 is not an MoE layer" in err.value.details()


def test_standard_health_service(served):
    _, _, channel = served
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "expertmesh.v1.ExpertGroup"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_a_taken_port_is_refused_not_shared(tiny_checkpoints):
    """gRPC would share a port through SO_REUSEPORT and split the connections; ours refuse."""
    hosted = HostedExperts(Checkpoint(tiny_checkpoints("mixtral")))
    first, port = start_server("g-a", hosted)
    try:
        with pytest.raises(OSError, match=f"cannot bind the expert-group gRPC server to 127.0.0.1:{port}"):
            start_server("g-b", hosted, port=port)
    finally:
        first.stop(0)


def test_decode_sized_and_larger_calls_pick_the_same_pairs(tiny_checkpoints, monkeypatch):
    """Calls of up to SMALL_RECORD_ROWS slots find their (token, expert) pairs in plain Python, larger
    ones with tensor ops: the same call both ways gives the same sums, and the same NotHosted."""
    from expertmesh.contracts.errors import NotHosted
    from expertmesh.models import hosted_experts as hosted_mod

    hosted = HostedExperts(Checkpoint(tiny_checkpoints("mixtral")))
    hosted.load([(LAYER, 1), (LAYER, 3)])
    g = torch.Generator().manual_seed(1)
    tokens = hosted_mod.SMALL_RECORD_ROWS  # x 2 slots: over the small path's limit
    hidden = torch.randn(tokens, 32, generator=g)
    ids = torch.tensor([1, 3, -1])[torch.randint(0, 3, (tokens, 2), generator=g)]  # [T, K], some slots empty
    weights = torch.rand(tokens, 2, generator=g)
    bad = ids.clone()
    bad[1, 0], bad[2, 1] = 2, 99  # not held here; no such expert
    missing = r"experts \[2, 99\] of layer 1 are not held by this group \(it holds \[1, 3\]\)"
    large = hosted.compute(LAYER, hidden, ids, weights)
    with pytest.raises(NotHosted, match=missing):
        hosted.compute(LAYER, hidden, bad, weights)
    monkeypatch.setattr(hosted_mod, "SMALL_RECORD_ROWS", 4 * tokens)  # the same calls, the plain-Python way
    assert torch.equal(hosted.compute(LAYER, hidden, ids, weights), large)
    with pytest.raises(NotHosted, match=missing):
        hosted.compute(LAYER, hidden, bad, weights)
    assert torch.equal(hosted.compute(LAYER, hidden, torch.full_like(ids, -1), weights), torch.zeros_like(hidden))
