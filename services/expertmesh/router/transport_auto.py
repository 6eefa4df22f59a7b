"""The default transport: per group, the fastest path that works, falling back on any error.

For each group address the router asks the group once (the Transports RPC, over
the group's gRPC channel and so under TLS when TLS is on) how else it can be
reached. The group's answer carries the boot id of its kernel; only when that is
this router's (same host) and the group's socket files exist here are the
same-host paths tried. A group's calls then go, in order of preference:

1. through shared memory (``transport_local``; CUDA IPC for tensors on the
   group's GPU), unless ``shared_memory`` is off (the ``grpc`` transport);
2. on a gRPC stream over the group's unix socket (same host);
3. on a gRPC stream over TCP: the portable path between hosts;
4. as unary Dispatch calls, which every group serves.

A path that fails as a path (``PathBroken``: a socket, a refused stream, a
buffer) is skipped for ``RETRY_PATH_S`` and the call goes down the list at
once. What the group answers, and a call's deadline, are passed up unchanged:
replica choice and failover stay the dispatcher's. A group that cannot be asked
now gets unary calls and is asked again on its next call; one that predates
these paths (no Transports RPC, no stream service) ends up on unary.

Why ask the group rather than read a host id from the state store: the answer is
always that of the process at the address being dialled (a store entry can
outlive a restart), it needs no store (groups handed over by address, as in the
GPU benchmark), and it carries the shared-memory token, which must not sit in
the store; ``StateStore.endpoints()`` and its readers stay as they were.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from typing import Callable, Protocol

import grpc

from expertmesh import shared_buffer
from expertmesh.expert_group.service import group_channel
from expertmesh.router.group_client import GroupClients
from expertmesh.router.transport import GroupReply, GroupRequest, GrpcTransport, PathBroken, PendingCall
from expertmesh.router.transport_local import LocalPath
from expertmesh.router.transport_stream import StreamPath
from expertmesh.v1 import experts_pb2 as pb

log = logging.getLogger(__name__)

#: how long a path that failed is left before it is tried again
RETRY_PATH_S = 30.0
HANDSHAKE_TIMEOUT_S = 2.0


class _Path(Protocol):
    name: str

    def send(self, request: GroupRequest, timeout_s: float) -> PendingCall: ...

    def close(self) -> None: ...


class _UnaryPath:
    """The last path: unary Dispatch, which every group serves (never PathBroken)."""

    name = "grpc-unary"

    def __init__(self, unary: GrpcTransport, group: str):
        self._unary, self._group = unary, group

    def send(self, request: GroupRequest, timeout_s: float) -> PendingCall:
        return self._unary.send(self._group, request, timeout_s)

    def close(self) -> None:
        pass


class _Route:
    """One group address's paths, fastest first, and until when each failed one is left alone."""

    def __init__(self, group: str, address: str, paths: list[_Path]):
        self.group, self.address, self.paths = group, address, paths
        self._down_until = [0.0] * len(paths)

    def usable(self, i: int) -> bool:
        return time.monotonic() >= self._down_until[i]

    def broke(self, i: int, err: Exception) -> None:
        if self.usable(i):
            nxt = next((p.name for j, p in enumerate(self.paths) if j > i and self.usable(j)), "none")
            log.warning(
                "expert group %s: the %s path failed (%s); its calls go by %s for %.0fs",
                self.group, self.paths[i].name, err, nxt, RETRY_PATH_S,
            )
        self._down_until[i] = time.monotonic() + RETRY_PATH_S

    def current(self) -> str:
        return next(p.name for i, p in enumerate(self.paths) if self.usable(i) or i == len(self.paths) - 1)

    def close(self) -> None:
        for path in self.paths:
            path.close()


class _FallingBack:
    """A call in flight on one path; if that path breaks before the answer, the call goes down the list."""

    def __init__(self, pending: PendingCall, fallback: Callable[[PathBroken], PendingCall]):
        self._pending, self._fallback = pending, fallback
        self.transport = pending.transport

    def result(self) -> GroupReply:
        try:
            return self._pending.result()
        except PathBroken as err:
            pending = self._fallback(err)
            self.transport = pending.transport
            return pending.result()


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


class AutoTransport:
    def __init__(self, shared_memory: bool = True, clients: GroupClients | None = None):
        self.name = "auto" if shared_memory else "grpc"
        self._shared_memory = shared_memory
        self._clients = clients or GroupClients()
        self._unary = GrpcTransport(self._clients)
        self._lock = threading.Lock()
        self._routes: dict[str, _Route] = {}

    def update(self, endpoints: dict[str, str]) -> None:
        self._clients.update(endpoints)
        with self._lock:
            moved = [g for g, route in self._routes.items() if endpoints.get(g) != route.address]
            routes = [self._routes.pop(g) for g in moved]
        for route in routes:
            route.close()

    def address(self, group: str) -> str | None:
        return self._clients.address(group)

    def kind(self, group: str) -> str:
        route = self._routes.get(group)
        return route.current() if route is not None else ""

    def send(self, group: str, request: GroupRequest, timeout_s: float) -> PendingCall:
        route = self._route(group)
        if route is None:
            return self._unary.send(group, request, timeout_s)
        return self._send_on(route, 0, request, timeout_s)

    def _send_on(self, route: _Route, start: int, request: GroupRequest, timeout_s: float) -> PendingCall:
        for i in range(start, len(route.paths)):
            if not route.usable(i) and i < len(route.paths) - 1:
                continue
            try:
                pending = route.paths[i].send(request, timeout_s)
            except PathBroken as err:
                route.broke(i, err)
                continue
            return _FallingBack(pending, lambda err, i=i: self._after(route, i, err, request, timeout_s))
        raise AssertionError("the unary path never breaks")

    def _after(self, route: _Route, i: int, err: PathBroken, request: GroupRequest, timeout_s: float) -> PendingCall:
        route.broke(i, err)
        return self._send_on(route, i + 1, request, timeout_s)

    def _route(self, group: str) -> _Route | None:
        with self._lock:
            route = self._routes.get(group)
        if route is not None:
            return route
        address, stub = self._clients.address(group), self._clients.stub(group)
        if address is None or stub is None:
            return None
        try:
            info = stub.Transports(pb.TransportsRequest(), timeout=HANDSHAKE_TIMEOUT_S)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                return None  # not reachable now: this call goes unary, the next one asks again
            info = pb.TransportsResponse()  # a group from before the Transports RPC
        route = _Route(group, address, self._paths(group, info))
        with self._lock:
            if group not in self._routes and self._clients.address(group) == address:
                self._routes[group] = route
                return route
            existing = self._routes.get(group)
        route.close()  # another thread got there first, or the group moved meanwhile
        return existing

    def _paths(self, group: str, info: pb.TransportsResponse) -> list[_Path]:
        paths: list[_Path] = []
        if info.host_id == shared_buffer.host_id():
            if self._shared_memory and _is_socket(info.shm_socket):
                paths.append(LocalPath(info.shm_socket, info.shm_token, info.gpu_uuid))
            if _is_socket(info.grpc_unix_address.removeprefix("unix:")):
                channel = group_channel(info.grpc_unix_address, self._clients.tls)
                paths.append(StreamPath(channel, same_host=True, owns_channel=True))
        paths.append(StreamPath(self._clients.channel(group)))
        paths.append(_UnaryPath(self._unary, group))
        return paths

    def close(self) -> None:
        with self._lock:
            routes, self._routes = list(self._routes.values()), {}
        for route in routes:
            route.close()
        self._clients.close()
