"""The orchestrator's control loop: apply the placement file to the routing table.

Like a Kubernetes controller: read the desired state (the placement file, e.g.
a mounted ConfigMap that can change), read the observed state (the stored
routing table), and when they differ publish the next version. Publishing is a
compare-and-set, so a conflicting writer makes this round a no-op and the next
round re-reads; every action is safe to retry.

Live migrations edit the table too, so the file is applied when its content
changes (its digest differs from the one last applied, kept in the store), not
every round: a restarted orchestrator does not undo the moves made since.

``next_table`` is the pure decision; ``Reconciler`` does the I/O around it.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from expertmesh import placement as placement_mod
from expertmesh.checkpoint import MoESpec
from expertmesh.placement import GroupPlacement
from expertmesh.routing_table import ModelIdentity, RoutingTable
from expertmesh.state import StateStore

log = logging.getLogger(__name__)


def next_table(
    current: RoutingTable | None, desired: GroupPlacement, model: ModelIdentity, last_seen: int = 0
) -> RoutingTable | None:
    """The table to publish so the store matches ``desired`` for ``model``, or None when it already does.

    ``last_seen``: the newest version this orchestrator has seen; an empty (flushed) store
    continues after it rather than restarting at 1.
    """
    replicas = desired.hosts()
    if current is not None and current.replicas == replicas and current.num_experts == model.num_experts and current.model == model:
        return None
    version = max(current.version if current else 0, last_seen) + 1
    return RoutingTable(version=version, num_experts=model.num_experts, replicas=replicas, model=model)


class Reconciler:
    def __init__(self, store: StateStore, spec: MoESpec, placement_path: Path):
        self._store = store
        self._spec = spec
        self._path = placement_path
        self._last_seen = 0

    def desired(self) -> GroupPlacement:
        desired = placement_mod.load(self._path, self._spec)
        placement_mod.validate(desired, self._spec)
        return desired

    def reconcile_once(self) -> RoutingTable | None:
        """One round; returns the table it published, if any. A bad placement file raises PlacementError."""
        desired = self.desired()
        digest = hashlib.sha256(repr(sorted(desired.hosts().items())).encode()).hexdigest()
        current = self._store.routing_table()
        if current is not None:
            self._last_seen = max(self._last_seen, current.version)
            if self._store.placement_digest() == digest:
                return None
        table = next_table(current, desired, ModelIdentity.of(self._spec), self._last_seen)
        if table is not None and not self._store.publish_routing_table(table):
            log.info("routing table changed under us; will re-read next round")
            return None
        self._store.set_placement_digest(digest)
        if table is not None:
            self._last_seen = table.version
            log.info("published routing table version %d (%d groups)", table.version, len(table.groups()))
        return table
