"""Dispatch to a group on this host through shared memory (its server: ``expert_group.local_server``).

Each connection to the group's unix socket owns one buffer both processes map.
A call writes its tensors into the buffer once (the hidden rows are gathered
straight into it), sends a frame of a few hundred bytes and waits for the
answer frame; the partial sums are then read out of the buffer. Connections are
pooled per group, one per call in flight.

Buffers are sized from the message: the next power of two that holds the call
and its answer (at least ``MIN_BUFFER_BYTES``), grown when a call needs more and
shrunk after ``SHRINK_AFTER`` calls in a row that needed less than an eighth, so
one large prefill does not pin its buffer for good. A buffer is a memfd (no name
in /dev/shm, nothing left behind if a process dies, freed when both sides let
go), or GPU memory shared by CUDA IPC when the request's hidden states are on
the GPU the group computes on (``shared_buffer.gpu_uuid``, the device query); a
CUDA buffer that cannot be made falls back to a memfd for good.

Anything wrong with the path itself (connect, token, socket, a buffer too
large) raises ``PathBroken`` so the call goes over gRPC; a deadline is
DEADLINE_EXCEEDED and ends the connection (the group may still write into its
buffer); an answer that does not read is a GroupReply with a problem. Every
wait, dialling a new connection included, ends at the call's deadline.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import socket
import threading
import time

import grpc
import torch

from expertmesh.contracts import frames as wire_frames
from expertmesh.contracts import shared_buffer, wire
from expertmesh.contracts.errors import InvalidRequest
from expertmesh.router.transport.base import (
    GroupReply,
    GroupRequest,
    PathBroken,
    TransportError,
    status_code,
    time_left,
)
from expertmesh.router.transport.stream import request_frame
from expertmesh.v1 import experts_pb2 as pb

log = logging.getLogger(__name__)

MIN_BUFFER_BYTES = 64 * 1024
#: calls in a row needing less than 1/SHRINK_RATIO of the buffer before it is replaced by a smaller one
SHRINK_AFTER = 64
SHRINK_RATIO = 8
#: idle connections kept per group
MAX_IDLE = 4
CONNECT_TIMEOUT_S = 5.0


def _size_for(need: int) -> int:
    return max(MIN_BUFFER_BYTES, 1 << (need - 1).bit_length())


class _Connection:
    """One connection to the group's socket, opened by ``deadline`` (``time.monotonic()``) or not at all."""

    def __init__(self, path: str, token: bytes, deadline: float):
        # A stopped group (SIGSTOP, a debugger, swapped out) still takes connections into its backlog
        # and then never answers: the wait ends at the call's deadline, if that comes first.
        left = time_left(deadline, "the group's shared-memory socket was dialled")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.shared: wire_frames.BufferViews | None = None  # over a [bytes] uint8 buffer
        self.kind = "shm"
        self._fd: int | None = None  # a new memfd, passed with the next frame
        self._handle: pb.CudaIpcHandle | None = None  # a new CUDA buffer's handle, likewise
        self._small = 0
        try:
            self.sock.settimeout(min(CONNECT_TIMEOUT_S, left))
            self.sock.connect(path)
            try:
                self.sock.send(pb.DispatchFrame(token=token).SerializeToString())
            except BrokenPipeError:
                pass  # refused at once (the group's connection limit): the reason waits to be read
            answer = self.sock.recv(wire_frames.MAX_HEADER_BYTES)
            if not answer:
                raise OSError("the group closed the connection")
            hello = wire_frames.parse_header(answer)
        except TimeoutError:
            self.close()
            if left <= CONNECT_TIMEOUT_S:
                raise TransportError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"the group's shared-memory socket did not answer within the call's {left:.3g}s",
                ) from None
            raise PathBroken(
                f"the group's shared-memory socket {path} did not answer within {CONNECT_TIMEOUT_S:.3g}s"
            ) from None
        except (OSError, InvalidRequest) as err:
            self.close()
            raise PathBroken(f"cannot connect to the group's shared-memory socket {path}: {err}") from None
        if hello.code:
            self.close()
            raise PathBroken(f"the group refused the shared-memory connection: {hello.message}")

    def _ensure(self, need: int, device: torch.device, use_cuda: bool) -> None:
        """A buffer of ``need`` bytes or more: GPU memory on ``device`` when ``use_cuda``, else a memfd.
        A new one goes out with the next frame."""
        size = 0 if self.shared is None else self.shared.buffer.numel()
        if self.shared is not None and (self.kind == "cuda-ipc") == use_cuda and need <= size:
            self._small = self._small + 1 if need * SHRINK_RATIO < size else 0
            if self._small < SHRINK_AFTER or size == MIN_BUFFER_BYTES:
                return
        self._small = 0
        size = _size_for(need)
        if size > shared_buffer.MAX_BUFFER_BYTES:
            raise PathBroken(
                f"a call of {need} bytes is over the {shared_buffer.MAX_BUFFER_BYTES}-byte shared buffer limit"
            )
        self.shared = None  # let the old mapping go before the new one is made
        self._discard_fd()
        if use_cuda:
            buffer, self._handle = shared_buffer.create_cuda(size, device)
            self.kind = "cuda-ipc"
        else:
            buffer, self._fd = shared_buffer.create_memfd(size)
            self.kind = "shm"
        self.shared = wire_frames.BufferViews(buffer)

    def start(self, call_id: int, request: GroupRequest, use_cuda: bool, deadline: float) -> int:
        """Write the call into the buffer and send its frame; returns the answer's offset."""
        rows = pb.TensorMeta(
            dtype=wire.dtype_to_proto(request.hidden.dtype),
            shape=[request.tokens.numel(), request.hidden.shape[1]],
            nbytes=request.row_bytes,
        )
        metas = [rows, wire_frames.meta(request.expert_ids), wire_frames.meta(request.weights)]
        answer_offset = wire_frames.span(metas)
        self._ensure(answer_offset + request.row_bytes, request.hidden.device, use_cuda)
        hidden, ids, weights = self.shared.views(metas, wire_frames.REQUEST_TENSORS)  # [Tg, H], [Tg, K] x2
        if hidden.device == request.hidden.device:
            request.rows(out=hidden)
        else:
            hidden.copy_(request.rows())
        ids.copy_(request.expert_ids)
        weights.copy_(request.weights)
        buffer = self.shared.buffer
        if buffer.is_cuda:
            torch.cuda.current_stream(buffer.device).synchronize()
        frame = request_frame(call_id, request)
        frame.tensors.extend(metas)
        frame.buffer_bytes, frame.answer_offset = buffer.numel(), answer_offset
        if self._handle is not None:
            frame.cuda_buffer.CopyFrom(self._handle)
            self._handle = None
        data = frame.SerializeToString()
        try:
            self.sock.settimeout(time_left(deadline, "the call was sent"))
            if self._fd is not None:
                socket.send_fds(self.sock, [data], [self._fd])
                self._discard_fd()
            else:
                self.sock.send(data)
        except OSError as err:
            raise PathBroken(f"the shared-memory socket failed: {err}") from None
        return answer_offset

    def finish(self, call_id: int, answer_offset: int, deadline: float) -> GroupReply:
        """The answer to the call in flight. Raises TransportError, or PathBroken when the socket broke."""
        try:
            # Never less than a moment: the router collects one group's answer after another, and an answer
            # that arrived in time while it waited for a slower group must still be taken.
            self.sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            data = self.sock.recv(wire_frames.MAX_HEADER_BYTES)
        except TimeoutError:
            raise TransportError(
                grpc.StatusCode.DEADLINE_EXCEEDED, "the group did not answer before the call's deadline"
            ) from None
        except OSError as err:
            raise PathBroken(f"the shared-memory socket failed: {err}") from None
        if not data:
            raise PathBroken("the group closed the shared-memory connection")
        try:
            frame = wire_frames.parse_header(data)
            if frame.call_id != call_id:
                raise InvalidRequest(f"the answer is to call {frame.call_id}, not {call_id}")
            if frame.code:
                raise TransportError(status_code(frame.code), frame.message)
            (partial,) = self.shared.views(frame.tensors, wire_frames.ANSWER_TENSORS, start=answer_offset)
        except InvalidRequest as err:
            return GroupReply(None, len(data), str(err))
        return GroupReply(partial.clone(), len(data) + partial.numel() * partial.element_size())

    def _discard_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        self._discard_fd()
        self.sock.close()
        self.shared = None


