"""The fast paths under bad input and failure: real group servers on loopback (no Ray).

- Frames that do not read, on the gRPC stream and on the shared-memory socket,
  get an error frame naming the problem; the stream or connection goes on, and
  the group keeps serving.
- A path that breaks under a router sends the call down the list (shared memory,
  then the gRPC stream, then unary), exactly; a group from before these paths
  ends up on unary calls.
- The CUDA IPC path is chosen from the device query alone (faked here: no GPU),
  and when its buffer cannot be made the call goes by shared host memory.
- A call past its deadline is DEADLINE_EXCEEDED and its connection is not reused.
- A stopped group (a real process, SIGSTOPped) costs a call its deadline and
  nothing more: dialling it is bounded by the deadline too, and a short deadline
  does not count as a broken path.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import time

import grpc
import pytest
import torch

from expertmesh.contracts import frames as wire_frames
from expertmesh.contracts import shared_buffer, wire
from expertmesh.contracts.frames import STREAM_METHOD
from expertmesh.expert_group.local_server import LocalServer, runtime_dir
from expertmesh.expert_group.service import SERVICE_NAME, ExpertGroupServicer, GroupServer
from expertmesh.infra.group_channels import GroupClients, group_channel
from expertmesh.infra.grpc_server import GrpcServer
from expertmesh.models.checkpoint import Checkpoint
from expertmesh.models.hosted_experts import HostedExperts
from expertmesh.platform.group_processes import start_groups
from expertmesh.router.transport import build
from expertmesh.router.transport.auto import AutoTransport
from expertmesh.router.transport.base import GroupRequest, TransportError
from expertmesh.router.transport.unary import GrpcTransport
from expertmesh.v1 import experts_pb2 as pb
from expertmesh.v1 import experts_pb2_grpc as pb_grpc
from helpers import wait_stopped

LAYER = 1
HIDDEN = 32  # the tiny Mixtral: MoE layers 0 and 1, 4 experts, top-2
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return Checkpoint(tiny_checkpoints("mixtral"))


def _servicer(checkpoint, name="g0") -> ExpertGroupServicer:
    hosted = HostedExperts(checkpoint)
    hosted.load([(LAYER, e) for e in range(4)])
    return ExpertGroupServicer(name, hosted)


@pytest.fixture(scope="module")
def group(checkpoint):
    server = GroupServer(_servicer(checkpoint)).start()
    yield server, f"127.0.0.1:{server.port}"
    server.stop(0)


def _tensors(tokens=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, generator=g)  # [T, H]
    ids = torch.tensor([[1, 3], [3, -1], [-1, 0]] * tokens, dtype=torch.int32)[:tokens]  # [T, K]
    return hidden, ids, torch.rand(tokens, 2, generator=g)


def _unary(address, hidden, ids, weights) -> torch.Tensor:
    with group_channel(address) as channel:
        request = pb.DispatchRequest(
            layer=LAYER,
            hidden_states=wire.encode(hidden),
            expert_ids=wire.encode(ids),
            routing_weights=wire.encode(weights),
        )
        return wire.decode(pb_grpc.ExpertGroupStub(channel).Dispatch(request, timeout=30).partial_sums)


def _request(tokens=3, seed=0) -> GroupRequest:
    hidden, ids, weights = _tensors(tokens, seed)
    return GroupRequest(LAYER, 1, hidden, torch.arange(tokens), ids, weights)


# -- the gRPC stream --------------------------------------------------------------------------


def _stream_message(frame: pb.DispatchFrame, payload: bytes) -> bytes:
    header = frame.SerializeToString()
    return struct.pack("<I", len(header)) + header + payload


def _good_frame(call_id: int) -> bytes:
    return wire_frames.pack(pb.DispatchFrame(call_id=call_id, layer=LAYER), list(_tensors()))


def _frame(**fields) -> pb.DispatchFrame:
    return pb.DispatchFrame(call_id=7, layer=LAYER, **fields)


def _stream_bad_frames() -> list[tuple[str, bytes, str]]:
    hidden, ids, weights = _tensors()
    metas = [wire_frames.meta(t) for t in (hidden, ids, weights)]
    payload = b"".join(t.numpy().tobytes() for t in (hidden, ids, weights))
    negative = [pb.TensorMeta(dtype=metas[0].dtype, shape=[-3, HIDDEN], nbytes=0), *metas[1:]]
    wrong_count = [
        pb.TensorMeta(dtype=m.dtype, shape=m.shape, nbytes=m.nbytes - 4) if i == 0 else m for i, m in enumerate(metas)
    ]
    return [
        ("too short", b"\x01", "shorter than its header length"),
        ("header past the end", struct.pack("<I", 500) + b"abc", "does not fit"),
        ("header not protobuf", struct.pack("<I", 3) + b"\xff\xff\xff", "does not parse"),
        ("two tensors", _stream_message(_frame(tensors=metas[:2]), payload), "must describe 3 tensors"),
        ("bytes vs shape", _stream_message(_frame(tensors=wrong_count), payload), "do not match shape"),
        ("payload short", _stream_message(_frame(tensors=metas), payload[:-8]), "shorter than its tensors"),
        ("payload long", _stream_message(_frame(tensors=metas), payload + b"xyz"), "beyond its tensors"),
        ("negative dimension", _stream_message(_frame(tensors=negative), payload), "negative dimension"),
        (
            "unknown dtype",
            _stream_message(_frame(tensors=[pb.TensorMeta(dtype=99, shape=[1], nbytes=4), *metas[1:]]), payload),
            "dtype",
        ),
    ]


def test_bad_stream_frames_get_error_frames_and_the_stream_goes_on(group):
    _, address = group
    bad = _stream_bad_frames()
    with grpc.insecure_channel(address) as channel:
        answers = list(
            channel.stream_stream(STREAM_METHOD)(iter([m for _, m, _ in bad] + [_good_frame(42)]), timeout=60)
        )
    assert len(answers) == len(bad) + 1, "every frame is answered, in order, on the one stream"
    for (what, _, message), data in zip(bad, answers):
        frame, payload = wire_frames.split(data)
        assert frame.code == INVALID and message in frame.message, (what, frame.message)
        assert not frame.tensors and not payload
    frame, payload = wire_frames.split(answers[-1])
    assert frame.code == 0 and frame.call_id == 42
    (partial,) = wire_frames.read(frame, payload, wire_frames.ANSWER_TENSORS)
    assert torch.equal(partial, _unary(address, *_tensors()))


def test_a_stream_frame_the_experts_refuse_is_answered_with_their_status(group):
    _, address = group
    hidden, ids, weights = _tensors()
    hidden[0, 0] = float("nan")
    frames = [
        wire_frames.pack(pb.DispatchFrame(call_id=1, layer=0), list(_tensors())),  # layer 0 is not hosted
        wire_frames.pack(pb.DispatchFrame(call_id=2, layer=LAYER), [hidden, ids, weights]),
    ]
    with grpc.insecure_channel(address) as channel:
        answers = [wire_frames.split(a)[0] for a in channel.stream_stream(STREAM_METHOD)(iter(frames), timeout=60)]
    assert [(a.call_id, a.code) for a in answers] == [(1, grpc.StatusCode.NOT_FOUND.value[0]), (2, INVALID)]
    assert "non-finite" in answers[1].message


# -- the shared-memory socket ---------------------------------------------------------------


class _ShmClient:
    """A raw client of a group's shared-memory socket: frames, descriptors, its own memfd."""

    def __init__(self, path: str, token: bytes):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(30)
        self.sock.connect(path)
        self.hello = self.ask(pb.DispatchFrame(token=token).SerializeToString())

    @classmethod
    def of(cls, server: GroupServer, token: bytes | None = None) -> "_ShmClient":
        info = server.servicer.transports
        return cls(info.shm_socket, info.shm_token if token is None else token)

    def ask(self, data: bytes, fds: list[int] = ()) -> pb.DispatchFrame | None:
        try:
            socket.send_fds(self.sock, [data], list(fds)) if fds else self.sock.send(data)
        except BrokenPipeError:
            pass  # closed by the group: what it said before is still there to read
        answer = self.sock.recv(wire_frames.MAX_HEADER_BYTES)
        return wire_frames.parse_header(answer) if answer else None

    def close(self):
        self.sock.close()


