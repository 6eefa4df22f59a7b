"""Every transport carries a group's share of a layer exactly: the same partial sums,
bit for bit, as unary Dispatch. Real group servers on loopback (no Ray), a real
router-side transport per case; also which path each transport takes, what
Describe reports about it, shared buffers sized from the message and freed, socket
files that go with the group (stopped or not) and are looked up again when a group
restarts at its address, and the gRPC stream under mutual TLS."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from expertmesh.expert_group.service import ExpertGroupServicer, GroupServer
from expertmesh.infra.group_channels import GroupClients, group_channel
from expertmesh.models.checkpoint import Checkpoint
from expertmesh.models.hosted_experts import HostedExperts
from expertmesh.router.transport import build
from expertmesh.router.transport import local as transport_local
from expertmesh.router.transport.auto import AutoTransport
from expertmesh.router.transport.base import TRANSPORTS, GroupRequest, TransportError
from expertmesh.router.transport.in_process import WIDE_CALL_ROWS
from expertmesh.v1 import experts_pb2 as pb
from expertmesh.v1 import experts_pb2_grpc as pb_grpc
from helpers import wait_for
from test_security import pki  # noqa: F401  (that module's certificate fixture, reused)

LAYER = 1
KIND = {"grpc-unary": "grpc-unary", "grpc": "grpc-stream", "auto": "shm"}


def _group(checkpoint, name="g0", dtype=torch.float32, **server):
    hosted = HostedExperts(checkpoint, dtype=dtype)
    hosted.load([(layer, e) for layer in checkpoint.spec.moe_layers for e in range(checkpoint.spec.num_experts)])
    server = GroupServer(ExpertGroupServicer(name, hosted), **server).start()
    return server, f"127.0.0.1:{server.port}"


@pytest.fixture(scope="module", params=["mixtral", "gpt_oss"])
def served(request, tiny_checkpoints):
    checkpoint = Checkpoint(tiny_checkpoints(request.param))
    server, address = _group(checkpoint)
    yield checkpoint, address, server
    server.stop(0)


def _request(checkpoint, tokens: int, seed: int, dtype=torch.float32) -> GroupRequest:
    g = torch.Generator().manual_seed(seed)
    spec = checkpoint.spec
    hidden = torch.randn(tokens + 3, spec.hidden_size, generator=g).to(dtype)  # [T, H]: the group gets T - 3 rows
    rows = torch.randperm(tokens + 3, generator=g)[:tokens].sort().values  # [Tg]
    ids = torch.stack([torch.randperm(spec.num_experts, generator=g)[: spec.top_k] for _ in range(tokens)])  # [Tg, K]
    ids[torch.rand(ids.shape, generator=g) < 0.2] = -1
    weights = torch.rand(ids.shape, generator=g).to(dtype)
    return GroupRequest(LAYER, 1, hidden, rows, ids.to(torch.int32), weights)


def _call(transport, request, group="g0"):
    reply = transport.send(group, request, 30).result()
    assert not reply.problem
    return reply.partial


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_every_transport_gives_the_unary_paths_partial_sums_bit_for_bit(served, tokens):
    checkpoint, address, _ = served
    answers = {}
    for name in TRANSPORTS:
        transport = build(name)
        transport.update({"g0": address})
        try:
            answers[name] = [_call(transport, _request(checkpoint, tokens, seed)) for seed in range(3)]
            assert transport.kind("g0") == KIND[name]
        finally:
            transport.close()
    for name in TRANSPORTS:
        for got, expected in zip(answers[name], answers["grpc-unary"]):
            assert got.shape == (tokens, checkpoint.spec.hidden_size) and torch.equal(got, expected), name


def test_bfloat16_groups_are_exact_on_every_transport(tiny_checkpoints):
    checkpoint = Checkpoint(tiny_checkpoints("mixtral"))
    server, address = _group(checkpoint, dtype=torch.bfloat16)
    try:
        answers = {}
        for name in TRANSPORTS:
            transport = build(name)
            transport.update({"g0": address})
            answers[name] = _call(transport, _request(checkpoint, 9, 0, torch.bfloat16))
            transport.close()
        assert answers["auto"].dtype == torch.bfloat16
        assert all(torch.equal(a, answers["grpc-unary"]) for a in answers.values())
    finally:
        server.stop(0)


def test_describe_reports_the_transports_in_use_and_the_peak_memory(served):
    checkpoint, address, _ = served
    transports = {name: build(name) for name in TRANSPORTS}
    for transport in transports.values():
        transport.update({"g0": address})
        _call(transport, _request(checkpoint, 2, 0))
    with group_channel(address) as channel:
        described = pb_grpc.ExpertGroupStub(channel).Describe(pb.DescribeRequest(), timeout=30)
    use = {u.transport: u for u in described.transports}
    assert {"grpc-unary", "grpc-stream", "shm"} <= set(use)
    assert use["shm"].connections >= 1 and use["grpc-stream"].connections >= 1 and use["grpc-unary"].connections == 0
    assert all(u.calls >= 1 for u in use.values())
    assert described.peak_rss_bytes > 50 * 2**20  # torch alone is more
    assert list(described.transports_offered) == ["shm", "grpc-stream", "grpc-unary"]
    for transport in transports.values():
        transport.close()


def _use(address: str) -> dict:
    with group_channel(address) as channel:
        described = pb_grpc.ExpertGroupStub(channel).Describe(pb.DescribeRequest(), timeout=30)
    return {u.transport: (u.connections, u.calls) for u in described.transports}


def test_prepare_sets_up_the_first_calls_path_ahead_of_it_and_never_raises(tiny_checkpoints):
    """What the table watcher does for a group a new routing table brings: the handshake and the connection made
    before the table is served; the first call then takes that connection instead of dialling on a step."""
    checkpoint = Checkpoint(tiny_checkpoints("mixtral"))
    server, address = _group(checkpoint)
    try:
        for name, kind in (("auto", "shm"), ("grpc", "grpc-stream")):
            transport = build(name)
            transport.update({"g0": address, "gone": "127.0.0.1:1"})
            try:
                assert transport.kind("g0") == ""
                transport.prepare("g0", 10.0)
                assert transport.kind("g0") == kind
                # the server counts a stream once its handler has run, a moment after the client opened it
                connections, calls = wait_for(lambda: _use(address).get(kind), f"the group to count its {kind}", 10)
                assert connections >= 1 and calls == 0
                _call(transport, _request(checkpoint, 3, 0))
                assert _use(address)[kind] == (connections, 1)  # the prepared connection carried it
                started = time.monotonic()
                transport.prepare("gone", 0.5)  # nobody there: logged at debug, the first call will say
                transport.prepare("unknown", 0.5)  # no address at all
                assert time.monotonic() - started < 5
            finally:
                transport.close()
    finally:
        server.stop(0)


def test_a_group_without_same_host_paths_is_reached_by_its_tcp_stream(tiny_checkpoints):
    checkpoint = Checkpoint(tiny_checkpoints("mixtral"))
    server, address = _group(checkpoint, same_host=False)
    transport = build("auto")
    transport.update({"g0": address})
    try:
        _call(transport, _request(checkpoint, 3, 0))
        assert transport.kind("g0") == "grpc-stream"
        with group_channel(address) as channel:
            described = pb_grpc.ExpertGroupStub(channel).Describe(pb.DescribeRequest(), timeout=30)
        assert list(described.transports_offered) == ["grpc-stream", "grpc-unary"]
    finally:
        transport.close()
        server.stop(0)


def test_a_group_on_another_host_gets_no_same_host_path(tiny_checkpoints):
    """Its sockets may even exist here: another kernel's boot id is enough to keep to TCP."""
    checkpoint = Checkpoint(tiny_checkpoints("mixtral"))
    server, address = _group(checkpoint)
    server.servicer.transports.host_id = "boot-id-of-another-host"
    transport = build("auto")
    transport.update({"g0": address})
    try:
        _call(transport, _request(checkpoint, 3, 0))
        assert transport.kind("g0") == "grpc-stream"
        assert [p.name for p in transport._routes["g0"].paths] == ["grpc-stream", "grpc-unary"]
    finally:
        transport.close()
        server.stop(0)


