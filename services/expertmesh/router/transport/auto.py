"""The default transport: per group, the fastest path that works, falling back on any error.

For each group address the router asks the group once (the Transports RPC, over
the group's gRPC channel and so under TLS when TLS is on) how else it can be
reached. The group's answer carries the boot id of its kernel; only when that is
this router's (same host) and the group's socket files exist here are the
same-host paths tried. A group's calls then go, in order of preference:

1. in place, when the group runs in this very process (``in_process``: ``up --groups-as in-process``;
   ``auto`` only);
2. through shared memory (``local``; CUDA IPC for tensors on the
   group's GPU), unless ``shared_memory`` is off (the ``grpc`` transport);
3. on a gRPC stream over the group's unix socket (same host);
4. on a gRPC stream over TCP: the portable path between hosts;
5. as unary Dispatch calls, which every group serves.

A path that fails as a path (``PathBroken``: a socket, a refused stream, a
buffer) is skipped for ``RETRY_PATH_S`` and the call goes down the list at
once; the next call asks the group again, and when the answer differs (a
replica restarted at the same address: new socket files, a new token) the
group's paths are made afresh, so a dead socket path is never kept. What the
group answers is passed up unchanged: replica choice and failover stay the
dispatcher's. Every wait of a call (the handshake, dialling, the answer, a
fallback path) ends at the call's deadline: a stopped group costs a step no
more than its requests' deadline. A group that cannot be asked
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
import torch

from expertmesh.contracts import shared_buffer
from expertmesh.infra.compute_lanes import ComputeLanes, split_threads
from expertmesh.infra.group_channels import GroupClients, group_channel
from expertmesh.router.transport.base import GroupReply, GroupRequest, PathBroken, PendingCall, time_left
from expertmesh.router.transport.in_process import InProcessPath, Lookup
from expertmesh.router.transport.local import LocalPath
from expertmesh.router.transport.stream import StreamPath
from expertmesh.router.transport.unary import GrpcTransport
from expertmesh.v1 import experts_pb2 as pb

log = logging.getLogger(__name__)

#: how long a path that failed is left before it is tried again
RETRY_PATH_S = 30.0
HANDSHAKE_TIMEOUT_S = 2.0
#: after a path broke and the group could not be asked again, how long until the next try
ASK_AGAIN_S = 1.0


class _Path(Protocol):
    name: str

    def send(self, request: GroupRequest, timeout_s: float) -> PendingCall: ...

    def prepare(self, deadline: float) -> None:
        """What its first call would set up (a connection, a stream), done by ``deadline``; may raise."""
        ...

    def close(self) -> None: ...


class _UnaryPath:
    """The last path: unary Dispatch, which every group serves (never PathBroken)."""

    name = "grpc-unary"

    def __init__(self, unary: GrpcTransport, group: str):
        self._unary, self._group = unary, group

    def send(self, request: GroupRequest, timeout_s: float) -> PendingCall:
        return self._unary.send(self._group, request, timeout_s)

    def prepare(self, deadline: float) -> None:
        self._unary.prepare(self._group, deadline - time.monotonic())

    def close(self) -> None:
        pass


class _Route:
    """One group address's paths, fastest first, until when each failed one is left alone, and the
    group's answer they were made from (``info``)."""

    def __init__(self, group: str, address: str, info: pb.TransportsResponse, paths: list[_Path]):
        self.group, self.address, self.info, self.paths = group, address, info, paths
        self._down_until = [0.0] * len(paths)
        #: when to ask the group again how to reach it (None: no need): a path broke, and a replica
        #: restarted at the same address has new socket files and a new token
        self.ask_again_at: float | None = None

    def usable(self, i: int) -> bool:
        return time.monotonic() >= self._down_until[i]

    def broke(self, i: int, err: Exception) -> None:
        if self.usable(i):
            nxt = next((p.name for j, p in enumerate(self.paths) if j > i and self.usable(j)), "none")
            log.warning(
                "expert group %s: the %s path failed (%s); its calls go by %s for %.0fs",
                self.group,
                self.paths[i].name,
                err,
                nxt,
                RETRY_PATH_S,
            )
        self._down_until[i] = time.monotonic() + RETRY_PATH_S
        if self.ask_again_at is None:
            self.ask_again_at = time.monotonic()

    def current(self) -> str:
        return next(p.name for i, p in enumerate(self.paths) if self.usable(i) or i == len(self.paths) - 1)

    def prepare(self, deadline: float) -> None:
        """The path calls would take now, set up (one that fails is skipped as a call would skip it)."""
        for i, path in enumerate(self.paths):
            if not self.usable(i) and i < len(self.paths) - 1:
                continue
            try:
                path.prepare(deadline)
                return
            except PathBroken as err:
                self.broke(i, err)

    def close(self) -> None:
        for path in self.paths:
            path.close()


