"""The router's dispatcher against real expert-group gRPC servers on loopback (no Ray):
exact against stock transformers, and never a wrong answer with status OK.

Faults are injected at the group's gRPC servicer (a subclass whose Dispatch answers
with NaN, a wrong shape or a wrong dtype), by stopping a group's server, by
publishing a routing table that leaves an expert unhosted, and by killing a real
redis-server under a router that has a table cached.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from expertmesh import wire
from expertmesh.checkpoint import Checkpoint, experts_modules
from expertmesh.errors import BadGroupResponse, GroupUnavailable, UnhostedExperts
from expertmesh.expert_group.hosted import HostedExperts
from expertmesh.expert_group.service import ExpertGroupServicer, start_server
from expertmesh.router.circuit import CircuitBreakers
from expertmesh.router.dispatch import ExpertDispatcher
from expertmesh.router.heartbeat import Heartbeat
from expertmesh.routing_table import RoutingTable
from expertmesh.state import open_store
from expertmesh.v1 import experts_pb2 as pb
from tests.helpers import free_port

LAYERS = (0, 1)


class FaultyServicer(ExpertGroupServicer):
    """A group whose Dispatch computes correctly and then corrupts its answer (``fault``), as a
    group with overwritten weights or a buggy build would."""

    fault: str | None = None
    calls = 0

    def Dispatch(self, request, context):
        self.calls += 1
        response = super().Dispatch(request, context)
        partial = wire.decode(response.partial_sums)
        if self.fault == "nan":
            partial[0, 0] = float("nan")
        elif self.fault == "shape":
            partial = partial[:, :-1]
        elif self.fault == "dtype":
            partial = partial.double().float().to(torch.bfloat16)
        elif self.fault == "bytes":
            response.partial_sums.data = response.partial_sums.data[:-2]
            return response
        return pb.DispatchResponse(partial_sums=wire.encode(partial))


def _start(name, checkpoint, pairs, servicer_cls=ExpertGroupServicer):
    hosted = HostedExperts(checkpoint)
    hosted.load(pairs)
    from expertmesh.grpc_server import GrpcServer
    from expertmesh.expert_group.service import CHANNEL_OPTIONS, SERVICE_NAME
    from expertmesh.v1 import experts_pb2_grpc as pb_grpc

    server = GrpcServer("expert-group", "127.0.0.1", 0, 4, options=CHANNEL_OPTIONS)
    servicer = servicer_cls(name, hosted)
    pb_grpc.add_ExpertGroupServicer_to_server(servicer, server.server)
    server.start((SERVICE_NAME,))
    return server, servicer


@pytest.fixture(scope="module")
def cluster(tiny_checkpoints):
    """g0: experts 0-1 of both layers; g1 and g2 (faulty on demand): experts 2-3 of both layers."""
    path = tiny_checkpoints("mixtral")
    checkpoint = Checkpoint(path)
    low = [(layer, e) for layer in LAYERS for e in (0, 1)]
    high = [(layer, e) for layer in LAYERS for e in (2, 3)]
    servers = {
        "g0": _start("g0", checkpoint, low),
        "g1": _start("g1", checkpoint, high, FaultyServicer),
        "g2": _start("g2", checkpoint, high),
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


@pytest.fixture
def faulty(cluster):
    servicer = cluster[0]["g1"][1]
    yield servicer
    servicer.fault = None


def test_dispatch_matches_stock_and_splits_replicated_experts(cluster):
    dispatcher = ExpertDispatcher(_store(cluster), LAYERS)
    for layer in LAYERS:
        _check_exact(dispatcher, cluster[1], layer)
    sent = dispatcher.traffic.group_tokens()
    assert sent["g1"] > 0 and sent["g2"] > 0
    assert set(dispatcher.queue_depths().values()) == {0}
    dispatcher.close()


@pytest.mark.parametrize("fault", ["nan", "shape", "dtype", "bytes"])
def test_a_bad_answer_fails_over_to_another_replica_in_the_same_step(cluster, faulty, fault):
    dispatcher = ExpertDispatcher(_store(cluster), LAYERS)
    faulty.fault = fault
    for seed in range(3):
        _check_exact(dispatcher, cluster[1], seed=seed)
    assert set(dispatcher.queue_depths().values()) == {0}
    dispatcher.close()


def test_a_group_that_keeps_failing_is_skipped_once_its_breaker_opens(cluster, faulty):
    dispatcher = ExpertDispatcher(_store(cluster), LAYERS, breakers=CircuitBreakers(threshold=2, cooldown_s=600))
    faulty.fault = "nan"
    before = faulty.calls
    for seed in range(5):
        _check_exact(dispatcher, cluster[1], seed=seed)
    assert faulty.calls - before == 2  # then the plan sends its replicas' tokens to g2 only
    dispatcher.close()

    alone = ExpertDispatcher(_store(cluster, ("g1",)), LAYERS, breakers=CircuitBreakers(threshold=1, cooldown_s=600))
    faulty.fault = None
    alone.breakers.failure("g1")
    _check_exact(alone, cluster[1])  # open, but the only holder of experts 2-3: still tried
    alone.close()


@pytest.mark.parametrize(
    "fault, message",
    [("nan", "NaN/Inf in its partial sums"), ("shape", "shape [12, 31], expected [12, 32]"),
     ("dtype", "torch.bfloat16 partial sums"), ("bytes", "undecodable tensor")],
)
def test_a_bad_answer_with_no_other_replica_fails_the_step_as_internal_naming_the_group(cluster, faulty, fault, message):
    dispatcher = ExpertDispatcher(_store(cluster, replicas_of_high=("g1",)), LAYERS)
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


def test_a_vanished_group_fails_over_or_fails_unavailable(cluster, tiny_checkpoints):
    """A fourth group, stopped under the router: with a replica elsewhere its tokens go there."""
    checkpoint = Checkpoint(tiny_checkpoints("mixtral"))
    server, _ = _start("g3", checkpoint, [(layer, e) for layer in LAYERS for e in (2, 3)])
    store = _store(cluster, replicas_of_high=("g3", "g2"))
    store.set_endpoint("g3", f"127.0.0.1:{server.port}")
    dispatcher = ExpertDispatcher(store, LAYERS, timeout_s=1.0)
    dispatcher.refresh()
    server.stop(0)
    _check_exact(dispatcher, cluster[1])

    _publish(store, ("g3",))
    dispatcher.refresh()
    with pytest.raises(GroupUnavailable, match="expert group g3 at 127.0.0.1:.* failed layer 1: UNAVAILABLE"):
        dispatcher.dispatch(1, *_inputs())
    assert set(dispatcher.queue_depths().values()) == {0}
    dispatcher.close()


def test_a_table_leaving_an_expert_unhosted_is_refused_and_the_last_good_one_stays(cluster):
    store = _store(cluster)
    dispatcher = ExpertDispatcher(store, LAYERS)
    dispatcher.refresh()
    good = dispatcher.table.version
    _publish(store, ("g1", "g2"), drop=[(1, 3)])
    dispatcher.refresh()
    assert dispatcher.table.version == good
    _check_exact(dispatcher, cluster[1])
    _publish(store, ("g2",))
    dispatcher.refresh()
    assert dispatcher.table.version == good + 2

    fresh_store = open_store("memory://")
    _publish(fresh_store, ("g2",), drop=[(0, 2)])
    with pytest.raises(UnhostedExperts, match="0/2"):
        ExpertDispatcher(fresh_store, LAYERS).refresh()
    dispatcher.close()


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server of this test's own, so the test can kill it."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed: run through `make test`, which installs it")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
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


def test_an_unreachable_store_keeps_the_cached_table_serving(cluster, own_redis):
    store, proc = own_redis
    servers, stock = cluster
    for name, (server, _) in servers.items():
        store.set_endpoint(name, f"127.0.0.1:{server.port}")
    _publish(store, ("g1", "g2"))
    dispatcher = ExpertDispatcher(store, LAYERS)
    dispatcher.refresh()
    proc.kill()
    proc.wait()
    dispatcher.refresh()  # logged, not raised
    _check_exact(dispatcher, stock)
    with pytest.raises(ConnectionError):
        ExpertDispatcher(store, LAYERS).refresh()  # nothing cached: the caller must know
    dispatcher.close()


def test_heartbeat_reports_the_served_version_and_refreshes_an_idle_router(cluster):
    store = _store(cluster)
    heartbeat = Heartbeat(store, "router-a", interval_s=0.05)
    dispatcher = ExpertDispatcher(store, LAYERS, on_switch=heartbeat.beat)
    dispatcher.refresh()
    assert store.router_heartbeats()["router-a"].table_version == 1
    heartbeat.start(dispatcher)
    _publish(store, ("g2",))
    deadline = time.monotonic() + 10
    while store.router_heartbeats()["router-a"].table_version != 2:
        assert time.monotonic() < deadline, "an idle router never switched to the new table"
        time.sleep(0.02)
    assert dispatcher.table.version == 2
    heartbeat.stop()
    assert "router-a" not in store.router_heartbeats()
    dispatcher.close()