def _shm_call(buffer: torch.Tensor, call_id: int, **fields) -> pb.DispatchFrame:
    """A call whose tensors are written into ``buffer`` from 0, its answer after them."""
    tensors = _tensors()
    metas = [wire_frames.meta(t) for t in tensors]
    for view, tensor in zip(wire_frames.BufferViews(buffer).views(metas, wire_frames.REQUEST_TENSORS), tensors):
        view.copy_(tensor)
    defaults = dict(
        call_id=call_id, layer=LAYER, tensors=metas, buffer_bytes=buffer.numel(), answer_offset=wire_frames.span(metas)
    )
    return pb.DispatchFrame(**{**defaults, **fields})


def test_the_shared_memory_socket_takes_only_the_token(group):
    server, _ = group
    stranger = _ShmClient.of(server, token=b"not the token")
    assert stranger.hello.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert stranger.sock.recv(100) == b"", "the group closes a connection that fails the token"
    stranger.close()


def test_bad_shared_memory_frames_get_error_frames_and_the_connection_goes_on(group, tmp_path):
    server, address = group
    client = _ShmClient.of(server)
    assert client.hello.code == 0
    buffer, fd = shared_buffer.create_memfd(4096)
    small, small_fd = shared_buffer.create_memfd(4096)
    a_file = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(a_file, 4096)
    pipe_r, pipe_w = os.pipe()
    call = _shm_call(buffer, 1)
    metas = list(call.tensors)
    beyond = [metas[0], metas[1], pb.TensorMeta(dtype=metas[2].dtype, shape=[500, 2], nbytes=4000)]
    cases = [
        ("no buffer yet", call.SerializeToString(), [], "no shared buffer"),
        ("header not protobuf", b"\xff\xff\xff", [], "does not parse"),
        ("a file, not a memfd", call.SerializeToString(), [a_file], "not a memfd"),
        ("a pipe, not a memfd", call.SerializeToString(), [pipe_r], "not a memfd"),
        ("two descriptors", call.SerializeToString(), [fd, fd], "more than one descriptor"),
        (
            "buffer larger than the memfd",
            _shm_call(buffer, 2, buffer_bytes=1 << 20).SerializeToString(),
            [small_fd],
            "does not fit",
        ),
        ("oversized frame", b"x" * (wire_frames.MAX_HEADER_BYTES + 10), [], "is not a dispatch frame"),
        (
            "CUDA handle without CUDA",
            _shm_call(buffer, 3, cuda_buffer=pb.CudaIpcHandle(gpu_uuid="GPU-x", size_bytes=4096)).SerializeToString(),
            [],
            "not visible",
        ),
        ("tensors beyond the buffer", _shm_call(buffer, 4, tensors=beyond).SerializeToString(), [fd], "do not fit"),
        (
            "answer beyond the buffer",
            _shm_call(buffer, 5, answer_offset=4096).SerializeToString(),
            [],
            "does not fit where",
        ),
        ("unaligned answer", _shm_call(buffer, 6, answer_offset=1000).SerializeToString(), [], "not a multiple of 64"),
    ]
    for what, data, fds, message in cases:
        answer = client.ask(data, fds)
        assert answer is not None and answer.code == INVALID and message in answer.message, (what, answer)
    good = _shm_call(buffer, 9)
    answer = client.ask(good.SerializeToString())
    assert answer.code == 0 and answer.call_id == 9
    (partial,) = wire_frames.BufferViews(buffer).views(
        answer.tensors, wire_frames.ANSWER_TENSORS, start=good.answer_offset
    )
    assert torch.equal(partial, _unary(address, *_tensors()))
    client.close()
    for descriptor in (fd, small_fd, a_file, pipe_r, pipe_w):
        os.close(descriptor)
    del buffer, small


