"""How one group's share of a MoE layer reaches it: the transport interface.

The dispatcher chooses replicas, retries, fails over and checks every answer; a
transport only carries one ``GroupRequest`` to one named group and brings back a
``GroupReply`` (the partial sums as the group sent them, unchecked) or raises
``TransportError`` with a gRPC status code. Paths, fastest first:

- ``local.LocalPath``: the group is on this host; tensors in a shared
  buffer (a memfd, or CUDA IPC for a router whose tensors are on the group's GPU),
  a small frame on a unix socket;
- ``stream.StreamPath``: one long-lived gRPC stream per group with
  raw-bytes frames, over the group's unix socket when it is on this host: the
  portable path between hosts;
- ``unary.GrpcTransport``: unary Dispatch calls (what any group speaks).

``router.transport.build`` makes a transport by name (``TRANSPORTS``): ``auto``
(the default) picks per group the fastest path that works and falls back on any
error of a path (``auto``); ``grpc`` the same without shared memory;
``grpc-unary`` unary calls only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, get_args

import grpc
import torch

from expertmesh.config.settings import TransportName

TRANSPORTS: tuple[str, ...] = get_args(TransportName)
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class TransportError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class PathBroken(Exception):
    """A path itself failed (a socket, a stream, a buffer), not the group's answer: the call may go another way."""


def time_left(deadline: float, what: str) -> float:
    """Seconds until ``deadline`` (``time.monotonic()``); DEADLINE_EXCEEDED, naming ``what`` was due, once
    it has passed. Every wait of a call (connect, handshake, answer, a fallback) is bounded by this."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransportError(grpc.StatusCode.DEADLINE_EXCEEDED, f"the call's deadline passed before {what}")
    return left


def call_failed(code: grpc.StatusCode, details: str) -> TransportError:
    """A gRPC call's failure as the dispatcher reads it. CANCELLED is reported as UNAVAILABLE: this router
    never reads a call it gave up itself (``PendingCall.cancel``), so a call that ends CANCELLED had its
    channel closed under it (the group's address changed: ``Transport.update``) or was cancelled by the
    group's server as it stopped. Either way the group went away from that address: the dispatcher looks it
    up again and fails over or resends, as for any group gone, rather than failing the step."""
    if code == grpc.StatusCode.CANCELLED:
        why = details or "cancelled"
        return TransportError(
            grpc.StatusCode.UNAVAILABLE, f"the call was cancelled under it ({why}): the group moved or stopped"
        )
    return TransportError(code, details)


def channel_closed(group: str, err: ValueError) -> TransportError:
    """A call started on a channel closed meanwhile (grpc raises ValueError: "Cannot invoke RPC: Channel
    closed!"): ``Transport.update`` closed it as the group's address changed, between the stub's lookup and
    the call. UNAVAILABLE, as for a group gone: the dispatcher sends again to its address now."""
    return TransportError(
        grpc.StatusCode.UNAVAILABLE, f"expert group {group}'s channel was closed as its address changed ({err})"
    )


def status_code(value: int) -> grpc.StatusCode:
    """The gRPC status code an answer frame carries as a number."""
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)


@dataclass(frozen=True)
class GroupRequest:
    """One group's share of one MoE layer. The transport gathers the rows itself (``rows``), so a
    shared-memory path writes them once, straight into its buffer."""

    layer: int
    table_version: int
    hidden: torch.Tensor  # [T, H]: the layer's hidden states, every token
    tokens: torch.Tensor  # [Tg] int64: the rows this group needs
    expert_ids: torch.Tensor  # [Tg, K] int32: global ids to apply, -1 elsewhere
    weights: torch.Tensor  # [Tg, K]
    #: the router's checkpoint fingerprint: a group of another checkpoint refuses the call ("": not checked)
    model: str = ""

    def rows(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """[Tg, H] hidden states of the group's tokens, into ``out`` when given (same device)."""
        return torch.index_select(self.hidden, 0, self.tokens.to(self.hidden.device), out=out)

    @property
    def row_bytes(self) -> int:
        """Bytes of ``rows()``, and of the partial sums that answer them."""
        return self.tokens.numel() * self.hidden.shape[1] * self.hidden.element_size()

    @property
    def nbytes(self) -> int:
        """Tensor bytes the call carries to the group."""
        return self.row_bytes + sum(t.numel() * t.element_size() for t in (self.expert_ids, self.weights))


@dataclass(frozen=True)
class GroupReply:
    #: [Tg, H] as the group sent it (the dispatcher checks it); None when it did not decode
    partial: torch.Tensor | None
    #: bytes received
    nbytes: int
    #: why it did not decode
    problem: str = ""


class PendingCall(Protocol):
    #: what carries it: "grpc-unary", "grpc-stream", "shm", "cuda-ipc"
    transport: str

    def result(self) -> GroupReply:
        """Block until the group answers; raises TransportError."""
        ...

    def wait(self, timeout_s: float) -> bool:
        """True once ``result()`` would return or raise without waiting on the group (its answer, its
        failure or the call's deadline is here); False when ``timeout_s`` passed first. The call stays in
        flight either way: the dispatcher hedges a call that is slow to answer (``router.dispatch.hedging``)."""
        ...

    def cancel(self) -> None:
        """Give the call up (another replica's answer was taken instead): its answer, whenever it comes, is
        never read, and what the call holds (a connection whose buffer the group may still write into, a
        waiting slot) is let go. ``result()`` is not called after this."""
        ...


class Transport(Protocol):
    name: str

    def update(self, endpoints: dict[str, str]) -> None:
        """Follow the groups' current addresses (group name -> address)."""
        ...

    def address(self, group: str) -> str | None: ...

    def kind(self, group: str) -> str:
        """What carries this group's calls now ("" before the first)."""
        ...

    def send(self, group: str, request: GroupRequest, timeout_s: float) -> PendingCall:
        """Start one call; raises TransportError(UNAVAILABLE) when the group has no address."""
        ...

    def prepare(self, group: str, timeout_s: float) -> None:
        """Set up now what the first call to ``group`` would (asking the group how to reach it, a connection), so
        that call does not pay for it on a serving step: the table watcher calls it for a group a new routing
        table brings, before the table is served. Never raises: what it could not set up, the first call does."""
        ...

    def close(self) -> None: ...
