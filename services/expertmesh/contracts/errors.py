"""Errors a person can act on. Each carries the gRPC status it maps to, so a
server answers with the right code and the CLI exits 2 with one line."""

from __future__ import annotations

import grpc


class ExpertMeshError(Exception):
    """Base class: ``str(err)`` is the one-line message shown to the user."""

    code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT


class CheckpointError(ExpertMeshError):
    """The checkpoint directory is missing, unreadable, or not an MoE model."""


class InputError(ExpertMeshError):
    """Bad input a person gave: a file, a flag or a value that cannot be used (a command exits 2 with it;
    a server answers INVALID_ARGUMENT). The more specific errors below say which input."""


class PlacementError(InputError):
    """A placement (the group map or the GPU plan) leaves an expert unhosted or names one that does not exist."""


class InvalidRequest(ExpertMeshError):
    """A request is malformed: wrong shape, dtype, sizes or bytes."""


class NotHosted(ExpertMeshError):
    """A request names a layer or expert that this server does not hold."""

    code = grpc.StatusCode.NOT_FOUND


class GroupUnavailable(ExpertMeshError):
    """An expert group could not be reached or failed a call."""

    code = grpc.StatusCode.UNAVAILABLE


class Overloaded(ExpertMeshError):
    """The server's concurrency or queue limits are full; retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class OverBudget(ExpertMeshError):
    """Loading these experts would take a group's expert weights past its memory budget."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ShuttingDown(ExpertMeshError):
    """The server is draining and takes no new requests."""

    code = grpc.StatusCode.UNAVAILABLE


class NonFiniteLogits(ExpertMeshError):
    """A forward pass produced NaN or Inf logits (a faulty expert, an overflow):
    any token chosen from them would be a wrong answer, so the request fails instead."""

    code = grpc.StatusCode.INTERNAL


class RoutingTableRefused(ExpertMeshError):
    """A routing table a router must not serve; routers refuse it and keep their last good one."""

    code = grpc.StatusCode.UNAVAILABLE


class UnhostedExperts(RoutingTableRefused):
    """A routing table leaves some experts without a group."""


class RoutingTableMismatch(RoutingTableRefused):
    """A routing table was made for another model (fingerprint, MoE layers, experts per layer) or names
    experts its model does not have: served, it would change answers with status OK."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class StoreCollision(ExpertMeshError):
    """The state store's key prefix holds the routing table of another model: two deployments share it."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class BadGroupResponse(ExpertMeshError):
    """An expert group answered OK with partial sums that cannot be right (shape, dtype, NaN/Inf)."""

    code = grpc.StatusCode.INTERNAL


class MigrationRefused(ExpertMeshError):
    """A migration cannot start or go on as asked: the expert, a group or the routing table does not allow it."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class QuarantineRefused(ExpertMeshError):
    """A quarantine or release cannot be done as asked: the expert, the group or its state does not allow it."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class FaultInjectionDisabled(ExpertMeshError):
    """InjectFault on a group that was not started with fault injection enabled."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class MigrationNotFound(ExpertMeshError):
    """No migration with that id is in the state store."""

    code = grpc.StatusCode.NOT_FOUND


class SecurityMisconfigured(ExpertMeshError):
    """TLS or admin-auth settings are incomplete or unreadable (a certificate without its key, a missing file)."""


class DeadlineExceeded(ExpertMeshError):
    """Every request a step serves has passed its deadline; waiting longer for a group helps nobody."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class DeviceUnavailable(ExpertMeshError):
    """A setting names a device this process cannot use (a CUDA GPU where torch sees none)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