def test_connections_past_the_limit_are_refused(checkpoint):
    local = LocalServer(_servicer(checkpoint), runtime_dir(), max_connections=1).start()
    try:
        first = _ShmClient(str(local.path), local.token)
        assert first.hello.code == 0
        second = _ShmClient(str(local.path), local.token)
        assert second.hello.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        first.close(), second.close()
    finally:
        local.stop()


# -- falling back ---------------------------------------------------------------------------


def test_a_broken_shared_memory_path_sends_calls_over_grpc_exactly(checkpoint, caplog):
    server = GroupServer(_servicer(checkpoint)).start()
    address = f"127.0.0.1:{server.port}"
    transport = build("auto")
    transport.update({"g0": address})
    try:
        expected = _unary(address, *_tensors())
        assert torch.equal(transport.send("g0", _request(), 30).result().partial, expected)
        assert transport.kind("g0") == "shm"
        server.local.stop()  # the shared-memory side goes away; the gRPC server stays
        with caplog.at_level(logging.WARNING):
            reply = transport.send("g0", _request(), 30).result()
        assert torch.equal(reply.partial, expected)
        assert transport.kind("g0") == "grpc-stream" and "the shm path failed" in caplog.text
    finally:
        transport.close()
        server.local = None
        server.stop(0)


