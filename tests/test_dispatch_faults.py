"""The router's dispatcher against real expert-group gRPC servers on loopback (no Ray):
exact against stock transformers, and never a wrong answer with status OK, over
every transport (``transport`` fixture: unary gRPC, the gRPC stream, and ``auto``,
which is shared memory for these same-host groups).

Faults are injected at the group's servicer (a subclass whose compute answers
with NaN, a wrong shape or a wrong dtype, late, or not until released; undecodable
answers are cut short on the transport's own codec), by stopping a group's server,
by SIGSTOP of a real ``expertmesh group serve`` process, by publishing a routing
table that leaves an expert unhosted, and by killing a real redis-server under a
router that has a table cached.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter

import grpc
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from expertmesh.contracts.errors import (
    BadGroupResponse,
    DeadlineExceeded,
    GroupUnavailable,
    RoutingTableMismatch,
    StoreCollision,
    UnhostedExperts,
)
from expertmesh.contracts.routing_table import ModelIdentity, RoutingTable
from expertmesh.expert_group import local_server, stream_service
from expertmesh.expert_group.service import ExpertGroupServicer, GroupServer
from expertmesh.infra.ports import free_port
from expertmesh.models.checkpoint import Checkpoint, experts_modules
from expertmesh.models.hosted_experts import HostedExperts
from expertmesh.platform.group_processes import start_groups
from expertmesh.router import transport as transports
from expertmesh.router.dispatch.circuit import BreakerState, CircuitBreakers
from expertmesh.router.dispatch.heartbeat import Heartbeat
from expertmesh.router.dispatch.hedging import HedgePolicy
from expertmesh.router.dispatch.table_watcher import TableWatcher
from expertmesh.store import QuarantinedReplica, open_store
from expertmesh.v1 import experts_pb2 as pb
from expertmesh.v1 import experts_pb2_grpc as pb_grpc
from helpers import bare_dispatcher, wait_for, wait_stopped

LAYERS = (0, 1)


TRANSPORTS = ["grpc-unary", "grpc", "auto"]


class FaultyServicer(ExpertGroupServicer):
    """A group that computes correctly and then corrupts its answer (``fault``), as a group with
    overwritten weights or a buggy build would; whichever transport carried the call."""

    fault: str | None = None
    calls = 0
    #: the "late" fault's delay, s
    late_s = 0.0
    #: the "stall" fault answers once this is set (a hung group that comes back)
    unstall = threading.Event()

    def compute(self, *args, **kwargs):
        self.calls += 1
        if self.fault == "late":
            time.sleep(self.late_s)
        elif self.fault == "stall":
            self.unstall.wait(60)
        partial = super().compute(*args, **kwargs)
        if self.fault == "nan":
            partial[0, 0] = float("nan")
        elif self.fault == "shape":
            partial = partial[:, :-1]
        elif self.fault == "dtype":
            partial = partial.double().float().to(torch.bfloat16)
        elif self.fault == "hang":
            time.sleep(3)
        return partial

    def Dispatch(self, request, context):
        response = super().Dispatch(request, context)
        if self.fault == "bytes":  # the answer's tensor two bytes short
            response.partial_sums.data = response.partial_sums.data[:-2]
        return response


@pytest.fixture(scope="module", autouse=True)
def short_answers_on_the_fast_paths():
    """The "bytes" fault on the stream and shared-memory paths: answers that say more bytes than they carry."""
    stream_answer, local_call = stream_service.answer, local_server.LocalServer._call

    def cut_stream_answer(servicer, data):
        answer = stream_answer(servicer, data)
        return answer[:-2] if getattr(servicer, "fault", None) == "bytes" else answer

    def cut_local_answer(self, state, data, fds, flags):
        reply = local_call(self, state, data, fds, flags)
        if getattr(self._servicer, "fault", None) == "bytes" and reply.tensors:
            reply.tensors[0].nbytes -= 2
        return reply

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stream_service, "answer", cut_stream_answer)
        patch.setattr(local_server.LocalServer, "_call", cut_local_answer)
        yield


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    return request.param


def _dispatcher(store, transport, **kwargs):
    return bare_dispatcher(store, LAYERS, transport, **kwargs)


def _start(name, checkpoint, pairs, servicer_cls=ExpertGroupServicer):
    hosted = HostedExperts(checkpoint)
    hosted.load(pairs)
    servicer = servicer_cls(name, hosted)
    return GroupServer(servicer).start(), servicer


@pytest.fixture(scope="module")
def cluster(tiny_checkpoints):
    """g0: experts 0-1 of both layers; g1 and g2 (both faulty on demand): experts 2-3 of both layers."""
    path = tiny_checkpoints("mixtral")
    checkpoint = Checkpoint(path)
    low = [(layer, e) for layer in LAYERS for e in (0, 1)]
    high = [(layer, e) for layer in LAYERS for e in (2, 3)]
    servers = {
        "g0": _start("g0", checkpoint, low),
        "g1": _start("g1", checkpoint, high, FaultyServicer),
        "g2": _start("g2", checkpoint, high, FaultyServicer),
    }
    stock = experts_modules(AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager"))
    yield servers, stock
    for server, _ in servers.values():
        server.stop(0)


def _store(cluster, replicas_of_high=("g1", "g2")):
    servers, _ = cluster
    store = open_store("memory://")
    for name, (server, _) in servers.items():
        store.set_endpoint(name, f"127.0.0.1:{server.port}")
    _publish(store, replicas_of_high)
    return store


def _publish(store, replicas_of_high, drop=()):
    replicas = {(layer, e): ("g0",) if e < 2 else tuple(replicas_of_high) for layer in LAYERS for e in range(4)}
    for pair in drop:
        del replicas[pair]
    table = RoutingTable(version=store.routing_table_version() + 1, num_experts=4, replicas=replicas)
    assert store.publish_routing_table(table)


def _inputs(tokens=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, 32, generator=g)  # [T, H]
    index = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(tokens)])  # [T, 2]
    weights = torch.rand(tokens, 2, generator=g)
    return hidden, index, weights


def _check_exact(dispatcher, stock, layer=1, seed=0):
    hidden, index, weights = _inputs(seed=seed)
    got = dispatcher.dispatch(layer, hidden, index, weights)
    with torch.no_grad():
        expected = stock[layer][1](hidden, index, weights)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def _faulty(servicer):
    servicer.unstall = threading.Event()
    yield servicer
    servicer.fault = None
    servicer.unstall.set()  # whatever still hangs answers (into calls given up on)


@pytest.fixture
def faulty(cluster):
    yield from _faulty(cluster[0]["g1"][1])


@pytest.fixture
def faulty_replica(cluster):
    """g2, the other replica of g1's experts."""
    yield from _faulty(cluster[0]["g2"][1])


