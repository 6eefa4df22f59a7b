"""Errors a person can act on. Each carries the gRPC status it maps to, so a
server answers with the right code and the CLI exits 2 with one line."""

from __future__ import annotations

import grpc


class ExpertMeshError(Exception):
    """Base class: ``str(err)`` is the one-line message shown to the user, ``code`` the gRPC status
    it maps to: INVALID_ARGUMENT unless a subclass names another (``class X(ExpertMeshError,
    code=grpc.StatusCode.NOT_FOUND)``) or inherits one."""

    code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT

    def __init_subclass__(cls, code: grpc.StatusCode | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code


class CheckpointError(ExpertMeshError):
    """The checkpoint directory is missing, unreadable, or not an MoE model."""


class InputError(ExpertMeshError):
    """Bad input a person gave: a file, a flag or a value that cannot be used (a command exits 2 with it;
    a server answers INVALID_ARGUMENT). The more specific errors below say which input."""


class PlacementError(InputError):
    """A placement (the group map or the GPU plan) leaves an expert unhosted or names one that does not exist."""


class InvalidRequest(ExpertMeshError):
    """A request is malformed: wrong shape, dtype, sizes or bytes. ``field``: the request field at fault, as the
    API that refused it spells it (None: the request as a whole); ``reason``: a machine-readable kind of refusal
    (the HTTP API's error ``code``)."""

    def __init__(self, message: str, *, field: str | None = None, reason: str = "invalid_value"):
        super().__init__(message)
        self.field = field
        self.reason = reason


class NotHosted(ExpertMeshError, code=grpc.StatusCode.NOT_FOUND):
    """A request names a layer or expert that this server does not hold."""


class GroupUnavailable(ExpertMeshError, code=grpc.StatusCode.UNAVAILABLE):
    """An expert group could not be reached or failed a call."""


class Overloaded(ExpertMeshError, code=grpc.StatusCode.RESOURCE_EXHAUSTED):
    """The server's concurrency or queue limits are full; retry later."""


class OverBudget(ExpertMeshError, code=grpc.StatusCode.RESOURCE_EXHAUSTED):
    """Loading these experts would take a group's expert weights past its memory budget."""


class ShuttingDown(ExpertMeshError, code=grpc.StatusCode.UNAVAILABLE):
    """The server is draining and takes no new requests."""


class NonFiniteLogits(ExpertMeshError, code=grpc.StatusCode.INTERNAL):
    """A forward pass produced NaN or Inf logits (a faulty expert, an overflow):
    any token chosen from them would be a wrong answer, so the request fails instead."""


class RoutingTableRefused(ExpertMeshError, code=grpc.StatusCode.UNAVAILABLE):
    """A routing table a router must not serve; routers refuse it and keep their last good one."""


class UnhostedExperts(RoutingTableRefused):
    """A routing table leaves some experts without a group."""


class RoutingTableMismatch(RoutingTableRefused, code=grpc.StatusCode.FAILED_PRECONDITION):
    """A routing table was made for another model (fingerprint, MoE layers, experts per layer) or names
    experts its model does not have: served, it would change answers with status OK."""


class StoreCollision(ExpertMeshError, code=grpc.StatusCode.FAILED_PRECONDITION):
    """The state store's key prefix holds the routing table of another model: two deployments share it."""


class ForeignCheckpoint(ExpertMeshError, code=grpc.StatusCode.FAILED_PRECONDITION):
    """An expert group holds another checkpoint than its caller's (their fingerprints differ): a rolling
    upgrade, a wrong volume. Its partial sums have the right shape and would change answers with status OK."""


class BadGroupResponse(ExpertMeshError, code=grpc.StatusCode.INTERNAL):
    """An expert group answered OK with partial sums that cannot be right (shape, dtype, NaN/Inf)."""


class MigrationRefused(ExpertMeshError, code=grpc.StatusCode.FAILED_PRECONDITION):
    """A migration cannot start or go on as asked: the expert, a group or the routing table does not allow it."""


class GroupChangeRefused(ExpertMeshError, code=grpc.StatusCode.FAILED_PRECONDITION):
    """An expert group cannot be added or removed now: the last group, experts that fit nowhere else, a change
    in flight, or a platform that cannot start groups."""


class GroupSpecRefused(GroupChangeRefused):
    """A group of that spec can never be placed on this platform (GPUs it does not have, an island it has no
    workers for, a node where nodes cannot be named): asking again does not help; another spec or platform does.
    An ExpertGroup object asking for one is Refused, not kept Pending."""


class GroupNotFound(ExpertMeshError, code=grpc.StatusCode.NOT_FOUND):
    """No expert group of that name is known to the orchestrator."""


class QuarantineRefused(ExpertMeshError, code=grpc.StatusCode.FAILED_PRECONDITION):
    """A quarantine or release cannot be done as asked: the expert, the group or its state does not allow it."""


class FaultInjectionDisabled(ExpertMeshError, code=grpc.StatusCode.FAILED_PRECONDITION):
    """InjectFault on a group that was not started with fault injection enabled."""


class CanaryRefused(ExpertMeshError, code=grpc.StatusCode.FAILED_PRECONDITION):
    """A canary action that does not fit the canary's state (a start while one runs, a promote with none)."""


class MigrationNotFound(ExpertMeshError, code=grpc.StatusCode.NOT_FOUND):
    """No migration with that id is in the state store."""


class SecurityMisconfigured(ExpertMeshError):
    """TLS or admin-auth settings are incomplete or unreadable (a certificate without its key, a missing file)."""


class DeadlineExceeded(ExpertMeshError, code=grpc.StatusCode.DEADLINE_EXCEEDED):
    """Every request a step serves has passed its deadline; waiting longer for a group helps nobody."""


class DeviceUnavailable(ExpertMeshError, code=grpc.StatusCode.FAILED_PRECONDITION):
    """A setting names a device this process cannot use (a CUDA GPU where torch sees none)."""


class StoreAccessDenied(ExpertMeshError, code=grpc.StatusCode.PERMISSION_DENIED):
    """The state store refused a command on a key to this process's user (its Redis ACL)."""
