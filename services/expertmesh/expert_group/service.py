"""The ``expertmesh.v1.ExpertGroup`` gRPC service over HostedExperts, plus the
standard ``grpc.health.v1`` service.

Every handler validates its request; a bad one is answered with
INVALID_ARGUMENT or NOT_FOUND and a message naming the problem, and the server
keeps serving everyone else. At most ``max_concurrent_dispatch`` Dispatch calls
execute at once; one more is refused at once with RESOURCE_EXHAUSTED rather
than queued, so a router can try another replica instead of waiting.
LoadExperts and UnloadExperts are admin RPCs: the server's interceptor lets
them through only with an admin identity (``expertmesh.infra.security.admin_auth``).

The servicer counts the Dispatch calls executing now per (routing-table
version, layer, expert): a migration unloads a source only once no call of an
older version is in flight for the expert it moves. It also keeps the group's
busy time (``busy.BusyClock``), which the drift controller turns into a busy fraction.
Dispatch names its caller's checkpoint fingerprint, and a group of another
checkpoint refuses it (FAILED_PRECONDITION, ``ForeignCheckpoint``): a group
started from a checkpoint of the same shapes would answer with partial sums that
pass every check and change answers. Describe reports the group's fingerprint.
Fingerprint recomputes hosted experts' weight checksums for the health monitor,
and LoadExperts with ``reload`` is its repair. InjectFault corrupts an expert on
purpose (the chaos benchmark's memory fault): an admin RPC that a group refuses
with FAILED_PRECONDITION unless it was started with
``EXPERTMESH_ENABLE_FAULT_INJECTION=1`` (``config.FaultInjectionConfig``).

Dispatch arrives by three transports, all computed by ``ExpertGroupServicer.compute``
(one set of limits, counts and checks): unary Dispatch, the ExpertGroupStream
service (``stream_service``: one gRPC stream per router, raw-bytes frames) and,
for routers on this host, shared memory (``local_server``). ``GroupServer``
serves all three; Transports tells a router how to reach the same-host ones.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import grpc
import torch
from opentelemetry import propagate

from expertmesh.config.settings import AdminAuthConfig, FaultInjectionConfig, TlsConfig
from expertmesh.contracts import shared_buffer, wire
from expertmesh.contracts.errors import (
    ExpertMeshError,
    FaultInjectionDisabled,
    ForeignCheckpoint,
    InvalidRequest,
    Overloaded,
)
from expertmesh.expert_group.busy import BusyClock
from expertmesh.expert_group.transport_use import TransportUse, offered
from expertmesh.infra import device_memory
from expertmesh.infra.group_channels import CHANNEL_OPTIONS
from expertmesh.infra.grpc_server import GrpcServer, guarded
from expertmesh.infra.security import from_env
from expertmesh.infra.telemetry.setup import tracer
from expertmesh.models.hosted_experts import HostedExperts
from expertmesh.v1 import experts_pb2 as pb
from expertmesh.v1 import experts_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "expertmesh.v1.ExpertGroup"
#: Dispatch calls one group executes at once by default; more are refused with RESOURCE_EXHAUSTED.
MAX_CONCURRENT_DISPATCH = 64

#: (routing_table_version, layer, expert)
InFlightKey = tuple[int, int, int]


def _pairs(refs) -> list[tuple[int, int]]:
    return [(r.layer, r.expert) for r in refs]


def _refs(pairs) -> list[pb.ExpertRef]:
    return [pb.ExpertRef(layer=layer, expert=e) for layer, e in pairs]


def _peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM). Not getrusage's maxrss: a process started by a
    large one inherits that one's figure across fork and exec."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    return 0


def _named_experts(ids: torch.Tensor, num_experts: int) -> list[int]:
    """The distinct experts a request's expert_ids [T, K] name; nothing for ids that compute will refuse."""
    if ids.is_floating_point():
        return []
    # Plain Python over the ids beats torch.unique (and masking) many times over at decode sizes, and
    # every call pays this; at prefill sizes it is small next to the experts' own work.
    return sorted({e for e in set(ids.reshape(-1).tolist()) if 0 <= e < num_experts})


#: InjectFault's kinds, as HostedExperts.inject_fault names them
_FAULT_KINDS = {pb.FAULT_KIND_SCALE: "scale", pb.FAULT_KIND_NAN: "nan"}