def test_dispatch_matches_stock_and_splits_replicated_experts(cluster, transport):
    dispatcher = _dispatcher(_store(cluster), transport)
    for layer in LAYERS:
        _check_exact(dispatcher, cluster[1], layer)
    sent = dispatcher.traffic.group_tokens()
    assert sent["g1"] > 0 and sent["g2"] > 0
    carried_by = {"grpc-unary": "grpc-unary", "grpc": "grpc-stream", "auto": "shm"}[transport]
    assert set(dispatcher.transports().values()) == {carried_by}
    assert set(dispatcher.queue_depths().values()) == {0}
    dispatcher.close()


@pytest.mark.parametrize("fault", ["nan", "shape", "dtype", "bytes"])
def test_a_bad_answer_fails_over_to_another_replica_in_the_same_step(cluster, faulty, fault, transport):
    dispatcher = _dispatcher(_store(cluster), transport)
    faulty.fault = fault
    for seed in range(3):
        _check_exact(dispatcher, cluster[1], seed=seed)
    assert set(dispatcher.queue_depths().values()) == {0}
    dispatcher.close()


def test_a_group_that_keeps_failing_is_skipped_once_its_breaker_opens(cluster, faulty, transport):
    dispatcher = _dispatcher(_store(cluster), transport, breakers=CircuitBreakers(threshold=2, cooldown_s=600))
    faulty.fault = "nan"
    before = faulty.calls
    for seed in range(5):
        _check_exact(dispatcher, cluster[1], seed=seed)
    assert faulty.calls - before == 2  # then the plan sends its replicas' tokens to g2 only
    dispatcher.close()

    alone = _dispatcher(_store(cluster, ("g1",)), transport, breakers=CircuitBreakers(threshold=1, cooldown_s=600))
    faulty.fault = None
    alone.breakers.failure("g1")
    _check_exact(alone, cluster[1])  # open, but the only holder of experts 2-3: still tried
    alone.close()


def test_a_hung_group_is_hedged_onto_its_other_replica_and_kept_out_at_once(cluster, faulty, transport):
    """g1 hangs (takes calls, never answers) holding experts 2-3, which g2 also holds. The step's slots g1 was
    given are sent to g2 once g1 has not answered within its hedge delay, and g2's answer is summed: exact, well
    within the 10 s group-call deadline. g1's breaker opens at once: the next step sends it nothing. (Before,
    each of the first steps waited the deadline out, then failed over.)"""
    dispatcher = _dispatcher(_store(cluster), transport, timeout_s=10.0, breakers=CircuitBreakers(cooldown_s=600))
    _check_exact(dispatcher, cluster[1])  # both replicas answer
    faulty.fault = "stall"
    before = faulty.calls
    started = time.monotonic()
    _check_exact(dispatcher, cluster[1], seed=1)
    assert time.monotonic() - started < 5, "the step waited for the hung group's deadline"
    assert faulty.calls > before, "g1 was given tokens of this step (and hung on them)"
    assert dispatcher.hedged == {("g1", "replicas"): 1}
    assert dispatcher.breakers.state("g1") is BreakerState.OPEN
    hung = faulty.calls
    started = time.monotonic()
    _check_exact(dispatcher, cluster[1], seed=2)
    assert time.monotonic() - started < 5 and faulty.calls == hung, "g1 was sent a call with its breaker open"
    assert set(dispatcher.queue_depths().values()) == {0}
    dispatcher.close()


def test_a_hung_group_is_hedged_onto_a_replica_whose_breaker_a_fault_before_left_open(cluster, faulty, transport):
    """Two faults back to back (bench chaos: a group killed and restarted, then another stopped): g2's breaker is
    still open from a failure that is over, g2 answers again, when g1 hangs. g1's slots have no replica on a group
    whose breaker is closed: they are hedged onto g2 all the same, which answers and closes its breaker. (Before,
    the step waited g1's deadline out.)"""
    dispatcher = _dispatcher(
        _store(cluster), transport, timeout_s=10.0, breakers=CircuitBreakers(threshold=1, cooldown_s=600)
    )
    _check_exact(dispatcher, cluster[1])
    dispatcher.breakers.failure("g2")  # a fault of g2's, over now; its cooldown is not
    assert dispatcher.breakers.state("g2") is BreakerState.OPEN
    faulty.fault = "stall"
    started = time.monotonic()
    _check_exact(dispatcher, cluster[1], seed=1)
    assert time.monotonic() - started < 5, "the step waited for the hung group's deadline"
    assert dispatcher.hedged == {("g1", "replicas"): 1}
    assert dispatcher.breakers.state("g2") is BreakerState.CLOSED, "g2's answer closed its breaker"
    dispatcher.close()