def _memfd_mappings() -> int:
    """Mappings of this process that are expertmesh's shared buffers (router and groups alike here)."""
    with open("/proc/self/maps") as maps:
        return sum("memfd:expertmesh-dispatch" in line for line in maps)


def _memfd_descriptors() -> int:
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return sum(link.startswith("/memfd:expertmesh-dispatch") for link in links)


def _buffer_bytes(transport) -> int:
    """Size of the buffer of the idle shared-memory connection to g0."""
    (conn,) = transport._routes["g0"].paths[0]._idle
    return conn.shared.buffer.numel()


def test_shared_buffers_follow_the_message_size_and_leave_nothing_behind(served, monkeypatch):
    checkpoint, address, _ = served
    monkeypatch.setattr(transport_local, "SHRINK_AFTER", 3)
    dev_shm = set(os.listdir("/dev/shm"))
    # counted against what the process held before: a router another test left open is not this test's leak
    mappings, descriptors = _memfd_mappings(), _memfd_descriptors()
    transport = build("auto")
    transport.update({"g0": address})
    _call(transport, _request(checkpoint, 1, 0))
    assert _buffer_bytes(transport) == transport_local.MIN_BUFFER_BYTES
    _call(transport, _request(checkpoint, 3000, 1))  # [3000, H] rows and their answer: a larger buffer
    grown = _buffer_bytes(transport)
    assert grown > transport_local.MIN_BUFFER_BYTES and grown & (grown - 1) == 0
    for seed in range(4):  # small calls again: after SHRINK_AFTER of them the buffer is replaced by a small one
        _call(transport, _request(checkpoint, 1, seed))
    assert _buffer_bytes(transport) == transport_local.MIN_BUFFER_BYTES
    transport.close()
    deadline = time.monotonic() + 10
    while (_memfd_mappings() > mappings or _memfd_descriptors() > descriptors) and time.monotonic() < deadline:
        gc.collect()  # the group lets go of its mapping on its connection's thread
        time.sleep(0.05)
    assert _memfd_mappings() <= mappings and _memfd_descriptors() <= descriptors
    assert set(os.listdir("/dev/shm")) == dev_shm, "shared memory must never leave a /dev/shm entry"


