"""The orchestrator's gRPC calls to expert groups, with typed answers.

Channels follow the endpoints the state store lists: one per address, reopened
when a group's address changes. A failed call raises ``GroupCallFailed`` with
the gRPC status, and the caller decides what it means there (RESOURCE_EXHAUSTED
on LoadExperts is a full memory budget; on Dispatch, a busy group).

Given the orchestrator's checkpoint fingerprint (the migration executor's and
the reconciler's channels), the channels refuse a group started from another
checkpoint: its Describe is FAILED_PRECONDITION (so no migration places experts
on it and no table rebuilt from what runs lists it) and every Dispatch names the
fingerprint (the group refuses a foreign caller itself). The health monitor's
channels take any group: it probes what a group computes against its own
checkpoint, and quarantines a replica that differs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import torch

from expertmesh.contracts import wire
from expertmesh.contracts.errors import ExpertMeshError
from expertmesh.infra.group_channels import GroupClients
from expertmesh.infra.security.admin_auth import admin_metadata
from expertmesh.orchestrator.migration.plan import Canary, InFlightCalls, Pair
from expertmesh.v1 import experts_pb2 as pb
from expertmesh.v1 import experts_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

#: Describe, Dispatch and UnloadExperts are quick; LoadExperts reads weights from disk.
CALL_TIMEOUT_S = 30.0
#: a reconcile round asks every group: one that hangs must not hold the round for long
DESCRIBE_TIMEOUT_S = 5.0
LOAD_TIMEOUT_S = 600.0


class GroupCallFailed(Exception):
    def __init__(self, group: str, code: grpc.StatusCode, details: str):
        super().__init__(f"group {group!r}: {code.name}: {details}")
        self.group = group
        self.code = code
        self.details = details


@dataclass(frozen=True)
class GroupView:
    """One Describe answer, in the terms a migration (and the drift controller) needs."""

    group: str
    dtype: torch.dtype
    hidden_size: int
    pairs: frozenset[Pair]
    weight_bytes: int
    #: 0 = unlimited
    budget_bytes: int
    #: pair -> Dispatch calls executing now for it, by routing-table version
    in_flight: dict[Pair, tuple[InFlightCalls, ...]]
    #: cumulative seconds with a Dispatch computing, since the group's server started
    busy_seconds: float = 0.0
    #: pair -> rows of its output that held a NaN or an Inf since it was loaded (Describe's expert_stats)
    non_finite_rows: dict[Pair, int] = field(default_factory=dict)
    #: the group server's process id (a restarted replica answers with another)
    pid: int = 0
    #: transport ("grpc-stream", "shm", ...) -> calls routers made on it since the server started
    transport_calls: dict[str, int] = field(default_factory=dict)
    #: the fingerprint of the checkpoint the group's experts come from ("" from a group that does not say)
    model_fingerprint: str = ""
    #: memory measured where the group computes (Describe's memory_used_bytes / memory_total_bytes; 0: not measured)
    memory_used_bytes: int = 0
    memory_total_bytes: int = 0

    def holds(self, pair: Pair) -> bool:
        return pair in self.pairs

    def in_flight_for(self, pair: Pair) -> tuple[InFlightCalls, ...]:
        return self.in_flight.get(pair, ())


@dataclass(frozen=True)
class Fingerprint:
    """One expert's weight fingerprint (``expert_group.fingerprint``)."""

    #: when its weights were read from disk
    loaded: str
    #: recomputed for this answer
    current: str

    @property
    def intact(self) -> bool:
        return self.loaded == self.current


@dataclass(frozen=True)
class Loaded:
    #: False when the group held the expert already
    added: bool
    #: the group's expert weights after the call
    weight_bytes: int


def _ref(pair: Pair) -> pb.ExpertRef:
    return pb.ExpertRef(layer=pair[0], expert=pair[1])


