"""Property-based fuzzing (hypothesis) of how an expert group decodes and validates requests.

What is real: one ExpertGroup gRPC server (``start_server`` on a tiny Mixtral
checkpoint, no Ray) on loopback, called through a real channel, with its
interceptors, its wire codec and HostedExperts' validation; ``wire.decode`` is
also fuzzed directly. Requests range from arbitrary bytes to well-formed tensors
with wrong dtypes, shapes, byte counts, expert ids, NaN/Inf weights and layers.
Each must be answered OK (with partial sums of the right shape) or with a status
a caller can act on (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED), never
INTERNAL or UNKNOWN, and the server must keep serving a good request afterwards.
Example counts stay modest so the module runs in seconds.
"""

from __future__ import annotations

import math

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expertmesh.contracts import wire
from expertmesh.contracts.errors import InvalidRequest
from expertmesh.expert_group.service import start_server
from expertmesh.infra.group_channels import CHANNEL_OPTIONS
from expertmesh.models.checkpoint import Checkpoint
from expertmesh.models.hosted_experts import HostedExperts
from expertmesh.v1 import experts_pb2 as pb
from expertmesh.v1 import experts_pb2_grpc as pb_grpc

HIDDEN = 32  # the tiny Mixtral's hidden size; MoE layers 0 and 1, experts 0-3, top-k 2
HOSTED = [(0, 0), (1, 1), (1, 3)]
CLEAR = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}
FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
WIRE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64]


@pytest.fixture(scope="module")
def group(tiny_checkpoints):
    """A group holding three experts, with a budget of two more: LoadExperts can run out."""
    hosted = HostedExperts(Checkpoint(tiny_checkpoints("mixtral")))
    hosted.budget_bytes = hosted.expert_bytes(HOSTED) + hosted.expert_bytes([(1, 0), (1, 2)])
    hosted.load(HOSTED)
    server, port = start_server("g-fuzz", hosted)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    yield pb_grpc.ExpertGroupStub(channel), channel
    channel.close()
    server.stop(0)


def _answer(call, request) -> tuple[grpc.StatusCode, object]:
    try:
        return grpc.StatusCode.OK, call(request, timeout=30)
    except grpc.RpcError as err:
        return err.code(), err.details()


# -- strategies ------------------------------------------------------------------------------------

dtype_codes = st.one_of(st.sampled_from(sorted(pb.DType.values())), st.integers(-(2**31), 2**31 - 1))
dims = st.one_of(st.integers(0, 40), st.integers(-3, -1), st.integers(0, 2**63 - 1))


@st.composite
def raw_tensors(draw) -> pb.Tensor:
    """Any dtype code, any shape, any bytes: mostly inconsistent."""
    return pb.Tensor(
        dtype=draw(dtype_codes), shape=draw(st.lists(dims, max_size=5)), data=draw(st.binary(max_size=256))
    )


@st.composite
def consistent_tensors(draw, shape=None, dtypes=WIRE_DTYPES) -> pb.Tensor:
    """A wire dtype, a small shape and exactly the bytes it needs (random bytes: NaN and Inf included)."""
    dtype = draw(st.sampled_from(dtypes))
    shape = shape if shape is not None else draw(st.lists(st.integers(0, 6), max_size=3))
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return pb.Tensor(dtype=wire.dtype_to_proto(dtype), shape=shape, data=draw(st.binary(min_size=size, max_size=size)))


@st.composite
def plausible_requests(draw) -> pb.DispatchRequest:
    """Close to what a router sends: [T, H] hidden states, [T, K] ids around the held range, weights
    with NaN/Inf now and then; dtypes and widths sometimes off."""
    tokens = draw(st.integers(0, 6))
    columns = draw(st.integers(0, 4))
    width = draw(st.sampled_from([HIDDEN, HIDDEN, 16]))
    hidden = torch.randn(tokens, width, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**16))))  # [T, H]
    hidden = hidden.to(
        draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float16, torch.int32]))
    )
    ids = draw(st.lists(st.integers(-3, 6), min_size=tokens * columns, max_size=tokens * columns))
    ids = torch.tensor(ids, dtype=draw(st.sampled_from([torch.int32, torch.int64, torch.float32]))).reshape(
        tokens, columns
    )
    weights = draw(
        st.lists(
            st.floats(allow_nan=True, allow_infinity=True, width=32),
            min_size=tokens * columns,
            max_size=tokens * columns,
        )
    )
    weights = torch.tensor(weights, dtype=torch.float32).reshape(tokens, columns)  # [T, K]
    weights = weights.to(draw(st.sampled_from([torch.float32, torch.float32, torch.float16, torch.int64])))
    return pb.DispatchRequest(
        layer=draw(st.one_of(st.sampled_from([0, 1]), st.integers(0, 2**32 - 1))),
        hidden_states=wire.encode(hidden),
        expert_ids=wire.encode(ids),
        routing_weights=wire.encode(weights),
        routing_table_version=draw(st.integers(0, 2**64 - 1)),
    )


