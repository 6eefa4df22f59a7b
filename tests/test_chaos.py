"""Chaos: the expert groups' test-only fault hook (``InjectFault``), and ``expertmesh bench
chaos`` run with short intervals, one fault at a time under streaming load, asserting on
counts only (failed requests, outputs that differ from the reference, the quarantine)."""

from __future__ import annotations

import grpc
import pytest
import torch

from expertmesh.contracts import wire
from expertmesh.expert_group.service import start_server
from expertmesh.infra import security
from expertmesh.models.checkpoint import Checkpoint
from expertmesh.models.hosted_experts import HostedExperts
from expertmesh.v1 import experts_pb2 as pb
from expertmesh.v1 import experts_pb2_grpc as pb_grpc

PAIRS = [(0, 0), (0, 1), (1, 2)]


@pytest.fixture
def group(tiny_checkpoints, request, monkeypatch):
    """A group on loopback, started with fault injection enabled when the test is parametrised so."""
    if getattr(request, "param", False):
        monkeypatch.setenv("EXPERTMESH_ENABLE_FAULT_INJECTION", "1")
    else:
        monkeypatch.delenv("EXPERTMESH_ENABLE_FAULT_INJECTION", raising=False)
    hosted = HostedExperts(Checkpoint(tiny_checkpoints("mixtral")))
    hosted.load(PAIRS)
    server, port = start_server("g0", hosted, workers=2)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield pb_grpc.ExpertGroupStub(channel)
    channel.close()
    server.stop(0)


def _inject(stub, kind, factor=0.0, layer=0, expert=1):
    return stub.InjectFault(
        pb.InjectFaultRequest(expert=pb.ExpertRef(layer=layer, expert=expert), kind=kind, factor=factor), timeout=10
    )


def _output(stub, layer=0, expert=1) -> torch.Tensor:
    hidden = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))  # [T, H]
    request = pb.DispatchRequest(
        layer=layer,
        hidden_states=wire.encode(hidden),
        expert_ids=wire.encode(torch.full((8, 1), expert, dtype=torch.int32)),
        routing_weights=wire.encode(torch.ones(8, 1)),
    )
    return wire.decode(stub.Dispatch(request, timeout=10).partial_sums, "partial sums")  # [T, H]


def _fingerprints(stub) -> dict[tuple[int, int], tuple[str, str]]:
    answer = stub.Fingerprint(pb.FingerprintRequest(), timeout=10)
    return {(f.layer, f.expert): (f.loaded, f.current) for f in answer.fingerprints}


@pytest.mark.parametrize("group", [False], indirect=True)
def test_a_group_without_the_opt_in_refuses_to_inject_faults(group):
    before = _output(group)
    for kind in (pb.FAULT_KIND_SCALE, pb.FAULT_KIND_NAN):
        with pytest.raises(grpc.RpcError) as err:
            _inject(group, kind, factor=2.0)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "EXPERTMESH_ENABLE_FAULT_INJECTION=1" in err.value.details()
    assert torch.equal(_output(group), before)
    assert all(loaded == current for loaded, current in _fingerprints(group).values())


@pytest.mark.parametrize("group", [True], indirect=True)
def test_a_scale_fault_changes_one_experts_output_quietly_and_its_fingerprint(group):
    before, other = _output(group), _output(group, expert=0)
    answer = _inject(group, pb.FAULT_KIND_SCALE, factor=1.5)
    assert answer.fingerprint.loaded != answer.fingerprint.current
    after = _output(group)
    assert torch.isfinite(after).all() and not torch.allclose(after, before)
    assert torch.equal(_output(group, expert=0), other)  # its neighbours in the layer are untouched
    prints = _fingerprints(group)
    assert [pair for pair, (loaded, current) in prints.items() if loaded != current] == [(0, 1)]


@pytest.mark.parametrize("group", [True], indirect=True)
def test_a_nan_fault_makes_every_output_row_of_the_expert_nan(group):
    _inject(group, pb.FAULT_KIND_NAN, layer=1, expert=2)
    assert torch.isnan(_output(group, layer=1, expert=2)).all(dim=1).all()