def test_a_group_from_before_the_fast_paths_gets_unary_calls(checkpoint):
    """No Transports RPC, no stream service: a plain server with the generated servicer only."""
    servicer = _servicer(checkpoint)
    server = GrpcServer("expert-group", "127.0.0.1", 0, 4)
    pb_grpc.add_ExpertGroupServicer_to_server(servicer, server.server)
    server.start((SERVICE_NAME,))
    address = f"127.0.0.1:{server.port}"
    transport = build("auto")
    transport.update({"g0": address})
    try:
        for _ in range(2):
            assert torch.equal(transport.send("g0", _request(), 30).result().partial, _unary(address, *_tensors()))
        assert transport.kind("g0") == "grpc-unary"
    finally:
        transport.close()
        server.stop(0)


class _MovedAfterLookup(GroupClients):
    """GroupClients whose stub lookup is followed at once by the group's move (``update`` to ``to``, which
    closes the old channel): the interleaving of a router's step thread starting a call while its endpoint
    watcher follows a group to a new address, made certain rather than left to a race."""

    def __init__(self, to: str):
        super().__init__()
        self._to, self.moved = to, False

    def stub(self, group: str):
        stub = super().stub(group)
        if not self.moved and stub is not None:
            self.moved = True
            self.update({group: self._to})
        return stub


@pytest.mark.parametrize("name", ["grpc-unary", "grpc"])
def test_a_group_moving_under_a_call_is_unavailable_and_the_next_call_reaches_its_new_address(checkpoint, name):
    """A group's address changes in the store (a replica restarted elsewhere) while calls go to it: the old
    channel is closed under them. On unary calls, a call in flight on it and a call started on it just after
    the lookup fail with UNAVAILABLE, the code the dispatcher resends or fails over on (grpc said CANCELLED
    for the first and raised ValueError "Channel closed!" for the second, which failed the whole step); on
    the stream paths both go down the list to the group's new channel. The next call is answered exactly at
    the new address. Two real group servers on loopback."""
    slow, fast = _servicer(checkpoint), _servicer(checkpoint)
    compute = slow.compute
    slow.compute = lambda *a, **kw: (time.sleep(1.0), compute(*a, **kw))[1]
    old, new = GroupServer(slow).start(), GroupServer(fast).start()
    first, second = f"127.0.0.1:{old.port}", f"127.0.0.1:{new.port}"
    expected = _unary(second, *_tensors())
    transport = build(name)
    try:
        transport.update({"g0": first})
        in_flight = transport.send("g0", _request(), 30)
        assert not in_flight.wait(0.2)
        transport.update({"g0": second})
        if name == "grpc-unary":
            with pytest.raises(TransportError) as err:
                in_flight.result()
            assert err.value.code == grpc.StatusCode.UNAVAILABLE, err.value
        else:  # its same-host stream broke as a path: the call went down the list, to the group's new channel
            assert torch.equal(in_flight.result().partial, expected)
        assert torch.equal(transport.send("g0", _request(), 30).result().partial, expected)
    finally:
        transport.close()

    clients = _MovedAfterLookup(to=second)
    transport = GrpcTransport(clients) if name == "grpc-unary" else AutoTransport(shared_memory=False, clients=clients)
    try:
        clients.update({"g0": first})
        if name == "grpc-unary":  # the last path: the dispatcher sends again
            with pytest.raises(TransportError) as err:
                transport.send("g0", _request(), 30)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE and "channel was closed" in err.value.details
        else:  # the route's stream path was made on the closed channel: the call goes down to the group's new one
            assert torch.equal(transport.send("g0", _request(), 30).result().partial, expected)
        assert clients.moved
        assert torch.equal(transport.send("g0", _request(), 30).result().partial, expected)
    finally:
        transport.close()
        old.stop(0)
        new.stop(0)


def test_cuda_ipc_is_chosen_by_the_device_query_and_falls_back_to_host_memory(checkpoint, monkeypatch, caplog):
    """Only the device query is faked: it says every tensor, and the group, are on one GPU."""
    monkeypatch.setattr(shared_buffer, "gpu_uuid", lambda device: "GPU-fake-0")
    server = GroupServer(_servicer(checkpoint)).start()
    address = f"127.0.0.1:{server.port}"
    assert server.servicer.transports.gpu_uuid == "GPU-fake-0"
    assert server.servicer.Describe(pb.DescribeRequest(), None).transports_offered[:2] == ["cuda-ipc", "shm"]
    transport = build("auto")
    transport.update({"g0": address})
    try:
        with caplog.at_level(logging.WARNING):
            reply = transport.send("g0", _request(), 30).result()
        assert "CUDA IPC to the group failed" in caplog.text  # it tried: the CPU tensor has no CUDA handle
        assert torch.equal(reply.partial, _unary(address, *_tensors()))
        assert transport.kind("g0") == "shm"
        caplog.clear()
        transport.send("g0", _request(seed=1), 30).result()
        assert "CUDA IPC" not in caplog.text, "once failed, CUDA IPC is not tried again for this group"
    finally:
        transport.close()
        server.stop(0)