def _one_token(seed, experts):
    """One decode token choosing ``experts``: its slot of a replicated expert goes to the first replica listed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 32, generator=g), torch.tensor([experts]), torch.rand(1, len(experts), generator=g)


@pytest.mark.parametrize(
    "late_s, replica_late_s, answered",
    [(0.6, 0.0, "replicas"), (0.15, 0.8, "group")],
    ids=["the replica answers first", "the late group answers first"],
)
def test_a_hedged_call_sums_exactly_one_answer_and_drops_the_late_one(
    cluster, faulty, faulty_replica, transport, late_s, replica_late_s, answered
):
    """g1 answers every call late, g2 (the other replica of experts 2-3) answers its hedges on time or later
    still. Each decode token's expert-2 slot goes to g1 (listed first), is hedged onto g2 after the fixed 50 ms
    delay, and whichever answers first is summed, never both (both would count the slot twice): every step
    exact, and the loser's answer, which still comes, is dropped unread, also on the shared stream or
    connection of the next calls. A breaker with no cooldown lets every step try g1 again."""
    dispatcher = _dispatcher(
        _store(cluster),
        transport,
        timeout_s=10.0,
        hedge=HedgePolicy(min_delay_s=0.05, max_delay_s=0.05),
        breakers=CircuitBreakers(cooldown_s=0),
    )
    _, stock = cluster
    faulty.fault, faulty.late_s = "late", late_s
    faulty_replica.fault, faulty_replica.late_s = "late", replica_late_s
    steps = 4
    for seed in range(steps):
        hidden, index, weights = _one_token(seed, [seed % 2, 2])
        got = dispatcher.dispatch(1, hidden, index, weights)
        with torch.no_grad():
            torch.testing.assert_close(got, stock[1][1](hidden, index, weights), rtol=0, atol=1e-6)
    assert dispatcher.hedged == {("g1", answered): steps}
    # the losers' answers come in meanwhile; a fresh step on the same streams and connections is exact
    time.sleep(max(late_s, replica_late_s) + 0.2)
    faulty.fault = faulty_replica.fault = None
    _check_exact(dispatcher, stock, seed=9)
    assert set(dispatcher.queue_depths().values()) == {0}
    dispatcher.close()


def test_a_call_of_an_expert_with_no_other_replica_is_never_hedged(cluster, faulty, faulty_replica, transport):
    """Expert 2 is g1's alone (expert 3 is on g1 and g2). g1 answers late, past the 50 ms hedge delay: no other
    group could answer a call holding an expert-2 slot, so the step waits for g1, as before hedging, and is
    exact; nothing is sent to g2."""
    store = _store(cluster)
    holders = {0: ("g0",), 1: ("g0",), 2: ("g1",), 3: ("g1", "g2")}
    replicas = {(layer, e): holders[e] for layer in LAYERS for e in range(4)}
    assert store.publish_routing_table(RoutingTable(store.routing_table_version() + 1, 4, replicas))
    dispatcher = _dispatcher(store, transport, timeout_s=10.0, hedge=HedgePolicy(min_delay_s=0.05, max_delay_s=0.05))
    faulty.fault, faulty.late_s = "late", 0.4
    _, stock = cluster
    hidden, _, weights = _inputs()
    index = torch.tensor([[2, e % 2] for e in range(12)])  # [T, 2]: expert 2 and one of g0's
    before = faulty_replica.calls
    started = time.monotonic()
    got = dispatcher.dispatch(1, hidden, index, weights)
    assert time.monotonic() - started >= 0.4, "the step did not wait for the expert's only group"
    with torch.no_grad():
        torch.testing.assert_close(got, stock[1][1](hidden, index, weights), rtol=0, atol=1e-6)
    assert not dispatcher.hedged and faulty_replica.calls == before
    assert dispatcher.breakers.state("g1") is BreakerState.CLOSED
    dispatcher.close()


def test_a_stopped_group_process_is_hedged_and_its_trial_after_the_cooldown_too(cluster, tiny_checkpoints, tmp_path):
    """A real ``expertmesh group serve`` process g3 holds experts 2-3 beside g2, and is SIGSTOPped: its sockets
    take connections into their backlogs and it never answers. The router (the default transport: shared
    memory) hedges g3's call onto g2 after the hedge delay, each step exact and done in well under the 10 s
    group-call deadline; g3's breaker opens at once. After the cooldown one step tries g3 again: that call must
    dial a new shared-memory connection, whose handshake a stopped process never answers, so it is started off
    the step's thread and hedged like the first (it used to hold the step until the deadline)."""
    placement = tmp_path / "placement.yaml"
    placement.write_text("groups:\n  g3: {'*': [2, 3]}\n  g4: {'*': [0, 1]}\n")
    path = tiny_checkpoints("mixtral")
    (group,) = start_groups(["g3"], ["--model", str(path), "--placement", str(placement)]).values()
    store = _store(cluster, replicas_of_high=("g3", "g2"))
    store.set_endpoint("g3", group.address)
    dispatcher = _dispatcher(store, "auto", timeout_s=10.0, breakers=CircuitBreakers(cooldown_s=1.0))
    try:
        for seed in range(2):
            _check_exact(dispatcher, cluster[1], seed=seed)
        assert dispatcher.transports()["g3"] == "shm"
        os.kill(group.proc.pid, signal.SIGSTOP)
        wait_stopped(group.proc.pid)
        for seed in range(2, 5):
            started = time.monotonic()
            _check_exact(dispatcher, cluster[1], seed=seed)
            assert time.monotonic() - started < 5, f"step {seed} waited for the stopped group"
        assert dispatcher.hedged == {("g3", "replicas"): 1}, "once hedged, g3 was kept out"
        time.sleep(1.2)  # the cooldown: the next step tries g3
        started = time.monotonic()
        _check_exact(dispatcher, cluster[1], seed=5)
        assert time.monotonic() - started < 5, "the trial call held the step"
        assert dispatcher.hedged == {("g3", "replicas"): 2}
        assert dispatcher.breakers.state("g3") is BreakerState.OPEN
    finally:
        os.kill(group.proc.pid, signal.SIGCONT)
        dispatcher.close()
        group.stop()


@pytest.mark.parametrize(
    "fault, message",
    [
        ("nan", "NaN/Inf in its partial sums"),
        ("shape", "shape [12, 31], expected [12, 32]"),
        ("dtype", "torch.bfloat16 partial sums"),
        ("bytes", "undecodable tensor"),
    ],
)
def test_a_bad_answer_with_no_other_replica_fails_the_step_as_internal_naming_the_group(
    cluster, faulty, fault, message, transport
):
    dispatcher = _dispatcher(_store(cluster, replicas_of_high=("g1",)), transport)
    faulty.fault = fault
    hidden, _, weights = _inputs()
    index = torch.full((12, 2), 3)
    index[:, 0] = 0
    with pytest.raises(BadGroupResponse) as err:
        dispatcher.dispatch(1, hidden, index, weights)
    assert err.value.code == grpc.StatusCode.INTERNAL
    assert "expert group g1 answered layer 1" in str(err.value) and message in str(err.value)
    assert set(dispatcher.queue_depths().values()) == {0}
    faulty.fault = None
    _check_exact(dispatcher, cluster[1])  # the next step is fine again
    dispatcher.close()


