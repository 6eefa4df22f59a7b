"""Expert groups on loopback for migration tests (the executor's, the Kubernetes
controller's): real ``HostedExperts`` + gRPC servers without Ray, a state store
holding their endpoints and routing table v1, and router stand-ins that publish
heartbeats through the store (``FollowingRouter``).

Tiny Mixtral: 2 MoE layers x 4 experts. ``g0`` holds experts 0-1 of both layers,
``g1`` experts 2-3, ``g2`` starts empty; routing table v1 says so. The migrated
pair is layer 1, expert 1 (on ``g0``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Self

from expertmesh.contracts.group_map import GroupPlacement
from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.expert_group.service import start_server
from expertmesh.models.checkpoint import Checkpoint
from expertmesh.models.hosted_experts import HostedExperts
from expertmesh.store import RouterHeartbeat, StateStore, open_store
from helpers import held_pairs

LAYER, EXPERT = 1, 1
PAIR = (LAYER, EXPERT)
PLACEMENT = GroupPlacement(
    {
        "g0": ((0, 0), (0, 1), (1, 0), (1, 1)),
        "g1": ((0, 2), (0, 3), (1, 2), (1, 3)),
    }
)
FAST = dict(poll_s=0.01, drain_timeout_s=10.0)


@dataclass
class Group:
    hosted: HostedExperts
    server: object
    address: str


@dataclass
class Mesh:
    store: StateStore
    groups: dict[str, Group]

    def held(self, group: str) -> set[tuple[int, int]]:
        """What the group says it holds (Describe over gRPC)."""
        return held_pairs(self.groups[group].address)

    def replicas(self) -> tuple[str, ...]:
        return self.store.routing_table().replicas[PAIR]


def start_mesh(store: StateStore, path, target_path=None, target_budget: int | None = None) -> Mesh:
    groups = {}
    for name, pairs in [*PLACEMENT.groups.items(), ("g2", ())]:
        checkpoint = Checkpoint(target_path if name == "g2" and target_path else path)
        hosted = HostedExperts(checkpoint, budget_bytes=target_budget if name == "g2" else None)
        hosted.load(list(pairs))
        server, port = start_server(name, hosted, max_concurrent_dispatch=4, workers=2)
        groups[name] = Group(hosted, server, f"127.0.0.1:{port}")
        store.set_endpoint(name, f"127.0.0.1:{port}")
    assert store.publish_routing_table(RoutingTable.from_placement(PLACEMENT, num_experts=4, version=1))
    return Mesh(store, groups)


@contextmanager
def mesh_in_redis(url: str, path) -> Iterator[Mesh]:
    """``start_mesh`` of ``path`` registered in the Redis database at ``url`` (emptied first); on exit its
    group servers stopped and the database emptied again."""
    store = open_store(url)
    store._kv._client.flushdb()
    mesh = start_mesh(store, path)
    try:
        yield mesh
    finally:
        for group in mesh.groups.values():
            group.server.stop(0)
        store._kv._client.flushdb()
        store.close()


class FollowingRouter:
    """A router stand-in that reports the store's table version, up to ``stop_at``, every 5 ms."""

    def __init__(self, store: StateStore, router_id: str, stop_at: int | None = None):
        self._store, self._id, self._stop_at = store, router_id, stop_at
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            version = self._store.routing_table_version()
            if self._stop_at is not None:
                version = min(version, self._stop_at)
            self._store.publish_router_heartbeat(RouterHeartbeat(self._id, version, time.time()))
            self._stop.wait(0.005)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