@st.composite
def arbitrary_requests(draw) -> pb.DispatchRequest:
    tensor = st.one_of(raw_tensors(), consistent_tensors())
    return pb.DispatchRequest(
        layer=draw(st.integers(0, 2**32 - 1)),
        hidden_states=draw(tensor),
        expert_ids=draw(tensor),
        routing_weights=draw(tensor),
        routing_table_version=draw(st.integers(0, 2**64 - 1)),
    )


refs = st.lists(
    st.builds(
        pb.ExpertRef,
        layer=st.one_of(st.integers(0, 3), st.integers(0, 2**32 - 1)),
        expert=st.one_of(st.integers(0, 5), st.integers(0, 2**32 - 1)),
    ),
    max_size=5,
)


# -- properties --------------------------------------------------------------------------------------


@FUZZ
@given(request=st.one_of(plausible_requests(), arbitrary_requests()))
def test_dispatch_answers_ok_or_a_clear_status(group, request):
    stub, _ = group
    code, answer = _answer(stub.Dispatch, request)
    if code == grpc.StatusCode.OK:
        partial = wire.decode(answer.partial_sums)
        assert list(partial.shape) == [request.hidden_states.shape[0], HIDDEN]
    else:
        assert code in CLEAR, f"{code.name}: {answer}"
        assert answer, "a refusal must say why"


@FUZZ
@given(load=st.booleans(), experts=refs)
def test_load_and_unload_answer_ok_or_a_clear_status(group, load, experts):
    stub, _ = group
    if load:
        code, answer = _answer(stub.LoadExperts, pb.LoadExpertsRequest(experts=experts))
    else:
        code, answer = _answer(stub.UnloadExperts, pb.UnloadExpertsRequest(experts=experts))
    assert code == grpc.StatusCode.OK or code in CLEAR, f"{code.name}: {answer}"
    if code == grpc.StatusCode.OK:
        changed = answer.loaded if load else answer.unloaded
        assert {(r.layer, r.expert) for r in changed} <= {(r.layer, r.expert) for r in experts}


@FUZZ
@given(method=st.sampled_from(["Dispatch", "LoadExperts", "UnloadExperts", "Describe"]), body=st.binary(max_size=300))
def test_request_bytes_that_do_not_parse_are_invalid_argument(group, method, body):
    """Raw bytes on the wire: they parse (then validation answers) or they are INVALID_ARGUMENT."""
    _, channel = group
    call = channel.unary_unary(
        f"/expertmesh.v1.ExpertGroup/{method}", request_serializer=None, response_deserializer=None
    )
    code, answer = _answer(call, body)
    assert code == grpc.StatusCode.OK or code in CLEAR, f"{code.name}: {answer}"


def test_server_still_serves_after_the_fuzzing(group):
    """The same server, after every example above: it holds what it is told and computes."""
    stub, _ = group
    every = [pb.ExpertRef(layer=layer, expert=e) for layer in (0, 1) for e in range(4)]
    stub.UnloadExperts(pb.UnloadExpertsRequest(experts=every), timeout=30)
    stub.LoadExperts(pb.LoadExpertsRequest(experts=[pb.ExpertRef(layer=l, expert=e) for l, e in HOSTED]), timeout=30)
    assert stub.Describe(pb.DescribeRequest(), timeout=30).group == "g-fuzz"
    request = pb.DispatchRequest(
        layer=1,
        hidden_states=wire.encode(torch.ones(2, HIDDEN)),
        expert_ids=wire.encode(torch.tensor([[1, 3], [-1, 1]], dtype=torch.int32)),
        routing_weights=wire.encode(torch.ones(2, 2)),
    )
    partial = wire.decode(stub.Dispatch(request, timeout=30).partial_sums)
    assert partial.shape == (2, HIDDEN) and bool(torch.isfinite(partial).all())


@settings(max_examples=200, deadline=None)
@given(message=st.one_of(raw_tensors(), consistent_tensors()))
def test_wire_decode_returns_the_described_tensor_or_refuses(message):
    """Pure: decode either yields exactly the tensor the message describes or raises InvalidRequest."""
    try:
        tensor = wire.decode(message, "t")
    except InvalidRequest as err:
        assert str(err).startswith("t: ")
        return
    assert wire.dtype_to_proto(tensor.dtype) == message.dtype
    assert list(tensor.shape) == list(message.shape)
    assert tensor.numel() * tensor.element_size() == len(message.data)
    assert wire.encode(tensor).data == message.data


@settings(max_examples=100, deadline=None)
@given(message=consistent_tensors(dtypes=[torch.float32, torch.int64]))
def test_wire_round_trip_is_bit_exact(message):
    assert wire.encode(wire.decode(message)) == message