def test_a_vanished_group_fails_over_or_fails_unavailable(cluster, tiny_checkpoints, transport):
    """A fourth group, stopped under the router: with a replica elsewhere its tokens go there."""
    checkpoint = Checkpoint(tiny_checkpoints("mixtral"))
    server, _ = _start("g3", checkpoint, [(layer, e) for layer in LAYERS for e in (2, 3)])
    store = _store(cluster, replicas_of_high=("g3", "g2"))
    store.set_endpoint("g3", f"127.0.0.1:{server.port}")
    dispatcher = _dispatcher(store, transport, timeout_s=1.0)
    dispatcher.watcher.refresh()
    server.stop(0)
    _check_exact(dispatcher, cluster[1])

    _publish(store, ("g3",))
    dispatcher.watcher.refresh()
    with pytest.raises(GroupUnavailable, match="expert group g3 at 127.0.0.1:.* failed layer 1: UNAVAILABLE"):
        dispatcher.dispatch(1, *_inputs())
    assert set(dispatcher.queue_depths().values()) == {0}
    dispatcher.close()


def test_a_vanished_group_back_at_a_new_address_gets_its_tokens_again_with_no_new_table(
    cluster, tiny_checkpoints, transport
):
    """g3 (experts 2-3, replicated on g2) stopped under the router, then started again on another port and
    registered there, as a Serve replica restarted on a returned node is: g2 serves its tokens meanwhile, the
    failed call makes the router look the groups' addresses up again, and the step its breaker lets try g3
    reaches it at its new address, the routing table unchanged."""
    checkpoint = Checkpoint(tiny_checkpoints("mixtral"))
    pairs = [(layer, e) for layer in LAYERS for e in (2, 3)]
    server, _ = _start("g3", checkpoint, pairs)
    store = _store(cluster, replicas_of_high=("g3", "g2"))
    store.set_endpoint("g3", f"127.0.0.1:{server.port}")
    dispatcher = _dispatcher(store, transport, breakers=CircuitBreakers(threshold=1, cooldown_s=0.2))
    dispatcher.watcher.refresh()
    version = dispatcher.watcher.version
    server.stop(0)
    _check_exact(dispatcher, cluster[1])  # g3 fails over to g2; the store still lists its old address
    back, servicer = _start("g3", checkpoint, pairs, FaultyServicer)
    assert back.port != server.port
    store.set_endpoint("g3", f"127.0.0.1:{back.port}")

    def g3_served() -> int:
        _check_exact(dispatcher, cluster[1])
        return servicer.calls

    wait_for(g3_served, "a call to g3 at its new address", timeout_s=20)
    assert dispatcher.watcher.version == version
    dispatcher.close()
    back.stop(0)


def test_a_group_of_another_checkpoint_is_refused_and_never_summed(cluster, tiny_checkpoints, transport):
    """g3 serves experts 2-3 from another checkpoint of the same shapes (a rolling upgrade, a wrong volume):
    its partial sums would pass the shape, dtype and finiteness checks. Every call names the router's
    checkpoint, so g3 refuses each one (FAILED_PRECONDITION, which is what an operator calling it sees) and
    its tokens go to g2 in the same step: exact. As their only replica, the step fails at once with
    UNAVAILABLE naming g3 and both checkpoints; Describe says which checkpoint a group holds."""
    path, foreign = tiny_checkpoints("mixtral"), tiny_checkpoints("mixtral", seed=1)
    ours, theirs = Checkpoint(path).spec.fingerprint, Checkpoint(foreign).spec.fingerprint
    assert ours != theirs
    server, servicer = _start(
        "g3", Checkpoint(foreign), [(layer, e) for layer in LAYERS for e in (2, 3)], FaultyServicer
    )
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        assert pb_grpc.ExpertGroupStub(channel).Describe(pb.DescribeRequest(), timeout=10).model_fingerprint == theirs
    store = _store(cluster, replicas_of_high=("g3", "g2"))
    store.set_endpoint("g3", f"127.0.0.1:{server.port}")
    dispatcher = _dispatcher(store, transport, model=ModelIdentity.of(Checkpoint(path).spec))
    for seed in range(4):
        _check_exact(dispatcher, cluster[1], seed=seed)
    assert servicer.calls > 0, "g3 was sent calls (and refused them)"

    _publish(store, ("g3",))
    dispatcher.watcher.refresh()
    started = time.monotonic()
    with pytest.raises(GroupUnavailable) as err:
        dispatcher.dispatch(1, *_inputs())
    assert time.monotonic() - started < 5, "a refusal is final: nothing is resent to a foreign group"
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert f"expert group g3 at 127.0.0.1:{server.port} refused layer 1" in str(err.value)
    assert f"holds checkpoint {theirs}" in str(err.value) and f"not the caller's {ours}" in str(err.value)
    assert set(dispatcher.queue_depths().values()) == {0}
    dispatcher.close()
    server.stop(0)


class _BlockingLookup:
    """The groups' addresses as Serve's directory gives them: it answers only once the restarting replica
    serves (``answer``), or fails with Ray's own error (``fail``). Records the threads it was called on."""

    def __init__(self):
        self.threads: set[str] = set()
        self.answer: dict[str, str] | None = None
        self.fail = False
        self._released = threading.Event()

    def release(self, answer: dict[str, str]) -> None:
        self.answer = answer
        self._released.set()

    def __call__(self) -> dict[str, str]:
        self.threads.add(threading.current_thread().name)
        if self.fail:
            raise RuntimeError("ray.exceptions.GetTimeoutError: Get timed out: some object(s) not ready")
        self._released.wait(30)
        if self.answer is None:
            raise TimeoutError("the directory did not answer")
        return self.answer