@pytest.mark.parametrize("group", [True], indirect=True)
@pytest.mark.parametrize(
    ("kind", "factor", "layer", "expert", "code"),
    [
        (pb.FAULT_KIND_SCALE, 1.0, 0, 1, grpc.StatusCode.INVALID_ARGUMENT),  # a factor of 1 changes nothing
        (pb.FAULT_KIND_SCALE, float("inf"), 0, 1, grpc.StatusCode.INVALID_ARGUMENT),
        (pb.FAULT_KIND_UNSPECIFIED, 2.0, 0, 1, grpc.StatusCode.INVALID_ARGUMENT),
        (pb.FAULT_KIND_NAN, 0.0, 1, 0, grpc.StatusCode.NOT_FOUND),  # not held here
    ],
)
def test_bad_fault_requests_are_refused_and_change_nothing(group, kind, factor, layer, expert, code):
    with pytest.raises(grpc.RpcError) as err:
        _inject(group, kind, factor, layer, expert)
    assert err.value.code() == code
    assert all(loaded == current for loaded, current in _fingerprints(group).values())


def test_the_opt_in_travels_to_the_groups_a_router_starts(monkeypatch):
    monkeypatch.setenv("EXPERTMESH_ENABLE_FAULT_INJECTION", "1")
    assert security.propagation_env()["EXPERTMESH_ENABLE_FAULT_INJECTION"] == "1"


# -- the benchmark's pure parts ---------------------------------------------------------------


def test_ring_placement_gives_every_expert_two_groups_and_survives_any_one_group(tiny_checkpoints):
    from expertmesh.bench.chaos.platform import ring_placement

    spec = Checkpoint(tiny_checkpoints("mixtral")).spec
    groups = ["g0", "g1", "g2"]
    placement = ring_placement(spec, groups)["groups"]
    hosts = {}
    for group, layers in placement.items():
        for layer, experts in layers.items():
            for e in experts:
                hosts.setdefault((layer, e), set()).add(group)
    assert set(hosts) == {(layer, e) for layer in spec.moe_layers for e in range(spec.num_experts)}
    assert all(len(g) == 2 for g in hosts.values())
    for down in groups:
        assert all(g - {down} for g in hosts.values())


def test_counts_put_each_differing_completion_in_its_window():
    from expertmesh.bench.chaos.measure import Timeline, count, overlapping
    from expertmesh.bench.chaos.traffic import Request

    reference = [[1, 2], [3, 4]]
    good, bad = (1, 2), (9, 9)

    def req(sent, tokens=good, error=None):
        return Request(0, sent, sent + 1.0, tokens, error)

    requests = [
        req(8.5),  # ended before the fault: not the scenario's
        req(9.5, bad),  # in flight when the corruption struck, sent before the quarantine
        req(11.0, bad),  # before the quarantine
        req(13.0, bad),  # while routers fell back around the expert
        req(16.0, bad),  # after: wrong
        req(17.0),
        req(18.0, (), "UNAVAILABLE: gone"),
    ]
    timeline = Timeline(
        injected=10.0, lifted=10.0, recovered=20.0, detected=11.5, quarantined=12.0, fallback_until=15.0
    )
    mine = overlapping(requests, timeline.injected, timeline.recovered)
    assert len(mine) == 6
    counts = count(mine, reference, timeline)
    assert (counts.sent, counts.completed, counts.failed) == (6, 5, 1)
    assert (counts.wrong_before_quarantine, counts.degraded, counts.wrong_outputs) == (2, 1, 1)
    assert counts.failures == {"UNAVAILABLE: gone": 1}
    # Without a corruption that a quarantine ends, every differing completion is wrong.
    plain = count(mine, reference, Timeline(injected=10.0, lifted=12.0, recovered=20.0))
    assert (plain.wrong_before_quarantine, plain.degraded, plain.wrong_outputs) == (0, 0, 4)


def test_failures_of_one_cause_are_counted_together_whatever_their_request_id():
    from expertmesh.bench.chaos.measure import Timeline, count
    from expertmesh.bench.chaos.traffic import Request

    cause = "expert group g1 at 10.0.0.6:50100 failed layer 0: DEADLINE_EXCEEDED: no answer"
    requests = [
        Request(0, 1.0, 2.0, (), f"UNAVAILABLE: request {rid}: {cause}")
        for rid in ("9c2f91037dbc41b6", "13a4bd5e70374ea8")
    ]
    counts = count(requests, [[1]], Timeline(injected=0.0, lifted=0.0, recovered=3.0))
    assert counts.failures == {f"UNAVAILABLE: {cause}": 2}


def test_tokens_per_second_counts_arrivals_in_the_window():
    from expertmesh.bench.chaos.measure import tokens_per_second

    arrivals = [(0.5, 1), (1.0, 2), (1.5, 1), (3.0, 4)]
    assert tokens_per_second(arrivals, 1.0, 3.0) == 1.5
    assert tokens_per_second(arrivals, 2.0, 2.0) is None


