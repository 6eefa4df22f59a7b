"""ExpertGroup limits and accounting on a real gRPC server (no Ray): Dispatch
limits (columns, slots, finite inputs, concurrent calls), the memory budget,
in-flight calls per routing-table version and per-expert output statistics.
Every refusal carries its status and message, and the server keeps serving."""

import threading
from contextlib import contextmanager

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from expertmesh.contracts import wire
from expertmesh.expert_group.service import start_server
from expertmesh.models.checkpoint import Checkpoint, experts_modules
from expertmesh.models.hosted_experts import HostedExperts
from expertmesh.v1 import experts_pb2 as pb
from expertmesh.v1 import experts_pb2_grpc as pb_grpc

LAYER = 1
HOSTED = [(LAYER, 1), (LAYER, 3)]


@pytest.fixture(scope="module")
def mixtral(tiny_checkpoints):
    path = tiny_checkpoints("mixtral")
    return path, experts_modules(AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager"))


@contextmanager
def _served(path, pairs=HOSTED, max_concurrent_dispatch=64, **hosted_options):
    hosted = HostedExperts(Checkpoint(path), **hosted_options)
    hosted.load(pairs)
    server, port = start_server("g-limits", hosted, max_concurrent_dispatch=max_concurrent_dispatch)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.ExpertGroupStub(channel), hosted
    finally:
        channel.close()
        server.stop(0)


def _request(hidden, ids, weights, version=0):
    return pb.DispatchRequest(
        layer=LAYER,
        hidden_states=wire.encode(hidden),
        expert_ids=wire.encode(ids.to(torch.int32)),
        routing_weights=wire.encode(weights),
        routing_table_version=version,
    )


def _good(tokens=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, 32, generator=generator)  # [T, H]
    ids = torch.tensor([[1, 3], [3, -1], [-1, 1], [1, -1], [-1, 3]] * tokens)[:tokens]  # [T, K]
    weights = torch.rand(tokens, 2, generator=generator) + 0.1  # [T, K]
    return hidden, ids, weights


def _expected(stock, hidden, ids, weights):
    module = stock[LAYER][1]
    with torch.no_grad():
        return module(hidden, ids.clamp(min=0), torch.where(ids >= 0, weights, 0.0))


def _assert_serves(stub, stock):
    hidden, ids, weights = _good()
    got = wire.decode(stub.Dispatch(_request(hidden, ids, weights)).partial_sums)
    torch.testing.assert_close(got, _expected(stock, hidden, ids, weights), rtol=0, atol=1e-6)


def _refused(call, request, code, message):
    with pytest.raises(grpc.RpcError) as err:
        call(request)
    assert err.value.code() == code
    assert message in err.value.details()


# -- Dispatch limits -------------------------------------------------------------------


def _bad_dispatches():
    hidden, ids, weights = _good()
    nan_hidden = hidden.clone()
    nan_hidden[2, 7] = float("nan")
    inf_weights = weights.clone()
    inf_weights[0, 1] = float("inf")
    wide = torch.tensor([[1, 3, -1, -1]] * 5)  # [T, 4]: top-k 2 + 1 allowed
    return [
        (
            "too many columns",
            _request(hidden, wide, torch.rand(5, 4)),
            "expert_ids has 4 columns; this model routes a token to at most 3 experts",
        ),
        ("too many slots", _request(*_good(tokens=7)), "7x2 = 14 (token, expert) slots, over this group's cap of 12"),
        ("NaN hidden state", _request(nan_hidden, ids, weights), "hidden_states holds 1 non-finite values"),
        ("Inf routing weight", _request(hidden, ids, inf_weights), "routing_weights holds 1 non-finite values"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_dispatches())), ids=[c[0] for c in _bad_dispatches()])
def test_dispatch_over_a_limit_is_refused_and_server_keeps_serving(mixtral, case):
    path, stock = mixtral
    _, request, message = _bad_dispatches()[case]
    with _served(path, max_rows=12) as (stub, _):
        _refused(stub.Dispatch, request, grpc.StatusCode.INVALID_ARGUMENT, message)
        _assert_serves(stub, stock)


def test_one_column_beyond_top_k_is_allowed(mixtral):
    """The router's dynamic top-k may widen a token's choice by one expert."""
    path, stock = mixtral
    hidden, _, _ = _good()
    ids = torch.tensor([[1, 3, -1], [3, -1, 1], [-1, 1, 3], [1, -1, -1], [-1, -1, 3]])  # [T, 3]
    weights = torch.rand(5, 3)
    with _served(path) as (stub, _):
        got = wire.decode(stub.Dispatch(_request(hidden, ids, weights)).partial_sums)
    torch.testing.assert_close(got, _expected(stock, hidden, ids, weights), rtol=0, atol=1e-6)