class _LocalPending:
    def __init__(self, path: "LocalPath", conn: _Connection, call_id: int, answer_offset: int, deadline: float):
        self._path, self._conn, self._call_id, self._offset = path, conn, call_id, answer_offset
        self._deadline = deadline
        self.transport = conn.kind
        self._read = False  # the answer (or failure) was taken: the connection is back in the pool or closed

    def result(self) -> GroupReply:
        self._read = True
        try:
            reply = self._conn.finish(self._call_id, self._offset, self._deadline)
        except TransportError as err:
            if err.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._conn.close()  # the group may still answer into this buffer: never reuse it
            else:
                self._path.release(self._conn)
            raise
        except PathBroken:
            self._conn.close()
            raise
        if reply.problem:
            self._conn.close()  # out of step with the group: start afresh
        else:
            self._path.release(self._conn)
        return reply

    def wait(self, timeout_s: float) -> bool:
        left = self._deadline - time.monotonic()
        if left <= 0:
            return True
        try:
            readable, _, _ = select.select([self._conn.sock], [], [], max(min(timeout_s, left), 0.0))
        except (OSError, ValueError):  # the socket is gone: result() says so at once
            return True
        return bool(readable) or time.monotonic() >= self._deadline

    def cancel(self) -> None:
        if not self._read:  # never a connection the pool has taken back
            self._conn.close()  # the group may still answer into this buffer: never reuse it