def test_itl_p99_takes_the_gaps_between_a_requests_chunks_in_the_window():
    from expertmesh.bench.chaos.measure import itl_p99_ms
    from expertmesh.bench.chaos.traffic import Request

    fast = Request(0, 0.0, 1.0, (1, 2, 3), arrivals=(0.2, 0.21, 0.22))
    stalled = Request(1, 0.0, 6.0, (1, 2), arrivals=(0.3, 5.3))  # one 5 s gap, ending in the window
    assert itl_p99_ms([fast, stalled], 0.0, 10.0) == pytest.approx(5000.0)
    assert itl_p99_ms([fast, stalled], 0.0, 1.0) == pytest.approx(10.0)  # the stall ended after the window
    assert itl_p99_ms([fast], 2.0, 3.0) is None


def test_longest_stall_takes_every_wait_of_a_stream_that_ended_or_went_on_in_the_window():
    from expertmesh.bench.chaos.measure import longest_stall_s
    from expertmesh.bench.chaos.traffic import Request

    flowing = Request(0, 0.0, 1.0, (1, 2, 3), arrivals=(0.2, 0.3, 0.4))
    held = Request(1, 0.0, 6.0, (1, 2), arrivals=(0.3, 5.3))  # 5 s between two tokens
    failed = Request(2, 1.0, 4.5, (7,), "UNAVAILABLE: gone", arrivals=(1.5,))  # 3 s from its token to the error
    unanswered = Request(3, 2.0, 4.0, (), "UNAVAILABLE: gone")  # 2 s from its sending to the error
    assert longest_stall_s([flowing, held, failed, unanswered], 0.0, 10.0) == pytest.approx(5.0)
    assert longest_stall_s([flowing, failed, unanswered], 0.0, 10.0) == pytest.approx(3.0)
    assert longest_stall_s([flowing, unanswered], 0.0, 10.0) == pytest.approx(2.0)
    # the long wait went on past the window: counted as long as it had lasted by the window's end
    assert longest_stall_s([flowing, held], 0.0, 1.0) == pytest.approx(0.7)
    assert longest_stall_s([held], 1.0, 5.0) == pytest.approx(4.7), "held through the whole window: not 'none'"
    assert longest_stall_s([flowing], 2.0, 3.0) is None


def test_the_sole_group_scenario_picks_the_group_holding_most_of_a_layer(tiny_checkpoints):
    from expertmesh.bench.chaos.faults import sole_layer
    from expertmesh.bench.chaos.platform import ring_placement
    from expertmesh.contracts import group_map
    from expertmesh.contracts.routing_table import RoutingTable

    spec = Checkpoint(tiny_checkpoints("mixtral")).spec
    groups = ["g0", "g1", "g2"]
    placement = group_map.parse(ring_placement(spec, groups), spec)
    table = RoutingTable.from_placement(placement, spec.num_experts)
    layer, group = sole_layer(table, groups)
    held = {g: sum(g in table.replicas[(layer, e)] for e in range(spec.num_experts)) for g in groups}
    assert held[group] == max(held.values()) and held[group] < spec.num_experts  # some experts must move to it
    assert all(
        sum(g in table.replicas[(lay, e)] for e in range(spec.num_experts)) <= held[group]
        for lay in spec.moe_layers
        for g in groups
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--scenarios", "group-sigkill,meteor"], "--scenarios takes names from group-sigkill,"),
        (["--corrupt-factor", "1"], "--corrupt-factor must be > 0 and not 1"),
        (["--hold-seconds", "0"], "--hold-seconds must be > 0"),
    ],
)
def test_bench_chaos_refuses_bad_flags_before_starting_anything(flags, message):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "expertmesh.cli.main", "bench", "chaos", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr.strip().splitlines()[-1]