def test_socket_files_go_with_the_server(tiny_checkpoints):
    checkpoint = Checkpoint(tiny_checkpoints("mixtral"))
    server, _ = _group(checkpoint)
    paths = [Path(server.servicer.transports.shm_socket), Path(server.servicer.transports.grpc_unix_address[5:])]
    assert all(p.is_socket() for p in paths) and oct(paths[0].stat().st_mode & 0o777) == "0o600"
    server.stop(0)
    assert not any(p.exists() for p in paths)


_EXIT_WITHOUT_STOP = """
import sys
from expertmesh.models.checkpoint import Checkpoint
from expertmesh.models.hosted_experts import HostedExperts
from expertmesh.expert_group.service import ExpertGroupServicer, GroupServer

server = GroupServer(ExpertGroupServicer("g0", HostedExperts(Checkpoint(sys.argv[1])))).start()
print(server.servicer.transports.shm_socket, server.servicer.transports.grpc_unix_address[5:], flush=True)
sys.exit(0)  # never stopped, as when a Serve replica's actor is torn down
"""


def test_socket_files_go_when_the_group_process_exits_without_stopping(tiny_checkpoints):
    path = tiny_checkpoints("mixtral")
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_WITHOUT_STOP, str(path)], check=False, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    paths = [Path(p) for p in done.stdout.split()]
    assert len(paths) == 2 and all(p.parent == paths[0].parent for p in paths)
    assert not any(p.exists() for p in paths)