class ExpertGroupServicer(pb_grpc.ExpertGroupServicer):
    def __init__(
        self,
        group: str,
        hosted: HostedExperts,
        max_concurrent_dispatch: int = MAX_CONCURRENT_DISPATCH,
        faults: FaultInjectionConfig | None = None,
        warm_up_s: float | None = None,
    ):
        """``warm_up_s``: what the group's warm-up took before it served (None: it ran none), for Describe."""
        self.group = group
        self.warm_up_s = warm_up_s
        self.hosted = hosted
        self.max_concurrent_dispatch = max_concurrent_dispatch
        #: whether InjectFault is accepted; read once, at start (default: the environment's)
        self.faults = faults if faults is not None else from_env(FaultInjectionConfig)
        self._slots = threading.BoundedSemaphore(max_concurrent_dispatch)
        self._in_flight: Counter[InFlightKey] = Counter()
        self._in_flight_lock = threading.Lock()
        self.busy = BusyClock()
        self.transport_use = TransportUse()
        #: what Transports answers; the server fills in its same-host paths once they listen
        self.transports = pb.TransportsResponse(
            host_id=shared_buffer.host_id(), gpu_uuid=shared_buffer.gpu_uuid(hosted.device) or ""
        )

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

    def compute(
        self,
        layer: int,
        version: int,
        hidden: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        parent=None,
        model: str = "",
    ) -> torch.Tensor:
        """One Dispatch, whichever transport carried it: hidden [T, H], ids [T, K], weights [T, K] ->
        partial sums [T, H]. Refuses a caller of another checkpoint (``model``: its fingerprint, "" not
        checked) with ForeignCheckpoint. Takes a slot (none free: Overloaded), counts the call in flight
        and busy, and traces it under ``parent`` (an OpenTelemetry context; None: the current one)."""
        self.check_model(model)
        if not self._slots.acquire(blocking=False):
            raise Overloaded(
                f"expert group {self.group} is executing {self.max_concurrent_dispatch} Dispatch calls, its limit; "
                "retry shortly or send to another replica"
            )
        try:
            experts = _named_experts(ids, self.hosted.spec.num_experts)
            tokens = hidden.shape[0] if hidden.dim() else 0
            with (
                self._tracking(version, layer, experts),
                tracer().start_as_current_span(
                    "expertmesh.group.compute",
                    context=parent,
                    attributes={"expertmesh.group": self.group, "expertmesh.layer": layer, "expertmesh.tokens": tokens},
                ),
                self.busy.running(),
            ):
                return self.hosted.compute(layer, hidden, ids, weights)
        finally:
            self._slots.release()

    def attempt(
        self, transport: str, call: Callable[[], torch.Tensor]
    ) -> tuple[torch.Tensor | None, grpc.StatusCode, str]:
        """One call carried by ``transport`` (counted: what Describe reports per transport), run by ``call`` (its
        tensors read and ``compute``): (partial sums [T, H], OK, "") or (None, the refusal's status, its message).
        Never raises: one bad call must not end the stream, connection or step it came on, let alone the group.
        The fast paths' answer (``answer``) and the router's calls in this process both take it."""
        try:
            self.transport_use.called(transport)
            return call(), grpc.StatusCode.OK, ""
        except ExpertMeshError as err:
            return None, err.code, str(err)
        except Exception as err:  # what the unary path's guard answers INTERNAL
            log.exception("Dispatch over %s failed", transport)
            return None, grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}"

    def check_model(self, model: str) -> None:
        """ForeignCheckpoint unless ``model`` (a caller's checkpoint fingerprint; "": not said) is this group's."""
        mine = self.hosted.spec.fingerprint
        if model and mine and model != mine:
            raise ForeignCheckpoint(
                f"expert group {self.group} holds checkpoint {mine} ({self.hosted.checkpoint.path}), not the "
                f"caller's {model}: it was started from another checkpoint (an upgrade in progress, a wrong volume); "
                "start it from the deployment's checkpoint, or under a deployment of its own"
            )

    def answer(
        self, frame: pb.DispatchFrame, transport: str, tensors: Callable[[], list[torch.Tensor]]
    ) -> tuple[pb.DispatchFrame, torch.Tensor | None]:
        """The answer to one frame of the fast paths: (frame, partial sums [T, H]), or an error frame and
        None. ``tensors()`` reads the call's tensors (validating them). Never raises: one bad frame must
        not end the stream or connection it came on, let alone the group."""
        answer = pb.DispatchFrame(call_id=frame.call_id, layer=frame.layer)

        def call() -> torch.Tensor:
            hidden, ids, weights = tensors()
            parent = propagate.extract(frame.trace_context) if frame.trace_context else None
            return self.compute(
                frame.layer, frame.routing_table_version, hidden, ids, weights, parent, frame.model_fingerprint
            )

        partial, code, message = self.attempt(transport, call)
        if partial is None:
            answer.code, answer.message = code.value[0], message
        return answer, partial

    @guarded
    def Dispatch(self, request: pb.DispatchRequest, context) -> pb.DispatchResponse:
        self.transport_use.called("grpc-unary")
        hidden = wire.decode(request.hidden_states, "hidden_states")
        ids = wire.decode(request.expert_ids, "expert_ids")
        weights = wire.decode(request.routing_weights, "routing_weights")
        partial = self.compute(
            request.layer, request.routing_table_version, hidden, ids, weights, model=request.model_fingerprint
        )
        return pb.DispatchResponse(partial_sums=wire.encode(partial))

    @guarded
    def LoadExperts(self, request: pb.LoadExpertsRequest, context) -> pb.LoadExpertsResponse:
        loaded = self.hosted.load(_pairs(request.experts), reload=request.reload)
        log.info("group %s %s %d experts", self.group, "reloaded" if request.reload else "loaded", len(loaded))
        return pb.LoadExpertsResponse(loaded=_refs(loaded), weight_bytes=self.hosted.weight_bytes())

    @guarded
    def UnloadExperts(self, request: pb.UnloadExpertsRequest, context) -> pb.UnloadExpertsResponse:
        unloaded = self.hosted.unload(_pairs(request.experts))
        log.info("group %s unloaded %d experts", self.group, len(unloaded))
        return pb.UnloadExpertsResponse(unloaded=_refs(unloaded), weight_bytes=self.hosted.weight_bytes())

    @guarded
    def Describe(self, request: pb.DescribeRequest, context) -> pb.DescribeResponse:
        memory = device_memory.measure(self.hosted.device)
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
            busy_seconds=self.busy.seconds(),
            transports=self.transport_use.report(),
            peak_rss_bytes=_peak_rss_bytes(),
            transports_offered=offered(self.transports),
            model_fingerprint=self.hosted.spec.fingerprint,
            warm_up_seconds=self.warm_up_s or 0.0,
            memory_used_bytes=memory.used_bytes,
            memory_total_bytes=memory.total_bytes,
        )

    @guarded
    def Fingerprint(self, request: pb.FingerprintRequest, context) -> pb.FingerprintResponse:
        pairs = _pairs(request.experts) or None
        return pb.FingerprintResponse(
            fingerprints=[
                pb.ExpertFingerprint(layer=layer, expert=expert, loaded=loaded, current=current)
                for layer, expert, loaded, current in self.hosted.fingerprints(pairs)
            ]
        )

    @guarded
    def Transports(self, request: pb.TransportsRequest, context) -> pb.TransportsResponse:
        return self.transports

    @guarded
    def InjectFault(self, request: pb.InjectFaultRequest, context) -> pb.InjectFaultResponse:
        if not self.faults.enable_fault_injection:
            raise FaultInjectionDisabled(
                f"expert group {self.group} refuses InjectFault: fault injection is for tests and chaos runs, "
                "enabled only by starting the group with EXPERTMESH_ENABLE_FAULT_INJECTION=1"
            )
        if request.kind not in _FAULT_KINDS:
            raise InvalidRequest(f"InjectFault needs a kind: FAULT_KIND_SCALE or FAULT_KIND_NAN, got {request.kind}")
        layer, expert = request.expert.layer, request.expert.expert
        loaded, current = self.hosted.inject_fault(layer, expert, _FAULT_KINDS[request.kind], request.factor)
        log.warning(
            "group %s: injected a %s fault into layer %d expert %d",
            self.group,
            _FAULT_KINDS[request.kind],
            layer,
            expert,
        )
        return pb.InjectFaultResponse(
            fingerprint=pb.ExpertFingerprint(layer=layer, expert=expert, loaded=loaded, current=current)
        )