def test_a_sole_group_gone_fails_the_step_fast_and_its_address_is_looked_up_off_the_step(
    cluster, tiny_checkpoints, transport
):
    """g3 alone holds experts 2-3 and stops. The lookup of its new address waits (Serve's directory answers
    once a restarting replica serves) or fails with Ray's error: neither is ever on the step. The step fails
    within the sole-group wait with UNAVAILABLE naming g3; once its breaker is open, at once. When the lookup
    answers with g3's new address, a step reaches it there. (Before, the step thread made the lookup itself:
    every sequence waited for it past its deadline, and a Ray error failed the step as INTERNAL.)"""
    checkpoint = Checkpoint(tiny_checkpoints("mixtral"))
    pairs = [(layer, e) for layer in LAYERS for e in (2, 3)]
    server, _ = _start("g3", checkpoint, pairs)
    store = _store(cluster, replicas_of_high=("g3",))
    store.set_endpoint("g3", f"127.0.0.1:{server.port}")
    lookup = _BlockingLookup()
    dispatcher = _dispatcher(
        store,
        transport,
        resolve_endpoints=lookup,
        sole_group_wait_s=0.5,
        breakers=CircuitBreakers(threshold=2, cooldown_s=600),
    )
    dispatcher.watcher.refresh()
    _check_exact(dispatcher, cluster[1])
    server.stop(0)

    lookup.fail = True
    started = time.monotonic()
    with pytest.raises(GroupUnavailable) as err:
        dispatcher.dispatch(1, *_inputs())
    assert time.monotonic() - started < 5, "the step waited for more than the sole-group wait"
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "expert group g3 at 127.0.0.1:" in str(err.value) and "was not back within 0.5 s" in str(err.value)
    wait_for(lambda: lookup.threads, "the lookup, off the step")

    lookup.fail = False
    with pytest.raises(GroupUnavailable, match="expert group g3 .* failed steps in a row"):
        dispatcher.dispatch(1, *_inputs())  # the second failure opens its breaker: at once, no wait
    started = time.monotonic()
    with pytest.raises(GroupUnavailable, match="expert group g3 .* failed steps in a row"):
        dispatcher.dispatch(1, *_inputs())
    assert time.monotonic() - started < 5, "a step waited for the blocked lookup"
    assert threading.current_thread().name not in lookup.threads

    back, servicer = _start("g3", checkpoint, pairs, FaultyServicer)
    lookup.release({**store.endpoints(), "g3": f"127.0.0.1:{back.port}"})
    wait_for(lambda: dispatcher._transport.address("g3") == f"127.0.0.1:{back.port}", "g3's new address in use")
    # its breaker is open, but a group whose experts have no other replica is still tried
    _check_exact(dispatcher, cluster[1])
    assert servicer.calls > 0
    dispatcher.close()
    back.stop(0)


def test_a_table_leaving_an_expert_unhosted_is_refused_and_the_last_good_one_stays(cluster, transport):
    store = _store(cluster)
    dispatcher = _dispatcher(store, transport)
    dispatcher.watcher.refresh()
    good = dispatcher.watcher.table.version
    _publish(store, ("g1", "g2"), drop=[(1, 3)])
    dispatcher.watcher.refresh()
    assert dispatcher.watcher.table.version == good
    _check_exact(dispatcher, cluster[1])
    _publish(store, ("g2",))
    dispatcher.watcher.refresh()
    assert dispatcher.watcher.table.version == good + 2

    fresh_store = open_store("memory://")
    _publish(fresh_store, ("g2",), drop=[(0, 2)])
    with pytest.raises(UnhostedExperts, match="0/2"):
        _dispatcher(fresh_store, transport).watcher.refresh()
    dispatcher.close()


MODEL = ModelIdentity("0123456789abcdef", LAYERS, 4)


@pytest.fixture(scope="module")
def model(tiny_checkpoints) -> ModelIdentity:
    """The identity of the cluster's checkpoint: a router of another one is refused by its groups."""
    return ModelIdentity(Checkpoint(tiny_checkpoints("mixtral")).spec.fingerprint, LAYERS, 4)


def _publish_raw(store, table):
    """Publish ``table`` whatever it says (a misconfigured or foreign writer): compare-and-set on the version only."""
    kv, current = store._kv, store.routing_table_version()
    assert kv.compare_and_set_many(
        store._key("routing_table:version"),
        str(current).encode() if current else None,
        {
            store._key("routing_table"): table.to_json().encode(),
            store._key("routing_table:version"): str(table.version).encode(),
        },
    )


def test_a_table_for_another_model_is_refused_and_the_last_good_one_stays(cluster, transport, model):
    """Before tables carried the model: a 2-expert table over this 4-expert model dropped experts 2-3 with
    status OK, and one listing expert 7 failed every step with an IndexError (INTERNAL)."""
    store = _store(cluster)
    dispatcher = _dispatcher(store, transport, model=model)
    dispatcher.watcher.refresh()
    good = dispatcher.watcher.table.version
    low = {(layer, e): ("g0",) for layer in LAYERS for e in (0, 1)}
    bad_tables = {
        "2 experts per layer, not 4": RoutingTable(good + 1, 2, low),
        "pairs this model does not have": RoutingTable(
            good + 2, 4, {**dispatcher.watcher.table.replicas, (1, 7): ("g0",)}, model=model
        ),
        "checkpoint fingerprint ffffffffffffffff": RoutingTable(
            good + 3, 4, dispatcher.watcher.table.replicas, model=ModelIdentity("ffffffffffffffff", LAYERS, 4)
        ),
        "MoE layers 0-2, not 0,1": RoutingTable(
            good + 4, 4, dispatcher.watcher.table.replicas, model=ModelIdentity("", (0, 1, 2), 4)
        ),
    }
    for reason, table in bad_tables.items():
        _publish_raw(store, table)
        dispatcher.watcher.refresh()
        assert dispatcher.watcher.table.version == good, reason
        _check_exact(dispatcher, cluster[1])
        with pytest.raises(RoutingTableMismatch, match=reason) as err:
            _dispatcher(store, transport, model=model).watcher.refresh()  # a router with no table to keep: told why
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    # unreadable text in the table's key: refused the same way
    store._kv.compare_and_set_many(
        store._key("routing_table:version"),
        str(good + 4).encode(),
        {store._key("routing_table"): b'{"version": 9, "replicas": 3}', store._key("routing_table:version"): b"9"},
    )
    dispatcher.watcher.refresh()
    assert dispatcher.watcher.table.version == good
    _publish(store, ("g2",))  # a good table for this model again: taken
    dispatcher.watcher.refresh()
    assert dispatcher.watcher.table.version == 10
    dispatcher.close()


