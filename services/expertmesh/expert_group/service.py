"""The ``expertmesh.v1.ExpertGroup`` gRPC service over HostedExperts, plus the
standard ``grpc.health.v1`` service.

Every handler validates its request; a bad one is answered with
INVALID_ARGUMENT or NOT_FOUND and a message naming the problem, and the server
keeps serving everyone else.
"""

from __future__ import annotations

import logging
import os

import grpc

from expertmesh import wire
from expertmesh.errors import ExpertMeshError
from expertmesh.expert_group.hosted import HostedExperts
from expertmesh.grpc_server import GrpcServer
from expertmesh.telemetry.setup import tracer
from expertmesh.v1 import experts_pb2 as pb
from expertmesh.v1 import experts_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "expertmesh.v1.ExpertGroup"
# Hidden states of a large prefill exceed gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def _pairs(refs) -> list[tuple[int, int]]:
    return [(r.layer, r.expert) for r in refs]


def _refs(pairs) -> list[pb.ExpertRef]:
    return [pb.ExpertRef(layer=layer, expert=e) for layer, e in pairs]


def _guard(handler):
    """Turn ExpertMeshError into the matching gRPC status; anything else is INTERNAL, logged."""

    def wrapped(self, request, context):
        try:
            return handler(self, request, context)
        except ExpertMeshError as err:
            context.abort(err.code, str(err))
        except Exception as err:  # a bug must not take the server down
            log.exception("%s failed", handler.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")

    wrapped.__name__ = handler.__name__
    return wrapped


class ExpertGroupServicer(pb_grpc.ExpertGroupServicer):
    def __init__(self, group: str, hosted: HostedExperts):
        self.group = group
        self.hosted = hosted

    @_guard
    def Dispatch(self, request: pb.DispatchRequest, context) -> pb.DispatchResponse:
        hidden = wire.decode(request.hidden_states, "hidden_states")
        ids = wire.decode(request.expert_ids, "expert_ids")
        weights = wire.decode(request.routing_weights, "routing_weights")
        with tracer().start_as_current_span(
            "expertmesh.group.compute",
            attributes={"expertmesh.group": self.group, "expertmesh.layer": request.layer, "expertmesh.tokens": hidden.shape[0]},
        ):
            partial = self.hosted.compute(request.layer, hidden, ids, weights)
        return pb.DispatchResponse(partial_sums=wire.encode(partial))

    @_guard
    def LoadExperts(self, request: pb.LoadExpertsRequest, context) -> pb.LoadExpertsResponse:
        loaded = self.hosted.load(_pairs(request.experts))
        log.info("group %s loaded %d experts", self.group, len(loaded))
        return pb.LoadExpertsResponse(loaded=_refs(loaded), weight_bytes=self.hosted.weight_bytes())

    @_guard
    def UnloadExperts(self, request: pb.UnloadExpertsRequest, context) -> pb.UnloadExpertsResponse:
        unloaded = self.hosted.unload(_pairs(request.experts))
        log.info("group %s unloaded %d experts", self.group, len(unloaded))
        return pb.UnloadExpertsResponse(unloaded=_refs(unloaded), weight_bytes=self.hosted.weight_bytes())

    @_guard
    def Describe(self, request: pb.DescribeRequest, context) -> pb.DescribeResponse:
        return pb.DescribeResponse(
            group=self.group,
            model_type=self.hosted.spec.model_type,
            experts=_refs(self.hosted.pairs()),
            weight_bytes=self.hosted.weight_bytes(),
            dtype=wire.dtype_to_proto(self.hosted.dtype),
            device=str(self.hosted.device),
            hidden_size=self.hosted.spec.hidden_size,
            pid=os.getpid(),
        )


def start_server(group: str, hosted: HostedExperts, host: str = "127.0.0.1", port: int = 0, workers: int = 4):
    """Start the gRPC server; returns (server, bound port)."""
    server = GrpcServer("expert-group", host, port, workers, options=CHANNEL_OPTIONS)
    pb_grpc.add_ExpertGroupServicer_to_server(ExpertGroupServicer(group, hosted), server.server)
    server.start((SERVICE_NAME,))
    return server, server.port
