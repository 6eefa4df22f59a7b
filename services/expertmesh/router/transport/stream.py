"""Dispatch over one long-lived gRPC stream per group: the portable path.

A unary call sets up an RPC per layer per group and copies every tensor into
and out of protobuf; here each call is one frame on a stream opened once
(``contracts.frames``: a small header, then the tensors' raw bytes), and a reader
thread hands each answer to the call with its id. Calls to one group may overlap;
the group answers them in order. The stream is opened on the channel without
tracing interceptors (a span as long as the stream would mean nothing): each
frame carries its group-call span's trace context instead.

A call that outlives its deadline (counted from when it was sent) fails with DEADLINE_EXCEEDED and its late
answer is dropped. When the stream ends, every call on it fails with the
stream's status and the next call opens a new one. Stream-level refusals that
say "not this way" (UNIMPLEMENTED: a group without the stream service;
RESOURCE_EXHAUSTED: its stream limit; anything on a same-host unix socket)
raise ``PathBroken``, so the call goes another way.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import queue
import threading
import time

import grpc
from opentelemetry import propagate

from expertmesh.contracts import frames as wire_frames
from expertmesh.contracts.errors import InvalidRequest
from expertmesh.contracts.frames import STREAM_METHOD
from expertmesh.infra.telemetry.setup import tracing_enabled
from expertmesh.router.transport.base import (
    GroupReply,
    GroupRequest,
    PathBroken,
    TransportError,
    call_failed,
    status_code,
)
from expertmesh.v1 import experts_pb2 as pb

_END = object()
#: stream statuses that mean "this path does not work here" rather than "the group failed"
_NOT_THIS_WAY = frozenset({grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.RESOURCE_EXHAUSTED})


def request_frame(call_id: int, request: GroupRequest) -> pb.DispatchFrame:
    """The frame of one call, less its tensors (the paths add those their own way)."""
    frame = pb.DispatchFrame(
        call_id=call_id,
        layer=request.layer,
        routing_table_version=request.table_version,
        model_fingerprint=request.model,
    )
    if tracing_enabled():
        propagate.inject(frame.trace_context)
    return frame


class _Stream:
    """One open stream: frames out through a queue, answers in by a reader thread."""

    def __init__(self, channel: grpc.Channel, same_host: bool):
        self._same_host = same_host
        self._lock = threading.Lock()
        self._waiting: dict[int, concurrent.futures.Future] = {}
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.alive = True
        try:
            self._call = channel.stream_stream(STREAM_METHOD)(iter(self._outbox.get, _END))  # bytes both ways
        except ValueError as err:  # grpc: the channel was closed as the group's address changed (Transport.update)
            raise PathBroken(f"the group's channel was closed ({err})") from None
        threading.Thread(target=self._read, name="expertmesh-stream-reader", daemon=True).start()

    def submit(self, call_id: int, data: bytes) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self.alive:
                raise PathBroken("the dispatch stream has ended")
            self._waiting[call_id] = future
        self._outbox.put(data)
        return future

    def forget(self, call_id: int) -> None:
        with self._lock:
            self._waiting.pop(call_id, None)

    def _read(self) -> None:
        try:
            for data in self._call:
                try:
                    frame, payload = wire_frames.split(data)
                except InvalidRequest as err:
                    self._fail(TransportError(grpc.StatusCode.INTERNAL, f"the group sent an unreadable frame: {err}"))
                    continue
                with self._lock:
                    future = self._waiting.pop(frame.call_id, None)
                if future is not None:
                    future.set_result((frame, payload, len(data)))
                elif frame.call_id == 0 and frame.code:  # the group could not read a frame of ours
                    self._fail(TransportError(status_code(frame.code), frame.message))
            error: Exception = TransportError(grpc.StatusCode.UNAVAILABLE, "the group ended the dispatch stream")
        except grpc.RpcError as err:
            code, details = err.code(), err.details() or ""
            error = (
                PathBroken(f"{code.name}: {details}")
                if self._same_host or code in _NOT_THIS_WAY
                else call_failed(code, details)
            )
        with self._lock:
            self.alive = False
        self._fail(error)

    def _fail(self, error: Exception) -> None:
        with self._lock:
            waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            future.set_exception(error)

    def close(self) -> None:
        self._call.cancel()
        self._outbox.put(_END)


class _StreamPending:
    transport = "grpc-stream"

    def __init__(self, stream: _Stream, call_id: int, future: concurrent.futures.Future, deadline: float):
        self._stream, self._call_id, self._future, self._deadline = stream, call_id, future, deadline

    def result(self) -> GroupReply:
        try:
            frame, payload, nbytes = self._future.result(timeout=max(self._deadline - time.monotonic(), 0))
        except concurrent.futures.TimeoutError:
            self._stream.forget(self._call_id)
            raise TransportError(
                grpc.StatusCode.DEADLINE_EXCEEDED, "the group did not answer before the call's deadline"
            ) from None
        if frame.code:
            raise TransportError(status_code(frame.code), frame.message)
        try:
            (partial,) = wire_frames.read(frame, payload, wire_frames.ANSWER_TENSORS)
        except InvalidRequest as err:
            return GroupReply(None, nbytes, str(err))
        return GroupReply(partial, nbytes)

    def wait(self, timeout_s: float) -> bool:
        left = self._deadline - time.monotonic()
        if left > 0 and not self._future.done():
            concurrent.futures.wait([self._future], timeout=max(min(timeout_s, left), 0.0))
        return self._future.done() or time.monotonic() >= self._deadline

    def cancel(self) -> None:
        self._stream.forget(self._call_id)  # its answer, if it comes, is dropped by the reader


class StreamPath:
    """Calls to one group on a stream over ``channel`` (``same_host``: a unix socket of this host)."""

    name = "grpc-stream"

    def __init__(self, channel: grpc.Channel, same_host: bool = False, owns_channel: bool = False):
        self._channel = channel
        self._same_host = same_host
        self._owns_channel = owns_channel
        self._lock = threading.Lock()
        self._stream: _Stream | None = None
        self._ids = itertools.count(1)

    def send(self, request: GroupRequest, timeout_s: float) -> _StreamPending:
        deadline = time.monotonic() + timeout_s
        call_id = next(self._ids)
        frame = request_frame(call_id, request)
        data = wire_frames.pack(frame, [request.rows(), request.expert_ids, request.weights])
        for _ in range(2):  # a stream that ended just now: once more on a new one
            with self._lock:
                if self._stream is None or not self._stream.alive:
                    self._stream = _Stream(self._channel, self._same_host)
                stream = self._stream
            try:
                return _StreamPending(stream, call_id, stream.submit(call_id, data), deadline)
            except PathBroken:
                continue
        raise PathBroken("the dispatch stream ended twice while a call was being sent")

    def prepare(self, deadline: float) -> None:
        """The stream opened (a call opens it otherwise)."""
        with self._lock:
            if self._stream is None or not self._stream.alive:
                self._stream = _Stream(self._channel, self._same_host)

    def close(self) -> None:
        with self._lock:
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
        if self._owns_channel:
            self._channel.close()