class _Blocking:
    """Stands in for HostedExperts.compute: signals that a call entered, holds it until released,
    then computes (or raises, to check that accounting survives a failing compute)."""

    def __init__(self, hosted: HostedExperts, fail: bool = False):
        self._compute = hosted.compute
        self._fail = fail
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()

    def __call__(self, *args):
        self.entered.release()
        assert self.release.wait(30), "the test never released the blocked compute"
        if self._fail:
            raise RuntimeError("injected compute failure")
        return self._compute(*args)

    def wait_entered(self, calls: int) -> None:
        for _ in range(calls):
            assert self.entered.acquire(timeout=30), "a Dispatch never reached compute"


def _in_flight(stub):
    return sorted(
        (f.routing_table_version, f.layer, f.expert, f.calls) for f in stub.Describe(pb.DescribeRequest()).in_flight
    )


def test_dispatch_beyond_the_concurrency_limit_is_refused_at_once(mixtral):
    path, stock = mixtral
    with _served(path, max_concurrent_dispatch=2) as (stub, hosted):
        blocking = hosted.compute = _Blocking(hosted)
        held = [stub.Dispatch.future(_request(*_good()), timeout=60) for _ in range(2)]
        blocking.wait_entered(2)
        _refused(
            stub.Dispatch,
            _request(*_good()),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "expert group g-limits is executing 2 Dispatch calls, its limit",
        )
        blocking.release.set()
        for future in held:
            assert future.result().partial_sums.shape == [5, 32]
        _assert_serves(stub, stock)


# -- in-flight accounting ----------------------------------------------------------------


def test_in_flight_calls_are_counted_per_version_and_expert_while_they_execute(mixtral):
    path, stock = mixtral
    with _served(path) as (stub, hosted):
        assert _in_flight(stub) == []
        blocking = hosted.compute = _Blocking(hosted)
        hidden, ids, weights = _good()
        only_3 = torch.tensor([[3, -1]] * 5)
        held = [
            stub.Dispatch.future(_request(hidden, ids, weights, version=7), timeout=60),
            stub.Dispatch.future(_request(hidden, ids, weights, version=7), timeout=60),
            stub.Dispatch.future(_request(hidden, only_3, weights, version=8), timeout=60),
        ]
        blocking.wait_entered(3)
        assert _in_flight(stub) == [(7, LAYER, 1, 2), (7, LAYER, 3, 2), (8, LAYER, 3, 1)]
        blocking.release.set()
        for future in held:
            future.result()
        assert _in_flight(stub) == []
        _assert_serves(stub, stock)


def test_in_flight_count_returns_to_empty_when_compute_fails(mixtral):
    path, stock = mixtral
    with _served(path) as (stub, hosted):
        blocking = hosted.compute = _Blocking(hosted, fail=True)
        held = stub.Dispatch.future(_request(*_good(), version=3), timeout=60)
        blocking.wait_entered(1)
        assert _in_flight(stub) == [(3, LAYER, 1, 1), (3, LAYER, 3, 1)]
        blocking.release.set()
        with pytest.raises(grpc.RpcError) as err:
            held.result()
        assert err.value.code() == grpc.StatusCode.INTERNAL and "injected compute failure" in err.value.details()
        assert _in_flight(stub) == []
        del hosted.compute
        _refused(
            stub.Dispatch,
            _request(*_good()[:1], torch.full((5, 2), 2), torch.rand(5, 2)),
            grpc.StatusCode.NOT_FOUND,
            "experts [2]",
        )
        assert _in_flight(stub) == []
        _assert_serves(stub, stock)


# -- memory budget ----------------------------------------------------------------------


def test_expert_bytes_matches_what_a_load_takes(mixtral):
    path, _ = mixtral
    hosted = HostedExperts(Checkpoint(path))
    assert hosted.expert_bytes([(LAYER, 0)]) > 0
    hosted.load([(LAYER, 0), (0, 2)])
    assert hosted.weight_bytes() == hosted.expert_bytes([(LAYER, 0), (0, 2)])


def test_a_load_over_budget_is_refused_before_reading_and_changes_nothing(mixtral):
    path, stock = mixtral
    budget = HostedExperts(Checkpoint(path)).expert_bytes(HOSTED + [(0, 0)])
    with _served(path, budget_bytes=budget) as (stub, hosted):
        before = stub.Describe(pb.DescribeRequest())
        assert before.budget_bytes == budget
        reads = []
        real_read = hosted.checkpoint.expert_weights
        hosted.checkpoint.expert_weights = lambda *args: reads.append(args) or real_read(*args)
        two = [pb.ExpertRef(layer=0, expert=0), pb.ExpertRef(layer=LAYER, expert=2)]
        _refused(
            stub.LoadExperts,
            pb.LoadExpertsRequest(experts=two),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"over its budget of {budget} bytes",
        )
        assert reads == []
        after = stub.Describe(pb.DescribeRequest())
        assert list(after.experts) == list(before.experts) and after.weight_bytes == before.weight_bytes
        _assert_serves(stub, stock)
        # What fits is still loaded.
        loaded = stub.LoadExperts(pb.LoadExpertsRequest(experts=two[:1]))
        assert loaded.weight_bytes == budget and len(reads) == 1


