"""The ``expertmesh.v1.ExpertGroup`` gRPC service over HostedExperts, plus the
standard ``grpc.health.v1`` service.

Every handler validates its request; a bad one is answered with
INVALID_ARGUMENT or NOT_FOUND and a message naming the problem, and the server
keeps serving everyone else. At most ``max_concurrent_dispatch`` Dispatch calls
execute at once; one more is refused at once with RESOURCE_EXHAUSTED rather
than queued, so a router can try another replica instead of waiting.

The servicer counts the Dispatch calls executing now per (routing-table
version, layer, expert): a migration unloads a source only once no call of an
older version is in flight for the expert it moves.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from contextlib import contextmanager
from typing import Iterator

import grpc
import torch

from expertmesh import wire
from expertmesh.errors import ExpertMeshError, Overloaded
from expertmesh.expert_group.hosted import HostedExperts
from expertmesh.grpc_server import GrpcServer
from expertmesh.telemetry.setup import tracer
from expertmesh.v1 import experts_pb2 as pb
from expertmesh.v1 import experts_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "expertmesh.v1.ExpertGroup"
# Hidden states of a large prefill exceed gRPC's 4 MiB default (4k tokens of a 7168-wide
# model in fp32 are ~117 MB, and the router sends a layer's tokens in one call); more than
# this in one call is refused before it is read. The router's channels use the same options.
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
#: Dispatch calls one group executes at once by default; more are refused with RESOURCE_EXHAUSTED.
MAX_CONCURRENT_DISPATCH = 64

#: (routing_table_version, layer, expert)
InFlightKey = tuple[int, int, int]


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


def _named_experts(ids: torch.Tensor, num_experts: int) -> list[int]:
    """The distinct experts a request's expert_ids [T, K] name; nothing for ids that compute will refuse."""
    if ids.is_floating_point():
        return []
    return torch.unique(ids[(ids >= 0) & (ids < num_experts)]).tolist()


class ExpertGroupServicer(pb_grpc.ExpertGroupServicer):
    def __init__(self, group: str, hosted: HostedExperts, max_concurrent_dispatch: int = MAX_CONCURRENT_DISPATCH):
        self.group = group
        self.hosted = hosted
        self.max_concurrent_dispatch = max_concurrent_dispatch
        self._slots = threading.BoundedSemaphore(max_concurrent_dispatch)
        self._in_flight: Counter[InFlightKey] = Counter()
        self._in_flight_lock = threading.Lock()

    def in_flight(self) -> dict[InFlightKey, int]:
        """Dispatch calls executing now, by (routing_table_version, layer, expert); only non-zero counts."""
        with self._in_flight_lock:
            return dict(self._in_flight)

    @contextmanager
    def _tracking(self, version: int, layer: int, experts: list[int]) -> Iterator[None]:
        """Count one executing call for each of ``experts`` until the block exits, however it exits."""
        keys = [(version, layer, e) for e in experts]
        with self._in_flight_lock:
            self._in_flight.update(keys)
        try:
            yield
        finally:
            with self._in_flight_lock:
                self._in_flight.subtract(keys)
                for key in keys:
                    if self._in_flight[key] <= 0:
                        del self._in_flight[key]

    @_guard
    def Dispatch(self, request: pb.DispatchRequest, context) -> pb.DispatchResponse:
        if not self._slots.acquire(blocking=False):
            raise Overloaded(
                f"expert group {self.group} is executing {self.max_concurrent_dispatch} Dispatch calls, its limit; "
                "retry shortly or send to another replica"
            )
        try:
            hidden = wire.decode(request.hidden_states, "hidden_states")
            ids = wire.decode(request.expert_ids, "expert_ids")
            weights = wire.decode(request.routing_weights, "routing_weights")
            experts = _named_experts(ids, self.hosted.spec.num_experts)
            tokens = hidden.shape[0] if hidden.dim() else 0
            with self._tracking(request.routing_table_version, request.layer, experts), tracer().start_as_current_span(
                "expertmesh.group.compute",
                attributes={"expertmesh.group": self.group, "expertmesh.layer": request.layer, "expertmesh.tokens": tokens},
            ):
                partial = self.hosted.compute(request.layer, hidden, ids, weights)
            return pb.DispatchResponse(partial_sums=wire.encode(partial))
        finally:
            self._slots.release()

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
            budget_bytes=self.hosted.budget_bytes or 0,
            in_flight=[
                pb.InFlight(routing_table_version=version, layer=layer, expert=expert, calls=calls)
                for (version, layer, expert), calls in sorted(self.in_flight().items())
            ],
            expert_stats=[
                pb.ExpertStats(
                    layer=layer,
                    expert=expert,
                    calls=stats.calls,
                    rows=stats.rows,
                    non_finite=stats.non_finite,
                    norm_mean=stats.norm_mean,
                    norm_var=stats.norm_var,
                )
                for layer, expert, stats in self.hosted.expert_stats()
            ],
        )


def start_server(
    group: str,
    hosted: HostedExperts,
    host: str = "127.0.0.1",
    port: int = 0,
    workers: int = 4,
    max_concurrent_dispatch: int = MAX_CONCURRENT_DISPATCH,
):
    """Start the gRPC server; returns (server, bound port).

    The thread pool has one thread per Dispatch slot plus ``workers`` more, so a full
    set of Dispatch calls neither blocks Describe, LoadExperts and health checks nor
    delays the refusal of one call too many.
    """
    servicer = ExpertGroupServicer(group, hosted, max_concurrent_dispatch)
    server = GrpcServer("expert-group", host, port, max_concurrent_dispatch + workers, options=CHANNEL_OPTIONS)
    pb_grpc.add_ExpertGroupServicer_to_server(servicer, server.server)
    server.start((SERVICE_NAME,))
    return server, server.port