class _FallingBack:
    """A call in flight on one path; if that path breaks before the answer, the call goes down the list."""

    def __init__(self, pending: PendingCall, fallback: Callable[[PathBroken], PendingCall]):
        self._pending, self._fallback = pending, fallback
        self.transport = pending.transport
        #: what the call came to, once ``wait`` found out (its reply, or the error ``result`` raises)
        self._outcome: GroupReply | Exception | None = None

    def result(self) -> GroupReply:
        if self._outcome is None:
            return self._result()
        if isinstance(self._outcome, Exception):
            raise self._outcome
        return self._outcome

    def _result(self) -> GroupReply:
        try:
            return self._pending.result()
        except PathBroken as err:
            self._pending = self._fallback(err)  # itself falls back further on its own path's break
            self.transport = self._pending.transport
            return self._pending.result()

    def wait(self, timeout_s: float) -> bool:
        """A path that broke is only known from its result: that result is taken here, and a broken path's
        call is sent down the list and waited for in what is left of ``timeout_s``."""
        end = time.monotonic() + timeout_s
        while self._outcome is None:
            if not self._pending.wait(max(end - time.monotonic(), 0.0)):
                return False
            try:
                self._outcome = self._pending.result()
            except PathBroken as err:
                try:
                    self._pending = self._fallback(err)
                    self.transport = self._pending.transport
                except Exception as failed:  # TransportError: the deadline passed meanwhile
                    self._outcome = failed
            except Exception as failed:
                self._outcome = failed
        return True

    def cancel(self) -> None:
        if self._outcome is None:  # a result taken already has let its connection go (back to the pool)
            self._pending.cancel()


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