def test_no_budget_is_reported_as_zero(mixtral):
    path, _ = mixtral
    with _served(path) as (stub, _):
        assert stub.Describe(pb.DescribeRequest()).budget_bytes == 0


# -- output statistics ------------------------------------------------------------------


def _stats(stub):
    return {(s.layer, s.expert): s for s in stub.Describe(pb.DescribeRequest()).expert_stats}


def _unweighted_norms(stock, hidden, ids, expert):
    """L2 norms of the stock expert's unweighted outputs for the tokens that chose it."""
    tokens = (ids == expert).any(dim=1)
    rows = int(tokens.sum())
    with torch.no_grad():
        out = stock[LAYER][1](hidden[tokens], torch.full((rows, 1), expert), torch.ones(rows, 1))  # [n, H]
    return out.norm(dim=1).double()


def test_stats_count_rows_and_merge_norms_across_calls(mixtral):
    path, stock = mixtral
    with _served(path) as (stub, _):
        assert all(s.calls == 0 and s.rows == 0 for s in _stats(stub).values())
        calls = [_good(tokens=5, seed=1), _good(tokens=4, seed=2)]
        for hidden, ids, weights in calls:
            stub.Dispatch(_request(hidden, ids, weights))
        stats = _stats(stub)
        assert sorted(stats) == HOSTED
        for layer, expert in HOSTED:
            norms = torch.cat([_unweighted_norms(stock, hidden, ids, expert) for hidden, ids, _ in calls])
            got = stats[(layer, expert)]
            assert (got.calls, got.rows, got.non_finite) == (2, len(norms), 0)
            assert got.norm_mean == pytest.approx(norms.mean().item(), rel=1e-5)
            assert got.norm_var == pytest.approx(norms.var(unbiased=False).item(), rel=1e-4)


def test_stats_count_non_finite_outputs_and_reset_on_unload(mixtral):
    """Fault injection: the test overwrites expert 3's weights with NaN directly on the
    HostedExperts object in-process, as a corrupted weight in memory would."""
    path, _ = mixtral
    with _served(path) as (stub, hosted):
        held = hosted._layers[LAYER]
        held.module.down_proj[held.ids.index(3)].fill_(float("nan"))
        hidden, ids, weights = _good()
        stub.Dispatch(_request(hidden, ids, weights))  # computing is not refused: the inputs are fine
        stats = _stats(stub)
        assert (stats[(LAYER, 3)].rows, stats[(LAYER, 3)].non_finite) == (3, 3)
        assert (stats[(LAYER, 1)].rows, stats[(LAYER, 1)].non_finite) == (3, 0)
        assert stats[(LAYER, 1)].norm_mean > 0

        stub.UnloadExperts(pb.UnloadExpertsRequest(experts=[pb.ExpertRef(layer=LAYER, expert=3)]))
        assert sorted(_stats(stub)) == [(LAYER, 1)]
        stub.LoadExperts(pb.LoadExpertsRequest(experts=[pb.ExpertRef(layer=LAYER, expert=3)]))
        stats = _stats(stub)
        assert (stats[(LAYER, 3)].calls, stats[(LAYER, 3)].rows, stats[(LAYER, 3)].non_finite) == (0, 0, 0)
        assert stats[(LAYER, 1)].rows == 3  # a kept expert keeps its statistics across the rebuild


def test_decode_sized_calls_keep_the_same_statistics_to_the_bit(mixtral, monkeypatch):
    """Small calls keep their statistics in plain Python (hosted.SMALL_RECORD_ROWS): the same numbers,
    bit for bit, as the tensor path, non-finite outputs and weight-0 slots included."""
    from expertmesh.models import hosted_experts as hosted_mod

    path, _ = mixtral
    calls = [_good(tokens=t, seed=t) for t in (1, 3, 5, 2)]
    calls[1][2][0, 0] = 0.0  # a weight-0 slot: counted in rows, not in the norms
    stats = []
    for small in (hosted_mod.SMALL_RECORD_ROWS, 0):
        monkeypatch.setattr(hosted_mod, "SMALL_RECORD_ROWS", small)
        hosted = HostedExperts(Checkpoint(path))
        hosted.load(HOSTED)
        for i, (hidden, ids, weights) in enumerate(calls):
            if i == 2:  # NaN outputs from here on for expert 3
                held = hosted._layers[LAYER]
                held.module.down_proj[held.ids.index(3)].fill_(float("nan"))
            hosted.compute(LAYER, hidden, ids.to(torch.int32), weights)
        stats.append(hosted.expert_stats())
    assert stats[0] == stats[1]
    assert any(s.non_finite for _, _, s in stats[0]) and all(s.calls == 4 for _, _, s in stats[0])