def test_a_flush_after_a_refused_table_keeps_the_last_good_one_serving(cluster, transport, model):
    """The refused version was remembered, so version 0 after a flush read as a new table that was not there:
    every step failed UNAVAILABLE."""
    store = _store(cluster)
    dispatcher = _dispatcher(store, transport, model=model)
    dispatcher.watcher.refresh()
    _publish_raw(store, RoutingTable(2, 2, {(layer, e): ("g0",) for layer in LAYERS for e in (0, 1)}))
    dispatcher.watcher.refresh()
    store._kv._values.clear(), store._kv._hashes.clear()  # FLUSHDB of the in-process store
    dispatcher.begin_step()
    assert dispatcher.watcher.table.version == 1
    _check_exact(dispatcher, cluster[1])
    _publish(store, ("g1", "g2"))  # republished after the flush, at the refused version's number: taken
    _publish(store, ("g1", "g2"))
    dispatcher.watcher.refresh()
    assert dispatcher.watcher.table.version == 2
    dispatcher.close()


def test_the_store_refuses_to_publish_one_models_table_over_anothers():
    store = open_store("memory://")
    replicas = {(layer, e): ("g0",) for layer in LAYERS for e in range(4)}
    assert store.publish_routing_table(RoutingTable(1, 4, replicas, model=MODEL))
    other = ModelIdentity("ffffffffffffffff", LAYERS, 4)
    with pytest.raises(
        StoreCollision, match="another deployment uses these keys; give each deployment its own --deployment"
    ):
        store.publish_routing_table(RoutingTable(2, 4, replicas, model=other))
    assert store.routing_table().model == MODEL
    assert store.publish_routing_table(RoutingTable(2, 4, replicas, model=MODEL))
    # deployments have keys of their own: the same Redis database holds both
    assert open_store("memory://", deployment="b").routing_table() is None


class _CountingStore:
    """A state store that counts the calls made from each thread."""

    def __init__(self, store):
        self._store, self.calls = store, Counter()

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.calls[threading.current_thread().name] += 1
            return attr(*args, **kwargs)

        return counted


def test_a_watched_router_steps_without_reading_the_store_and_serves_through_a_frozen_one(
    cluster, own_redis, transport, model
):
    """A redis-server stopped with SIGSTOP answers nothing until SIGCONT: reading the table version at every
    step waited out the client's socket timeout (5 s) each time. With the watcher the steps make no store call
    at all; the watcher backs off while the store is frozen and takes the new table once it answers again."""
    redis_store, proc = own_redis
    servers, stock = cluster
    for name, (server, _) in servers.items():
        redis_store.set_endpoint(name, f"127.0.0.1:{server.port}")
    _publish(redis_store, ("g1", "g2"))
    store = _CountingStore(redis_store)
    dispatcher = _dispatcher(store, transport, model=model, poll_s=0.05, max_backoff_s=0.2)
    dispatcher.watcher.refresh()
    watcher = dispatcher.watcher.start()
    try:
        step_thread = threading.current_thread().name
        before = store.calls[step_thread]
        proc.send_signal(signal.SIGSTOP)
        try:
            for seed in range(5):
                dispatcher.begin_step()
                _check_exact(dispatcher, stock, seed=seed)
            assert store.calls[step_thread] == before, "a step read the state store"
            deadline = time.monotonic() + 30
            while watcher.failures == 0:
                assert time.monotonic() < deadline, "the watcher never noticed the frozen store"
                time.sleep(0.05)
            assert watcher.next_wait() > 0.05  # backing off
        finally:
            proc.send_signal(signal.SIGCONT)
        _publish(redis_store, ("g2",))
        # the new table is swapped in during a round and the failure count cleared at its end: wait for both
        deadline = time.monotonic() + 30
        while dispatcher.watcher.table.version != 2 or watcher.failures:
            assert time.monotonic() < deadline, "the watcher never took the new table after the store came back"
            time.sleep(0.05)
        assert watcher.next_wait() == 0.05  # back to its interval
    finally:
        watcher.stop()
        dispatcher.close()
    assert not dispatcher.watcher.watched


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server of this test's own, so the test can kill it."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed: run through `make test`, which installs it")
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            store = open_store(f"redis://127.0.0.1:{port}/0")
            break
        except ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    yield store, proc
    proc.kill()
    proc.wait()


def test_an_unreachable_store_keeps_the_cached_table_serving(cluster, own_redis, transport):
    store, proc = own_redis
    servers, stock = cluster
    for name, (server, _) in servers.items():
        store.set_endpoint(name, f"127.0.0.1:{server.port}")
    _publish(store, ("g1", "g2"))
    dispatcher = _dispatcher(store, transport)
    dispatcher.watcher.refresh()
    proc.kill()
    proc.wait()
    dispatcher.watcher.refresh()  # logged, not raised
    _check_exact(dispatcher, stock)
    with pytest.raises(ConnectionError):
        _dispatcher(store, transport).watcher.refresh()  # nothing cached: the caller must know
    dispatcher.close()


def test_heartbeat_reports_the_served_version_and_the_watcher_refreshes_an_idle_router(cluster, transport):
    store = _store(cluster)
    heartbeat = Heartbeat(store, "router-a", interval_s=0.05)
    dispatcher = _dispatcher(store, transport, on_switch=heartbeat.beat, poll_s=0.05)
    dispatcher.watcher.refresh()
    assert store.router_heartbeats()["router-a"].table_version == 1  # before start: reported at once
    watcher = dispatcher.watcher
    heartbeat.start(lambda: watcher.version)  # from now on by its thread, woken by each switch
    watcher.start()
    _publish(store, ("g2",))
    deadline = time.monotonic() + 10
    while store.router_heartbeats()["router-a"].table_version != 2:
        assert time.monotonic() < deadline, "an idle router never switched to the new table"
        time.sleep(0.02)
    assert dispatcher.watcher.table.version == 2
    watcher.stop()
    heartbeat.stop()
    assert "router-a" not in store.router_heartbeats()
    dispatcher.close()