def test_a_group_restarted_at_its_address_is_reached_by_its_new_paths(tiny_checkpoints):
    """The router used to keep the old process's socket paths for as long as the address stayed
    the same: calls went by the TCP stream, and back to the dead socket every RETRY_PATH_S."""
    checkpoint = Checkpoint(tiny_checkpoints("mixtral"))
    server, address = _group(checkpoint)
    transport = build("auto")
    transport.update({"g0": address})
    try:
        expected = _call(transport, _request(checkpoint, 3, 0))
        assert transport.kind("g0") == "shm"
        old = server.servicer.transports.shm_socket
        server.stop(0)
        server, _ = _group(checkpoint, port=int(address.rsplit(":", 1)[1]))
        assert server.servicer.transports.shm_socket != old
        # The first call finds the old sockets gone (and the TCP channel may still be reconnecting);
        # the group is then asked again how to reach it.
        for _ in range(50):
            try:
                got = _call(transport, _request(checkpoint, 3, 0))
            except TransportError as err:
                assert err.code == grpc.StatusCode.UNAVAILABLE
                time.sleep(0.2)
                continue
            assert torch.equal(got, expected)
            if transport.kind("g0") == "shm":
                break
        assert transport.kind("g0") == "shm"
        assert transport._routes["g0"].paths[0]._path == server.servicer.transports.shm_socket
    finally:
        transport.close()
        server.stop(0)


def test_the_grpc_stream_works_under_mutual_tls(pki, tiny_checkpoints):  # noqa: F811
    checkpoint = Checkpoint(tiny_checkpoints("mixtral"))
    server, address = _group(checkpoint, tls=pki.server())
    try:
        expected = None
        for shared_memory in (False, True):
            transport = AutoTransport(shared_memory=shared_memory, clients=GroupClients(pki.client("router")))
            transport.update({"g0": address})
            got = _call(transport, _request(checkpoint, 5, 0))
            assert transport.kind("g0") == ("shm" if shared_memory else "grpc-stream")
            expected = got if expected is None else expected
            assert torch.equal(got, expected)
            transport.close()
        plaintext = build("grpc")  # no certificate: neither Transports nor any stream gets through
        plaintext.update({"g0": address})
        with pytest.raises(Exception) as err:
            _call(plaintext, _request(checkpoint, 5, 0))
        assert getattr(err.value, "code", None) == grpc.StatusCode.UNAVAILABLE
        plaintext.close()
    finally:
        server.stop(0)


def _in_this_process(server):
    """``InProcessGroups.lookup`` over one group server of this process: its servicer by its shared-memory token."""
    groups = {server.local.token: server.servicer}
    return groups, groups.get


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_a_group_in_this_process_is_called_in_place_with_the_unary_paths_partial_sums(served, tokens):
    """``up --groups-as in-process``: ``auto`` finds the group by the token its server drew and calls its compute
    on this thread; the partial sums are unary Dispatch's bit for bit, and the group counts the calls."""
    checkpoint, address, server = served
    _, lookup = _in_this_process(server)
    unary, in_place = build("grpc-unary"), build("auto", lookup)
    for transport in (unary, in_place):
        transport.update({"g0": address})
    try:
        calls_before = _use(address).get("in-process", (0, 0))[1]
        for seed in range(3):
            request = _request(checkpoint, tokens, seed)
            expected, got = _call(unary, request), _call(in_place, request)
            assert got.shape == (tokens, checkpoint.spec.hidden_size) and torch.equal(got, expected)
        assert in_place.kind("g0") == "in-process"
        assert [p.name for p in in_place._routes["g0"].paths][:2] == ["in-process", "shm"]
        assert _use(address)["in-process"][1] == calls_before + 3
    finally:
        unary.close()
        in_place.close()


def _computing_threads(server, monkeypatch) -> list[str]:
    """The names of the threads the group's ``compute`` runs on from now, in order (filled as calls come)."""
    computed_on: list[str] = []
    compute = server.servicer.compute

    def watched(*args, **kwargs):
        computed_on.append(threading.current_thread().name)
        return compute(*args, **kwargs)

    monkeypatch.setattr(server.servicer, "compute", watched)
    return computed_on


