"""Expert groups for the health tests (test_health_*.py, test_kube_quarantine.py): real
gRPC servers on loopback (``HostedExperts`` + ``start_server``, no Ray) over a tiny
Mixtral, registered in a state store (in-process, or the Redis one a test passes) with a
routing table, and the faults those tests inject (``corrupt``, ``drift_only``).

2 MoE layers x 4 experts. ``g0`` holds experts 0-1 of both layers, ``g1`` experts 2-3
of both and a second replica of layer 1 expert 1, so (1, 1) is replicated on g0 and g1
and (1, 2) has g1 alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

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
    #: group -> "host:port" of its server
    addresses: dict[str, str]

    def replicas(self, pair) -> tuple[str, ...]:
        return self.store.routing_table().replicas[pair]

    def register(self) -> None:
        """Each group's address in the store, as the groups' registration loop writes it (again after a flush)."""
        for name, address in self.addresses.items():
            self.store.set_endpoint(name, address)


@contextmanager
def running(path: Path, store: StateStore | None = None) -> Iterator[Mesh]:
    """The mesh over ``store`` (default: a fresh in-process one)."""
    checkpoint = Checkpoint(path)
    store = store if store is not None else open_store("memory://")
    hosted, servers, addresses = {}, [], {}
    for name, pairs in PLACEMENT.groups.items():
        hosted[name] = HostedExperts(checkpoint)
        hosted[name].load(list(pairs))
        server, port = start_server(name, hosted[name], max_concurrent_dispatch=4, workers=2)
        servers.append(server)
        addresses[name] = f"127.0.0.1:{port}"
    mesh = Mesh(store, hosted, servers, checkpoint, addresses)
    mesh.register()
    assert store.publish_routing_table(RoutingTable.from_placement(PLACEMENT, num_experts=4, version=1))
    try:
        yield mesh
    finally:
        for server in servers:
            server.stop(0)


def corrupt(
    mesh: Mesh, group: str, pair: tuple[int, int], scale: float = 3.0, at: tuple[int, int] | None = None
) -> None:
    """The injected fault: scale the expert's down projection in the group's memory, in place (only the element
    ``at`` of it when given), where its products read it: a write torch sees, so a packed copy of the weights
    (``models.linear_kernels``) is made again from them."""
    held = mesh.hosted[group]._layers[pair[0]]
    with torch.no_grad():
        rows = held.module.down_proj[held.ids.index(pair[1])]  # [H, I]
        if at is None:
            rows.mul_(scale)
        else:
            rows[at].mul_(scale)


def drift_only(mesh: Mesh, group: str, pair: tuple[int, int], scale: float = 3.0) -> None:
    """A fault only the probe output shows, the stand-in for a device that computes wrong from intact weights:
    ``corrupt``, with the group's Fingerprint answers for the expert made blind to it (the weights' checksum
    now reported as it was at load), so the fingerprint check finds nothing."""
    corrupt(mesh, group, pair, scale)
    hosted = mesh.hosted[group]
    answers = hosted.fingerprints

    def blind(pairs=None):
        return [(l, e, loaded, loaded if (l, e) == pair else now) for l, e, loaded, now in answers(pairs)]

    hosted.fingerprints = blind


def rid(pair, group) -> ReplicaId:
    return ReplicaId(pair[0], pair[1], group)