def test_group_calls_end_with_the_steps_last_request_deadline(cluster, faulty, transport):
    """The step's deadline (``StepContext.deadline``: its last request's) bounds every group call of it."""
    from expertmesh.router.dispatch.step_context import StepContext

    def step(deadline, tokens):
        return StepContext(torch.zeros(tokens, dtype=torch.long), [tokens], deadline=deadline)

    dispatcher = _dispatcher(_store(cluster, replicas_of_high=("g1",)), transport)
    hidden, index, weights = _inputs()
    with pytest.raises(DeadlineExceeded, match="before MoE layer 1") as err:
        dispatcher.dispatch(1, hidden, index, weights, step(time.monotonic() - 0.1, hidden.shape[0]))
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED

    faulty.fault = "hang"
    index = torch.full((12, 2), 3)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="expert group g1 did not answer layer 1"):
        dispatcher.dispatch(1, hidden, index, weights, step(time.monotonic() + 0.5, hidden.shape[0]))
    assert time.monotonic() - started < 2.5, "the call waited for the group instead of the requests' deadline"
    assert set(dispatcher.queue_depths().values()) == {0}
    faulty.fault = None
    dispatcher.close()


def test_a_flushed_store_keeps_routers_serving_and_heals_as_groups_register_again(cluster, transport):
    servers, stock = cluster
    store = _store(cluster)
    dispatcher = _dispatcher(store, transport)
    dispatcher.watcher.refresh()
    store._kv._values.clear(), store._kv._hashes.clear()  # FLUSHDB of the in-process backend
    dispatcher.watcher.refresh()
    assert dispatcher.watcher.table.version == 1
    _check_exact(dispatcher, stock)
    # The orchestrator restores the table at a later version before any group has re-registered.
    replicas = {(layer, e): ("g0",) if e < 2 else ("g1", "g2") for layer in LAYERS for e in range(4)}
    assert store.publish_routing_table(RoutingTable(version=5, num_experts=4, replicas=replicas))
    dispatcher.watcher.refresh()
    assert dispatcher.watcher.table.version == 5
    _check_exact(dispatcher, stock, seed=1)
    dispatcher.close()


def _quarantine(store, layer, expert, group, withdrawn=False):
    store.set_quarantined(QuarantinedReplica(layer, expert, group, "quarantined", "test", time.time(), withdrawn))


def test_a_quarantined_replica_gets_no_tokens_when_another_one_is_healthy(cluster, faulty, transport):
    store = _store(cluster)
    dispatcher = _dispatcher(store, transport)
    dispatcher.watcher.refresh()
    _quarantine(store, 1, 3, "g1")
    dispatcher.watcher.refresh_quarantine()
    before = faulty.calls
    hidden, _, weights = _inputs()
    index = torch.full((12, 2), 3)
    got = dispatcher.dispatch(1, hidden, index, weights)
    with torch.no_grad():
        torch.testing.assert_close(got, cluster[1][1][1](hidden, index, weights), rtol=0, atol=1e-6)
    assert faulty.calls == before, "the quarantined replica was called"
    _check_exact(dispatcher, cluster[1], layer=0)  # expert 3 of layer 0 still uses both
    assert faulty.calls > before
    store.clear_quarantined(1, 3, "g1")
    dispatcher.watcher.refresh_quarantine()
    assert dispatcher.watcher.view.fallback == {} and dispatcher.watcher.view.quarantined == frozenset()
    dispatcher.close()


def test_an_expert_with_every_replica_quarantined_is_renormalised_around_and_counted(cluster, faulty, transport):
    store = _store(cluster, replicas_of_high=("g1",))
    dispatcher = _dispatcher(store, transport, fallback="renormalise")
    dispatcher.watcher.refresh()
    _quarantine(store, 1, 3, "g1")
    dispatcher.watcher.refresh_quarantine()
    assert dispatcher.watcher.view.fallback == {1: frozenset({3})}
    hidden, index, weights = _inputs(seed=4)
    before = faulty.calls
    got = dispatcher.dispatch(1, hidden, index, weights)
    kept = torch.where(index == 3, 0.0, weights)
    renormalised = kept * (weights.sum(dim=1, keepdim=True) / kept.sum(dim=1, keepdim=True))
    with torch.no_grad():
        expected = cluster[1][1][1](hidden, index.clamp(max=3), renormalised)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    hits_expert_2 = bool((index == 2).any())
    assert (faulty.calls > before) == hits_expert_2, "only expert 2's tokens may reach g1"
    dispatcher.close()


def test_a_flushed_store_keeps_the_quarantines_until_a_table_is_back(cluster, faulty, transport):
    """Before: the first round after a flush read an empty ``quarantine`` hash and served the quarantined
    replica again (an expert's only one here) until the orchestrator published the entries again. Now a store
    without a table keeps the last quarantines; the orchestrator puts its entries back before any table."""
    store = _store(cluster, replicas_of_high=("g1",))
    dispatcher = _dispatcher(store, transport, fallback="renormalise")
    dispatcher.watcher.refresh()
    _quarantine(store, 1, 3, "g1")
    dispatcher.watcher.refresh_quarantine()
    store._kv._values.clear(), store._kv._hashes.clear()  # FLUSHDB of the in-process backend
    dispatcher.watcher.refresh_quarantine()
    dispatcher.watcher.refresh()
    assert dispatcher.watcher.view.fallback == {1: frozenset({3})}
    before = faulty.calls
    hidden, _, weights = _inputs()
    dispatcher.dispatch(1, hidden, torch.full((12, 2), 3), weights)
    assert faulty.calls == before, "the quarantined replica was called"
    # the orchestrator: the entries first, then the table (here: lifted since, so none comes back)
    _publish(store, ("g1",))
    dispatcher.watcher.refresh_quarantine()
    assert dispatcher.watcher.view.fallback == {} and dispatcher.watcher.view.quarantined == frozenset()
    dispatcher.close()