class LocalPath:
    """Calls to one group on this host: its shared-memory socket ``path`` with ``token``. ``gpu_uuid``:
    the group's GPU ("" on CPU); requests whose hidden states are on it use CUDA IPC buffers."""

    def __init__(self, path: str, token: bytes, gpu_uuid: str = ""):
        self._path, self._token, self._gpu = path, token, gpu_uuid
        self._lock = threading.Lock()
        self._idle: list[_Connection] = []
        self._closed = False
        self._ids = itertools.count(1)
        self._cuda_ok = True
        self.name = "shm"

    def send(self, request: GroupRequest, timeout_s: float) -> _LocalPending:
        deadline = time.monotonic() + timeout_s
        use_cuda = self._cuda_ok and bool(self._gpu) and shared_buffer.gpu_uuid(request.hidden.device) == self._gpu
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        conn = conn or _Connection(self._path, self._token, deadline)
        call_id = next(self._ids)
        try:
            offset = self._start(conn, call_id, request, use_cuda, deadline)
        except BaseException:
            conn.close()
            raise
        self.name = conn.kind
        return _LocalPending(self, conn, call_id, offset, deadline)

    def prepare(self, deadline: float) -> None:
        """One connection dialled and idle, unless one is already (raises PathBroken as a first call would)."""
        with self._lock:
            if self._idle or self._closed:
                return
        self.release(_Connection(self._path, self._token, deadline))

    def _start(self, conn: _Connection, call_id: int, request: GroupRequest, use_cuda: bool, deadline: float) -> int:
        try:
            return conn.start(call_id, request, use_cuda, deadline)
        except (PathBroken, TransportError):
            raise
        except Exception as err:
            if not use_cuda:
                raise PathBroken(f"the shared buffer failed: {type(err).__name__}: {err}") from None
            log.warning(
                "CUDA IPC to the group failed (%s: %s); its calls use shared host memory", type(err).__name__, err
            )
            self._cuda_ok = False
            return self._start(conn, call_id, request, False, deadline)

    def release(self, conn: _Connection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