#: gRPC streams (one per router) a group serves at once; each holds a server thread while open.
MAX_STREAMS = 32


class GroupServer(GrpcServer):
    """An expert group's gRPC server with every Dispatch path: unary, the stream service and, unless
    ``same_host`` is off, for routers on this host a unix socket of this same gRPC server and the
    shared-memory socket (their files live in ``local_server.runtime_dir()`` and go at stop).

    The thread pool has one thread per Dispatch slot and per stream plus ``workers`` more, so a full
    set of Dispatch calls neither blocks Describe, LoadExperts and health checks nor delays the
    refusal of one call too many. With TLS (``tls``, default the environment's) the server requires
    client certificates: only routers and the orchestrator call groups. LoadExperts and UnloadExperts
    need an admin identity (``admin``; see expertmesh.infra.security).
    """

    def __init__(
        self,
        servicer: ExpertGroupServicer,
        host: str = "127.0.0.1",
        port: int = 0,
        workers: int = 4,
        *,
        tls: TlsConfig | None = None,
        admin: AdminAuthConfig | None = None,
        same_host: bool = True,
    ):
        from expertmesh.contracts.frames import STREAM_SERVICE_NAME
        from expertmesh.expert_group.local_server import LocalServer, remove_files, remove_stale_sockets, runtime_dir
        from expertmesh.expert_group.stream_service import add_stream_service

        super().__init__(
            "expert-group",
            host,
            port,
            servicer.max_concurrent_dispatch + MAX_STREAMS + workers,
            options=CHANNEL_OPTIONS,
            tls=tls,
            admin=admin,
            require_client_cert=True,
        )
        self.servicer = servicer
        self._services = (SERVICE_NAME, STREAM_SERVICE_NAME)
        pb_grpc.add_ExpertGroupServicer_to_server(servicer, self.server)
        add_stream_service(self.server, servicer, MAX_STREAMS)
        self.local: LocalServer | None = None
        #: the socket files go at stop, or when this process exits without stopping (a Serve replica
        #: whose actor is torn down): routers then find nothing there rather than a dead socket
        socket_files: list[Path] = []
        self._remove_socket_files = weakref.finalize(self, remove_files, socket_files)
        if not same_host:
            return
        try:
            directory = runtime_dir()
            remove_stale_sockets(directory)
            unix_path = directory / f"{os.getpid()}-{os.urandom(4).hex()}-grpc.sock"
            servicer.transports.grpc_unix_address = self.add_unix_port(str(unix_path))
            socket_files.append(unix_path)
            self.local = LocalServer(servicer, directory)
            socket_files.append(self.local.path)
        except OSError as err:
            log.warning("expert group %s serves no same-host paths (gRPC over TCP only): %s", servicer.group, err)
            return
        servicer.transports.shm_socket = str(self.local.path)
        servicer.transports.shm_token = self.local.token

    def start(self, services: tuple[str, ...] = ()) -> "GroupServer":
        if self.local is not None:
            self.local.start()
        super().start((*self._services, *services))
        return self

    def stop(self, grace: float = 2.0) -> None:
        try:
            super().stop(grace)
        finally:
            if self.local is not None:
                self.local.stop()
            self._remove_socket_files()


def start_server(
    group: str,
    hosted: HostedExperts,
    host: str = "127.0.0.1",
    port: int = 0,
    workers: int = 4,
    max_concurrent_dispatch: int = MAX_CONCURRENT_DISPATCH,
    tls: TlsConfig | None = None,
    admin: AdminAuthConfig | None = None,
    warm_up_s: float | None = None,
) -> tuple[GroupServer, int]:
    """Serve ``hosted`` as group ``group`` (see GroupServer); returns (server, bound TCP port). ``warm_up_s``:
    what its warm-up took (``HostedExperts.warm_up``, run before: the server reports SERVING only after it)."""
    servicer = ExpertGroupServicer(group, hosted, max_concurrent_dispatch, warm_up_s=warm_up_s)
    server = GroupServer(servicer, host, port, workers, tls=tls, admin=admin).start()
    return server, server.port