def test_next_best_fallback_equals_the_stock_model_whose_gate_never_picks_the_expert(
    cluster, tiny_checkpoints, transport
):
    """The router's whole model over real groups, against stock transformers with the same gate mask."""
    from expertmesh.router.assembly import assemble_router
    from expertmesh.router.policy.gate_hook import GateBias, masked

    path = tiny_checkpoints("mixtral")
    store = _store(cluster, replicas_of_high=("g1",))
    assembled = assemble_router(store, LAYERS, transports.build(transport), checkpoint=Checkpoint(path))
    dispatcher, router = assembled.dispatcher, assembled.model
    stock = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").eval()
    ids = torch.randint(3, 100, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = stock(input_ids=ids).logits
        GateBias(stock).set({1: masked(4, frozenset({3}))})
        expected = stock(input_ids=ids).logits
        torch.testing.assert_close(router(input_ids=ids).logits, plain, rtol=0, atol=1e-5)
        _quarantine(store, 1, 3, "g1")
        dispatcher.watcher.refresh_quarantine()
        got = router(input_ids=ids).logits
    assert not torch.allclose(expected, plain), "the mask changed nothing: a test that cannot fail"
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    dispatcher.close()


def test_the_watcher_backs_off_while_the_store_fails_and_says_a_problem_once(caplog, monkeypatch):
    """Pure timing logic and logging of TableWatcher's rounds, its store reads stood in for (no store, no groups)."""

    class Dispatcher:
        fail, refused = ConnectionError("refused"), None

        def refresh_quarantine(self):
            if self.fail:
                raise self.fail

        def refresh(self):
            if self.refused:
                raise self.refused

    dispatcher = Dispatcher()
    watcher = TableWatcher(open_store("memory://"), LAYERS, transports.build("grpc-unary"), max_backoff_s=5.0)
    monkeypatch.setattr(watcher, "refresh_quarantine", dispatcher.refresh_quarantine)
    monkeypatch.setattr(watcher, "refresh", dispatcher.refresh)
    waits = []
    for _ in range(7):
        assert watcher.poll_once() is False
        waits.append(watcher.next_wait())
    assert waits == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    dispatcher.fail = None
    dispatcher.refused = RoutingTableMismatch("routing table version 3 is for another model")
    with caplog.at_level("WARNING"):
        assert all(watcher.poll_once() for _ in range(5))
    assert watcher.next_wait() == 0.25
    assert sum("is for another model" in r.getMessage() for r in caplog.records) == 1


def test_a_new_table_waits_for_the_step_in_flight_before_it_is_served_or_reported():
    """The watcher builds views on its own thread. Swapped in mid-step and reported at once, a router said it
    served version N while its step still routed on N-1, and a migration then unloaded the old replica under
    that step: NOT_FOUND (found by test_migration_live)."""
    store = open_store("memory://")
    switches = []
    # a watcher whose thread is started but never polls here (an hour apart): the test makes its rounds
    dispatcher = _dispatcher(store, "grpc-unary", on_switch=switches.append, model=MODEL, poll_s=3600)
    replicas = {(layer, e): ("g0",) for layer in LAYERS for e in range(4)}
    store.publish_routing_table(RoutingTable(1, 4, replicas, model=MODEL))
    dispatcher.watcher.refresh()
    dispatcher.watcher.start()
    from expertmesh.router.dispatch.step_context import StepContext

    with dispatcher.step(StepContext(torch.zeros(1, dtype=torch.long), [1])) as step:
        store.publish_routing_table(RoutingTable(2, 4, {**replicas, (1, 3): ("g1",)}, model=MODEL))
        dispatcher.watcher.refresh()  # the watcher's round, during the step
        assert dispatcher.watcher.view.version == 1 and step.view.version == 1 and switches == [1]
    assert dispatcher.watcher.view.version == 1  # not before the next step boundary either
    dispatcher.begin_step()
    assert dispatcher.watcher.view.version == 2 and switches == [1, 2]
    dispatcher.watcher.refresh()  # nothing new: no second switch
    assert switches == [1, 2]
    dispatcher.watcher.stop()
    dispatcher.close()


def test_a_group_a_new_table_brings_is_prepared_before_the_table_is_served():
    """The first call to a group added live used to ask it how to reach it and dial it on a serving step; the
    watcher now does that (``Transport.prepare``) before it swaps the view in, once per group new to the table."""
    store = open_store("memory://")
    transport = transports.build("grpc-unary")
    prepared = []

    def prepare(group, timeout_s):
        prepared.append((group, watcher.view.version if watcher.view else None))

    transport.prepare = prepare
    watcher = TableWatcher(store, LAYERS, transport, model=MODEL)
    replicas = {(layer, e): ("g0",) for layer in LAYERS for e in range(4)}
    store.publish_routing_table(RoutingTable(1, 4, replicas, model=MODEL))
    watcher.refresh()
    store.publish_routing_table(RoutingTable(2, 4, {**replicas, (1, 3): ("g0", "g1")}, model=MODEL))
    watcher.refresh()
    store.publish_routing_table(RoutingTable(3, 4, {**replicas, (1, 3): ("g1",)}, model=MODEL))
    watcher.refresh()
    assert watcher.view.version == 3
    assert prepared == [("g0", None), ("g1", 1)]  # each before the view that brought it; g1 once
    transport.close()


def test_a_steps_load_is_counted_when_its_forward_is_done(cluster):
    """The load window counts a serving step's MoE layers together when the step's block ends: the counts of
    recording each layer's choices alone, positions included; nothing before the end; a step whose forward
    failed counts nothing (its tokens are routed again when the engine retries them). A dispatch outside any
    step counts at once."""
    from expertmesh.contracts.load_window import LoadWindow
    from expertmesh.router.dispatch.step_context import StepContext

    window, expected = LoadWindow(LAYERS, 4, 2), LoadWindow(LAYERS, 4, 2)
    dispatcher = _dispatcher(_store(cluster), TRANSPORTS[0], load_window=window)
    hidden, index, weights = _inputs()
    positions = torch.arange(12) * 300  # [T]
    dispatcher.begin_step()  # as the engine does before each step: the routing view is read
    with dispatcher.step(StepContext(positions, [12])):
        for layer in LAYERS:
            dispatcher.experts(layer, hidden, index.roll(layer, dims=0), weights)
        assert window.since_start().sum() == 0, "counted before the step's forward was done"
    for layer in LAYERS:
        expected.record(layer, index.roll(layer, dims=0), positions)
    got, want = window.snapshot(), expected.snapshot()
    assert got.load.sum() == 2 * 12 * 2
    assert all(np.array_equal(getattr(got, n), getattr(want, n)) for n in ("load", "coactivation", "position_load"))

    with pytest.raises(RuntimeError, match="the forward failed"):
        with dispatcher.step(StepContext(positions, [12])):
            dispatcher.experts(0, hidden, index, weights)
            raise RuntimeError("the forward failed")
    assert np.array_equal(window.since_start(), expected.since_start())

    dispatcher.dispatch(1, hidden, index, weights)
    expected.record(1, index)
    assert np.array_equal(window.since_start(), expected.since_start())
    dispatcher.close()