def test_calls_in_place_side_by_side_give_the_same_partial_sums_and_refusals(served, monkeypatch):
    """``side_by_side=2`` (``router.in_process_side_by_side``, two groups here): of two calls sent before either
    is read, a lane computes one and the reading thread the other; every partial sum is unary Dispatch's bit for
    bit, and a refusal computed on the lane comes back from ``result()`` with unary's status and message."""
    checkpoint, address, server = served
    _, lookup = _in_this_process(server)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(2)  # one lane at one intra-op thread, the reading thread narrowed to one beside it
    unary, in_place = build("grpc-unary"), build("auto", lookup, side_by_side=2)
    computed_on = _computing_threads(server, monkeypatch)
    for transport in (unary, in_place):
        transport.update({"g0": address})
    try:
        for seed in range(3):
            # below WIDE_CALL_ROWS, so queued: the first long enough for the lane to wake and take it
            requests = [_request(checkpoint, WIDE_CALL_ROWS - 1, seed), _request(checkpoint, 7, seed + 10)]
            pending = [in_place.send("g0", r, 30) for r in requests]  # both queued before either is read
            got = [p.result() for p in pending]
            for request, reply in zip(requests, got):
                assert not reply.problem and torch.equal(reply.partial, _call(unary, request))
        assert in_place.kind("g0") == "in-process"
        lanes = [name for name in computed_on if name.startswith("expertmesh-lane")]
        mine = [name for name in computed_on if name == threading.current_thread().name]
        assert lanes and mine, computed_on  # both sides computed (each pair: the lane the first, this thread one)
        assert torch.get_num_threads() == 2  # this thread's threads back after computing beside the lane
        good = _request(checkpoint, 4, 0)
        wrong = GroupRequest(checkpoint.spec.num_layers + 7, 1, good.hidden, good.tokens, good.expert_ids, good.weights)
        errors = []
        for transport in (unary, in_place):
            pending = [transport.send("g0", wrong, 30), transport.send("g0", good, 30)]
            with pytest.raises(TransportError) as err:
                pending[0].result()
            errors.append(err.value)
            assert not pending[1].result().problem  # the other call of the layer is answered all the same
        assert errors[0].code == errors[1].code != grpc.StatusCode.OK and errors[1].details == errors[0].details
    finally:
        unary.close()
        in_place.close()
        torch.set_num_threads(threads_before)


def test_lanes_take_the_routers_threads_even_from_a_narrowed_first_call(served, monkeypatch):
    """With ``threads`` given (the router's, ``platform.data_plane``), the lanes are made from them even when the
    first call comes from a thread narrowed to one (a small engine step: ``infra.cpu_threads.one_thread_while``),
    which alone would give no lane at all."""
    checkpoint, address, server = served
    _, lookup = _in_this_process(server)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    in_place = build("auto", lookup, side_by_side=2, threads=2)
    computed_on = _computing_threads(server, monkeypatch)
    in_place.update({"g0": address})
    try:
        for seed in range(3):
            requests = [_request(checkpoint, WIDE_CALL_ROWS - 1, seed), _request(checkpoint, 7, seed + 10)]
            for p in [in_place.send("g0", r, 30) for r in requests]:
                assert not p.result().problem
        assert any(name.startswith("expertmesh-lane") for name in computed_on), computed_on
        assert torch.get_num_threads() == 1  # this thread's setting as it was
    finally:
        in_place.close()
        torch.set_num_threads(threads_before)


