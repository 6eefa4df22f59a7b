"""Expert groups for the health tests (test_health_*.py, test_kube_quarantine.py): real
gRPC servers on loopback (``HostedExperts`` + ``start_server``, no Ray) over a tiny
Mixtral, registered in an in-process state store with a routing table, and the one
fault those tests inject (``corrupt``).

2 MoE layers x 4 experts. ``g0`` holds experts 0-1 of both layers, ``g1`` experts 2-3
of both and a second replica of layer 1 expert 1, so (1, 1) is replicated on g0 and g1
and (1, 2) has g1 alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from expertmesh.contracts.group_map import GroupPlacement
from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.expert_group.service import start_server
from expertmesh.models.checkpoint import Checkpoint
from expertmesh.models.hosted_experts import HostedExperts
from expertmesh.orchestrator.health.config import HealthConfig
from expertmesh.orchestrator.health.state import ReplicaId
from expertmesh.store import StateStore, open_store

PLACEMENT = GroupPlacement(
    {
        "g0": ((0, 0), (0, 1), (1, 0), (1, 1)),
        "g1": ((0, 2), (0, 3), (1, 1), (1, 2), (1, 3)),
    }
)
REPLICATED, SINGLE = (1, 1), (1, 2)
CONFIG = HealthConfig(tokens=64, probation_checks=2)


@dataclass
class Mesh:
    store: StateStore
    hosted: dict[str, HostedExperts]
    servers: list
    checkpoint: Checkpoint

    def replicas(self, pair) -> tuple[str, ...]:
        return self.store.routing_table().replicas[pair]


@contextmanager
def running(path: Path) -> Iterator[Mesh]:
    checkpoint = Checkpoint(path)
    store = open_store("memory://")
    hosted, servers = {}, []
    for name, pairs in PLACEMENT.groups.items():
        hosted[name] = HostedExperts(checkpoint)
        hosted[name].load(list(pairs))
        server, port = start_server(name, hosted[name], max_concurrent_dispatch=4, workers=2)
        servers.append(server)
        store.set_endpoint(name, f"127.0.0.1:{port}")
    assert store.publish_routing_table(RoutingTable.from_placement(PLACEMENT, num_experts=4, version=1))
    try:
        yield Mesh(store, hosted, servers, checkpoint)
    finally:
        for server in servers:
            server.stop(0)


def corrupt(
    mesh: Mesh, group: str, pair: tuple[int, int], scale: float = 3.0, at: tuple[int, int] | None = None
) -> None:
    """The injected fault: scale the expert's down projection in the group's memory, in place
    (only the element ``at`` of it when given)."""
    held = mesh.hosted[group]._layers[pair[0]]
    rows = held.module.down_proj.data[held.ids.index(pair[1])]  # [H, I]
    if at is None:
        rows.mul_(scale)
    else:
        rows[at].mul_(scale)


def rid(pair, group) -> ReplicaId:
    return ReplicaId(pair[0], pair[1], group)