@pytest.mark.parametrize("name, path", [("auto", "shm"), ("grpc", "grpc-stream")])
def test_a_call_past_its_deadline_fails_and_the_next_one_is_exact(checkpoint, name, path):
    servicer = _servicer(checkpoint)
    compute = servicer.compute
    servicer.compute = lambda *a, **kw: (time.sleep(1.0), compute(*a, **kw))[1]
    server = GroupServer(servicer).start()
    address = f"127.0.0.1:{server.port}"
    transport = build(name)
    transport.update({"g0": address})
    try:
        with pytest.raises(TransportError) as err:
            transport.send("g0", _request(), 0.2).result()
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert transport.kind("g0") == path
        servicer.compute = compute
        reply = transport.send("g0", _request(seed=1), 30).result()
        assert torch.equal(reply.partial, _unary(address, *_tensors(seed=1)))
    finally:
        transport.close()
        server.stop(0)


def test_a_stopped_group_costs_a_call_its_deadline_and_breaks_no_path(tiny_checkpoints):
    """A real ``expertmesh group serve`` process, SIGSTOPped: its sockets still take connections
    into their backlog and never answer. The first call waits on the pooled connection; the
    second dials a new one, which must end at the call's deadline too (it used to wait a fixed 5 s,
    then call the path broken and start the call again on gRPC with its whole timeout)."""
    (group,) = start_groups(["g0"], ["--model", str(tiny_checkpoints("mixtral")), "--groups", "1"]).values()
    transport = build("auto")
    transport.update({"g0": group.address})
    try:
        expected = transport.send("g0", _request(), 30).result().partial
        assert transport.kind("g0") == "shm"
        os.kill(group.proc.pid, signal.SIGSTOP)
        wait_stopped(group.proc.pid)  # the signal is delivered asynchronously: a call sent before it lands is served
        for _ in range(2):
            with pytest.raises(TransportError) as err:
                transport.send("g0", _request(), 0.5).result()
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert transport.kind("g0") == "shm", "a group slower than a call's deadline is not a broken path"
        os.kill(group.proc.pid, signal.SIGCONT)
        assert torch.equal(transport.send("g0", _request(), 30).result().partial, expected)
        assert transport.kind("g0") == "shm"
    finally:
        os.kill(group.proc.pid, signal.SIGCONT)
        transport.close()
        group.stop()


@pytest.mark.parametrize("name, path", [("auto", "shm"), ("grpc", "grpc-stream"), ("grpc-unary", "grpc-unary")])
def test_a_slow_call_can_be_waited_for_and_given_up_and_the_next_one_is_exact(checkpoint, name, path):
    """What hedging needs of every path: ``wait`` says a slow call has not answered yet without ending it,
    ``cancel`` gives it up (its late answer never read, on the same stream or pool of connections), and a call
    whose answer ``wait`` already saw and that is then given up anyway (a hedge that lost its race) leaves its
    connection usable: the next calls are exact, on the same path."""
    servicer = _servicer(checkpoint)
    compute = servicer.compute
    servicer.compute = lambda *a, **kw: (time.sleep(0.5), compute(*a, **kw))[1]
    server = GroupServer(servicer).start()
    address = f"127.0.0.1:{server.port}"
    transport = build(name)
    transport.update({"g0": address})
    try:
        slow = transport.send("g0", _request(), 30)
        assert not slow.wait(0.1)
        slow.cancel()
        servicer.compute = compute
        answered = transport.send("g0", _request(seed=1), 30)
        assert answered.wait(30)
        answered.cancel()  # its answer arrived: nothing left to give up
        time.sleep(0.6)  # the cancelled call's answer comes meanwhile
        for seed in (2, 3):
            reply = transport.send("g0", _request(seed=seed), 30).result()
            assert torch.equal(reply.partial, _unary(address, *_tensors(seed=seed)))
        assert transport.kind("g0") == path
    finally:
        transport.close()
        server.stop(0)