class AutoTransport:
    def __init__(
        self,
        shared_memory: bool = True,
        clients: GroupClients | None = None,
        in_process: Lookup | None = None,
        side_by_side: int = 1,
        threads: int | None = None,
    ):
        """``in_process``: the groups this process runs, by their servers' shared-memory token (``auto`` calls
        those in place: ``in_process``); None: none here. ``side_by_side``: how many of a layer's calls to them
        may compute at once (``infra.compute_lanes``; their number, at most the intra-op threads; 1: each on the
        sending thread in turn). ``threads``: the intra-op threads they share out (the router's); None: the
        sending thread's at the first call (which a small engine step runs on one: ``infra.cpu_threads``)."""
        self.name = "auto" if shared_memory else "grpc"
        self._shared_memory = shared_memory
        self._in_process = in_process if shared_memory else None
        self._side_by_side = side_by_side
        self._threads = threads
        self._lanes: ComputeLanes | None = None
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
        deadline = time.monotonic() + timeout_s
        route = self._route(group, deadline)
        if route is None:
            return self._unary.send(group, request, time_left(deadline, "the group was reached"))
        return self._send_on(route, 0, request, deadline)

    def prepare(self, group: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        try:
            route = self._route(group, deadline)
            if route is None:
                self._unary.prepare(group, deadline - time.monotonic())
            else:
                route.prepare(deadline)
        except Exception as err:  # the first call sets up what could not be now, within its own deadline
            log.debug("expert group %s: nothing set up ahead of its first call: %s", group, err)

    def _send_on(self, route: _Route, start: int, request: GroupRequest, deadline: float) -> PendingCall:
        for i in range(start, len(route.paths)):
            if not route.usable(i) and i < len(route.paths) - 1:
                continue
            try:
                pending = route.paths[i].send(request, time_left(deadline, f"the call went by {route.paths[i].name}"))
            except PathBroken as err:
                route.broke(i, err)
                continue
            return _FallingBack(pending, lambda err, i=i: self._after(route, i, err, request, deadline))
        raise AssertionError("the unary path never breaks")

    def _after(self, route: _Route, i: int, err: PathBroken, request: GroupRequest, deadline: float) -> PendingCall:
        route.broke(i, err)
        return self._send_on(route, i + 1, request, deadline)

    def _route(self, group: str, deadline: float) -> _Route | None:
        with self._lock:
            route = self._routes.get(group)
        if route is not None and (route.ask_again_at is None or time.monotonic() < route.ask_again_at):
            return route
        address, stub = self._clients.address(group), self._clients.stub(group)
        if address is None or stub is None:
            return None
        info = self._ask(stub, deadline)
        if route is not None and route.address == address:
            if info is None:  # not reachable now: keep what we have, ask again a little later
                route.ask_again_at = time.monotonic() + ASK_AGAIN_S
                return route
            if info == route.info:  # the same process: its broken paths stay down for RETRY_PATH_S
                route.ask_again_at = None
                return route
        if info is None:
            return route  # None before a first answer: this call goes unary, the next one asks again
        fresh = _Route(group, address, info, self._paths(group, info))
        with self._lock:
            current = self._routes.get(group)
            installed = current is route and self._clients.address(group) == address
            if installed:
                self._routes[group] = fresh
        if not installed:
            fresh.close()  # another thread got there first, or the group moved meanwhile
            return current
        if route is not None:
            route.close()  # a replica restarted at this address: its new paths replace the dead ones
        return fresh

    def _ask(self, stub, deadline: float) -> pb.TransportsResponse | None:
        """The group's Transports answer; None when it cannot be asked now (within the deadline)."""
        try:
            timeout = min(HANDSHAKE_TIMEOUT_S, time_left(deadline, "the group was asked how to reach it"))
            return stub.Transports(pb.TransportsRequest(), timeout=timeout)
        except ValueError:  # its channel was closed as the group's address changed: ask at the next call
            return None
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                return None
            return pb.TransportsResponse()  # a group from before the Transports RPC

    def _paths(self, group: str, info: pb.TransportsResponse) -> list[_Path]:
        paths: list[_Path] = []
        if self._in_process is not None and info.shm_token and self._in_process(info.shm_token) is not None:
            paths.append(InProcessPath(info.shm_token, self._in_process, self._in_process_lanes))
        if info.host_id == shared_buffer.host_id():
            if self._shared_memory and _is_socket(info.shm_socket):
                paths.append(LocalPath(info.shm_socket, info.shm_token, info.gpu_uuid))
            if _is_socket(info.grpc_unix_address.removeprefix("unix:")):
                channel = group_channel(info.grpc_unix_address, self._clients.tls)
                paths.append(StreamPath(channel, same_host=True, owns_channel=True))
        paths.append(StreamPath(self._clients.channel(group)))
        paths.append(_UnaryPath(self._unary, group))
        return paths

    def _in_process_lanes(self) -> ComputeLanes | None:
        """The lanes the calls to groups in this process share, made at the first call that asks: from
        ``threads``, else the sending thread's intra-op threads (the router's engine thread; a route can be made
        earlier, on the table watcher's thread, before ``up`` sets the router's threads)."""
        if self._lanes is not None or self._side_by_side <= 1:  # every call but the first
            return self._lanes
        with self._lock:
            if self._lanes is None and self._side_by_side > 1:
                lanes, each = split_threads(self._threads or torch.get_num_threads(), self._side_by_side)
                if lanes:
                    self._lanes = ComputeLanes(lanes, each)
                else:  # one intra-op thread: nothing to share out
                    self._side_by_side = 1
            return self._lanes

    def close(self) -> None:
        with self._lock:
            routes, self._routes = list(self._routes.values()), {}
            lanes, self._lanes, self._side_by_side = self._lanes, None, 1
        for route in routes:
            route.close()
        if lanes is not None:
            lanes.close()
        self._clients.close()
