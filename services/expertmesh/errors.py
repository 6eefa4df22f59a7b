"""Errors a person can act on. Each carries the gRPC status it maps to, so a
server answers with the right code and the CLI exits 2 with one line."""

from __future__ import annotations

import grpc


class ExpertMeshError(Exception):
    """Base class: ``str(err)`` is the one-line message shown to the user."""

    code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT


class CheckpointError(ExpertMeshError):
    """The checkpoint directory is missing, unreadable, or not an MoE model."""


class PlacementError(ExpertMeshError):
    """A placement leaves an expert unhosted or names one that does not exist."""


class InvalidRequest(ExpertMeshError):
    """A request is malformed: wrong shape, dtype, sizes or bytes."""


class NotHosted(ExpertMeshError):
    """A request names a layer or expert that this server does not hold."""

    code = grpc.StatusCode.NOT_FOUND


class GroupUnavailable(ExpertMeshError):
    """An expert group could not be reached or failed a call."""

    code = grpc.StatusCode.UNAVAILABLE


class Overloaded(ExpertMeshError):
    """The server's active-sequence and queue limits are full; retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ShuttingDown(ExpertMeshError):
    """The server is draining and takes no new requests."""

    code = grpc.StatusCode.UNAVAILABLE