class GroupChannels:
    """The orchestrator's calls to expert groups, over one ``GroupClients`` channel cache following
    the endpoints the state store lists (the router keeps its own the same way)."""

    def __init__(self, endpoints: Callable[[], dict[str, str]], model_fingerprint: str = ""):
        """``model_fingerprint``: the orchestrator's checkpoint's; groups of another are refused ("": any)."""
        self._endpoints = endpoints
        self._model = model_fingerprint
        self._clients = GroupClients()

    def _stub(self, group: str) -> pb_grpc.ExpertGroupStub:
        endpoints = self._endpoints()
        if group not in endpoints:
            raise GroupCallFailed(group, grpc.StatusCode.UNAVAILABLE, "no endpoint in the state store")
        self._clients.update(endpoints)
        return self._clients.stub(group)

    def _call(self, group: str, method: str, request, timeout: float = CALL_TIMEOUT_S):
        """One RPC; admin ones (load, unload, fingerprints, faults) need the identity it carries."""
        try:
            return getattr(self._stub(group), method)(request, timeout=timeout, metadata=admin_metadata())
        except grpc.RpcError as err:
            raise GroupCallFailed(group, err.code(), err.details() or "") from None

    def describe(self, group: str, timeout: float = CALL_TIMEOUT_S) -> GroupView:
        """The group's Describe; FAILED_PRECONDITION for a group of another checkpoint than ours."""
        r = self._call(group, "Describe", pb.DescribeRequest(), timeout)
        if self._model and r.model_fingerprint and r.model_fingerprint != self._model:
            raise GroupCallFailed(
                group,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"it holds checkpoint {r.model_fingerprint}, not this deployment's {self._model}: it was started "
                "from another checkpoint (an upgrade in progress, a wrong volume); no experts are placed on it "
                "until it runs the deployment's checkpoint",
            )
        in_flight: dict[Pair, list[InFlightCalls]] = {}
        for f in r.in_flight:
            in_flight.setdefault((f.layer, f.expert), []).append(InFlightCalls(f.routing_table_version, f.calls))
        try:
            dtype = wire.dtype_from_proto(r.dtype, f"group {group}'s dtype")
        except ExpertMeshError as err:
            raise GroupCallFailed(group, grpc.StatusCode.INTERNAL, str(err)) from None
        return GroupView(
            group=group,
            dtype=dtype,
            hidden_size=r.hidden_size,
            pairs=frozenset((e.layer, e.expert) for e in r.experts),
            weight_bytes=r.weight_bytes,
            budget_bytes=r.budget_bytes,
            in_flight={pair: tuple(calls) for pair, calls in in_flight.items()},
            busy_seconds=r.busy_seconds,
            non_finite_rows={(s.layer, s.expert): s.non_finite for s in r.expert_stats},
            pid=r.pid,
            transport_calls={t.transport: t.calls for t in r.transports},
            model_fingerprint=r.model_fingerprint,
            memory_used_bytes=r.memory_used_bytes,
            memory_total_bytes=r.memory_total_bytes,
        )

    def load(self, group: str, pair: Pair) -> Loaded:
        r = self._call(group, "LoadExperts", pb.LoadExpertsRequest(experts=[_ref(pair)]), LOAD_TIMEOUT_S)
        return Loaded(added=any((e.layer, e.expert) == pair for e in r.loaded), weight_bytes=r.weight_bytes)

    def reload(self, group: str, pair: Pair) -> None:
        """Read the pair's weights from disk again on ``group`` (loading it if it is not held)."""
        self._call(group, "LoadExperts", pb.LoadExpertsRequest(experts=[_ref(pair)], reload=True), LOAD_TIMEOUT_S)

    def fingerprints(self, group: str, pairs: list[Pair] | None = None) -> dict[Pair, Fingerprint]:
        """``pairs`` (default: every expert the group holds) -> weight fingerprint at load and recomputed now."""
        request = pb.FingerprintRequest(experts=[_ref(p) for p in pairs or ()])
        r = self._call(group, "Fingerprint", request, LOAD_TIMEOUT_S)
        return {(f.layer, f.expert): Fingerprint(f.loaded, f.current) for f in r.fingerprints}

    def unload(self, group: str, pair: Pair) -> bool:
        """Whether the group held the expert until now."""
        r = self._call(group, "UnloadExperts", pb.UnloadExpertsRequest(experts=[_ref(pair)]))
        return any((e.layer, e.expert) == pair for e in r.unloaded)

    def dispatch(self, group: str, layer: int, canary: Canary) -> torch.Tensor:
        """The group's partial sums [T, H] for ``canary``, sent with routing-table version 0 (none)."""
        request = pb.DispatchRequest(
            layer=layer,
            hidden_states=wire.encode(canary.hidden),
            expert_ids=wire.encode(canary.expert_ids),
            routing_weights=wire.encode(canary.weights),
            routing_table_version=0,
            model_fingerprint=self._model,
        )
        r = self._call(group, "Dispatch", request)
        try:
            return wire.decode(r.partial_sums, f"group {group}'s partial sums")
        except ExpertMeshError as err:
            raise GroupCallFailed(group, grpc.StatusCode.INTERNAL, str(err)) from None

    def inject_fault(self, group: str, pair: Pair, kind: int, factor: float = 0.0) -> Fingerprint:
        """Corrupt ``pair``'s weights on ``group`` in place (``pb.FaultKind``; test-only: refused with
        FAILED_PRECONDITION unless the group enables it). Returns its fingerprints, now differing."""
        r = self._call(group, "InjectFault", pb.InjectFaultRequest(expert=_ref(pair), kind=kind, factor=factor))
        return Fingerprint(r.fingerprint.loaded, r.fingerprint.current)

    def close(self) -> None:
        self._clients.close()


def held_pairs(channels: GroupChannels, groups) -> dict[str, frozenset[Pair]]:
    """group -> the pairs it reports holding (Describe), for those of ``groups`` that answered (and hold
    ``channels``' checkpoint)."""
    held = {}
    for group in groups:
        try:
            held[group] = channels.describe(group, timeout=DESCRIBE_TIMEOUT_S).pairs
        except GroupCallFailed as err:
            log.info("expert group %s did not describe what it holds: %s", group, err)
    return held