def test_a_wide_call_in_place_is_computed_by_its_sender_at_once_at_all_threads(served, monkeypatch):
    """A call of ``WIDE_CALL_ROWS`` rows or more is not queued for a lane: the sending thread computes it inside
    ``send``, at the lanes' threads and its own together even from a thread narrowed to one, and its partial sums
    are unary Dispatch's bit for bit; a smaller call sent after it is still queued and answered."""
    checkpoint, address, server = served
    _, lookup = _in_this_process(server)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    unary, in_place = build("grpc-unary"), build("auto", lookup, side_by_side=2, threads=2)
    computed_on: list[tuple[str, int]] = []
    compute = server.servicer.compute

    def watched(*args, **kwargs):
        computed_on.append((threading.current_thread().name, torch.get_num_threads()))
        return compute(*args, **kwargs)

    monkeypatch.setattr(server.servicer, "compute", watched)
    for transport in (unary, in_place):
        transport.update({"g0": address})
    try:
        wide, small = _request(checkpoint, WIDE_CALL_ROWS, 0), _request(checkpoint, 5, 1)
        sent = in_place.send("g0", wide, 30)
        assert computed_on == [(threading.current_thread().name, 2)]  # computed within send, at both threads
        later = in_place.send("g0", small, 30)
        assert torch.equal(sent.result().partial, _call(unary, wide))
        assert torch.equal(later.result().partial, _call(unary, small))
        assert torch.get_num_threads() == 1
    finally:
        unary.close()
        in_place.close()
        torch.set_num_threads(threads_before)


def test_only_auto_calls_in_place_and_only_the_server_that_drew_the_token(served):
    """The ``grpc`` transport (no shared memory) keeps to its stream; a token no group of this process drew
    (another process's group on this host) gets the same-host paths, never a call in place."""
    checkpoint, address, server = served
    _, lookup = _in_this_process(server)
    stream, elsewhere = build("grpc", lookup), build("auto", {b"another group's token": server.servicer}.get)
    try:
        for transport, kind in ((stream, "grpc-stream"), (elsewhere, "shm")):
            transport.update({"g0": address})
            _call(transport, _request(checkpoint, 3, 0))
            assert transport.kind("g0") == kind
            assert "in-process" not in [p.name for p in transport._routes["g0"].paths]
    finally:
        stream.close()
        elsewhere.close()


def test_a_refusal_in_place_carries_the_groups_status_as_on_the_wire(served):
    """A layer the group does not hold, an id past the model's experts: the same status code and message as
    unary Dispatch, raised from ``result()``, never out of ``send`` into the router's step."""
    checkpoint, address, server = served
    _, lookup = _in_this_process(server)
    unary, in_place = build("grpc-unary"), build("auto", lookup)
    for transport in (unary, in_place):
        transport.update({"g0": address})
    good = _request(checkpoint, 4, 0)
    bad_ids = good.expert_ids.clone()
    bad_ids[0, 0] = checkpoint.spec.num_experts + 5
    wrong = [
        GroupRequest(checkpoint.spec.num_layers + 7, 1, good.hidden, good.tokens, good.expert_ids, good.weights),
        GroupRequest(LAYER, 1, good.hidden, good.tokens, bad_ids, good.weights),
        GroupRequest(LAYER, 1, good.hidden, good.tokens, good.expert_ids, good.weights, model="another-checkpoint"),
    ]
    try:
        for request in wrong:
            errors = []
            for transport in (unary, in_place):
                pending = transport.send("g0", request, 30)
                with pytest.raises(TransportError) as err:
                    pending.result()
                errors.append(err.value)
            assert errors[0].code == errors[1].code != grpc.StatusCode.OK
            assert errors[1].details == errors[0].details
        assert torch.equal(_call(in_place, good), _call(unary, good))  # and it goes on serving
    finally:
        unary.close()
        in_place.close()


def test_a_group_gone_from_this_process_is_not_called_in_place_any_more(tiny_checkpoints):
    """Once the group stops (``InProcessGroups.stop`` drops its token first), its route's in-place path is
    broken: the call goes down the list to the wire, which finds the server gone (UNAVAILABLE)."""
    checkpoint = Checkpoint(tiny_checkpoints("mixtral"))
    server, address = _group(checkpoint)
    groups, lookup = _in_this_process(server)
    transport = build("auto", lookup)
    transport.update({"g0": address})
    try:
        _call(transport, _request(checkpoint, 3, 0))
        assert transport.kind("g0") == "in-process"
        groups.clear()
        server.stop(0)
        with pytest.raises(TransportError) as err:
            transport.send("g0", _request(checkpoint, 3, 1), 10).result()
        assert err.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert transport.kind("g0") != "in-process"
    finally:
        transport.close()
