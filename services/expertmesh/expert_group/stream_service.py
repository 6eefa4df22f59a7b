"""The ExpertGroupStream service: Dispatch on one long-lived gRPC stream per router.

A unary call pays gRPC's per-call setup and two protobuf copies of each tensor;
on a stream the router sends one frame per call (``wire_frames``: a small header,
then the tensors' raw bytes) and the group answers each, in order, on the same
stream. The method has no protobuf (de)serialisers: frames are read and checked
here, and computed by the servicer like unary Dispatch. It runs under the same
server, so TLS and the interceptors apply as they do to unary calls.

A stream holds a server thread while it is open, so at most ``max_streams`` are
open at once; one more is refused with RESOURCE_EXHAUSTED (that router then uses
unary Dispatch). A frame that does not read is answered with an error frame
naming the problem, and the stream goes on.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Iterator

import grpc

from expertmesh.contracts import frames as wire_frames
from expertmesh.contracts.errors import InvalidRequest
from expertmesh.contracts.frames import STREAM_SERVICE_NAME
from expertmesh.v1 import experts_pb2 as pb

if TYPE_CHECKING:
    from expertmesh.expert_group.service import ExpertGroupServicer

TRANSPORT = "grpc-stream"


def add_stream_service(server: grpc.Server, servicer: "ExpertGroupServicer", max_streams: int) -> None:
    streams = threading.BoundedSemaphore(max_streams)

    def dispatch(frames: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        if not streams.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"expert group {servicer.group} has {max_streams} dispatch streams open, its limit; use unary Dispatch",
            )
        servicer.transport_use.opened(TRANSPORT)
        try:
            for data in frames:
                yield answer(servicer, data)
        finally:
            servicer.transport_use.closed(TRANSPORT)
            streams.release()

    handler = grpc.method_handlers_generic_handler(
        STREAM_SERVICE_NAME, {"Dispatch": grpc.stream_stream_rpc_method_handler(dispatch)}
    )
    server.add_generic_rpc_handlers((handler,))


def answer(servicer: "ExpertGroupServicer", data: bytes) -> bytes:
    """The answer message to one call message."""
    try:
        frame, payload = wire_frames.split(data)
    except InvalidRequest as err:  # no call id to answer to: the router fails what it has in flight
        return wire_frames.pack(pb.DispatchFrame(code=err.code.value[0], message=str(err)))
    reply, partial = servicer.answer(
        frame, TRANSPORT, lambda: wire_frames.read(frame, payload, wire_frames.REQUEST_TENSORS)
    )
    return wire_frames.pack(reply, [] if partial is None else [partial])