# -- the benchmark, end to end ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.usefixtures("without_shared_ray")  # bench chaos starts a Ray of its own, with the fault hook enabled
def test_bench_chaos_survives_every_fault_with_no_failed_or_wrong_request():
    """Every scenario with short intervals. The product's promises, as counts: no request fails
    where a replica covers the fault, no completion differs from the reference except those the
    corruption made before its quarantine took effect (counted apart) and the fallback's degraded
    ones; a hung group with replicas stalls no stream a second; each corrupted replica is found and quarantined;
    a group of another checkpoint is refused
    (its registration, then by the router) and the operator is told why; while a layer's only group
    is down its requests fail fast with UNAVAILABLE naming it; every fault heals."""
    from expertmesh.bench.chaos import suite as bench_chaos
    from expertmesh.models.embedded import default_checkpoint

    options = bench_chaos.Options(
        model=default_checkpoint(),
        clients=3,
        max_new_tokens=8,
        quiet_seconds=1.0,
        hold_seconds=5.0,
        redis_down_seconds=2.0,
        health_interval_s=2.0,
        health_tokens=128,
        deadline_s=120.0,
    )
    result = bench_chaos.run(options)
    by_name = {s["scenario"]: s for s in result["scenarios"]}
    assert list(by_name) == list(bench_chaos.SCENARIOS)
    for s in result["scenarios"]:
        assert s["recovered"], s
        assert s["wrong_outputs"] == 0, f"{s['scenario']}: {s['wrong_outputs']} wrong outputs"
        if s["scenario"] == "sole-group-killed":  # no replica covers it: its requests fail fast meanwhile
            continue
        assert s["sent"] > 0 and s["failed"] == 0, (
            f"{s['scenario']}: {s['failed']} of {s['sent']} failed: {s['failures']}"
        )
    foreign = by_name["foreign-checkpoint-group"]
    refused, served = foreign["evidence"]
    assert refused.startswith("registering: ") and "holds another model than this deployment's" in refused
    assert served.startswith("the router refused it") and "refused it 0 times" not in served
    # replicas covered it: no wait of any stream grew by a second (beyond the quiet window's own longest)
    assert foreign["longest_stall_s_during"] < 1.0 + (foreign["longest_stall_s_before"] or 0.0), foreign
    # a hung group whose experts have other replicas: its calls are hedged onto them after the hedge delay and
    # its breaker keeps it out at once, so no stream waits a second for it (before: 4-6 s, the group-call deadline
    # and more)
    stopped = by_name["group-sigstop"]
    assert stopped["longest_stall_s_during"] < 1.0 + (stopped["longest_stall_s_before"] or 0.0), stopped
    sole = by_name["sole-group-killed"]
    assert sole["sent"] > 0 and sole["failed"] > 0, sole
    assert all(f.startswith("UNAVAILABLE: expert group g") for f in sole["failures"]), sole["failures"]
    # each request failed fast or was served: none held for a group call's deadline and more
    assert sole["longest_stall_s_during"] < 10.0, sole
    for name in ("expert-corrupted", "expert-corrupted-sole"):
        assert by_name[name]["detected"] and by_name[name]["quarantined"], by_name[name]
    assert by_name["expert-corrupted"]["degraded"] == 0  # its other replica served: no fallback
    released = by_name["released-after-degraded-prefix"]
    assert released["probes"] == 9 and "0 of 6 completions" not in released["evidence"][0], released
    http = by_name["redis-frozen-http-prefer"]
    assert http["probes"] > 0 and http["health_live_max_ms"] < 1000, http  # the event loop never waited on Redis
    assert http["longest_stall_s_during"] < 1.0 + (http["longest_stall_s_before"] or 0.0), http
    assert result["steady"]["failed"] == 0 and result["steady"]["wrong_outputs"] == 0
    print(bench_chaos.table(result))


@pytest.mark.slow
@pytest.mark.usefixtures("without_shared_ray")
def test_a_flush_during_a_quarantine_brings_the_quarantine_back_and_serves_nothing_from_the_replica():
    """Issue 39: FLUSHDB took the quarantine entries and health records; the table rebuilt from what the groups
    hold listed the quarantined replica again and routers served it. Here that replica computes wrong (its
    weights scaled after the quarantine), so any token it serves shows as a wrong answer with status OK."""
    from expertmesh.bench.chaos import suite as bench_chaos
    from expertmesh.models.embedded import default_checkpoint

    options = bench_chaos.Options(
        model=default_checkpoint(),
        clients=3,
        max_new_tokens=8,
        quiet_seconds=1.0,
        hold_seconds=5.0,
        health_interval_s=2.0,
        health_tokens=128,
        deadline_s=120.0,
        scenarios=("flush-during-quarantine",),
    )
    result = bench_chaos.run(options)
    (s,) = result["scenarios"]
    print(bench_chaos.table(result))
    assert s["recovered"], s
    assert s["sent"] > 0 and s["failed"] == 0, s["failures"]
    assert s["wrong_outputs"] == 0, f"{s['wrong_outputs']} answers served by the quarantined replica"
    assert result["steady"]["failed"] == 0 and result["steady"]["wrong_outputs"] == 0
