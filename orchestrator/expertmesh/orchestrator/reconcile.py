"""The orchestrator's control loop: apply the placement file to the routing table.

Like a Kubernetes controller: read the desired state (the placement file, e.g.
a mounted ConfigMap that can change), read the observed state (the stored
routing table), and when they differ publish the next version. Publishing is a
compare-and-set, so a conflicting writer makes this round a no-op and the next
round re-reads; every action is safe to retry.

Live migrations edit the table too, so the file is applied when its content
changes (its digest differs from the one last applied, kept in the store), not
every round: a restarted orchestrator does not undo the moves made since.

An empty store (new, or flushed after live moves) is rebuilt from what runs,
not from the file: given an ``observe`` callable, the reconciler asks every
group what it holds (Describe) and publishes a table that lists only replicas
that hold their experts (``observed_table``), at a version above any a router
reports serving. Re-applying the file there would list experts on groups that
unloaded them in a move: NOT_FOUND for every token routed there. It waits for
the groups to register and answer (they re-register every few seconds) up to
``observe_grace_s``; past it, experts no group reported fall back to the file.

``next_table`` and ``observed_table`` are the pure decisions; ``Reconciler`` does the I/O around them.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Callable, Iterable, Mapping

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
    # a table without an identity (from before tables carried one) is ours when its shape is; one of another
    # model is not, and publishing over it is refused (StoreCollision)
    same_model = current is not None and current.model in (None, model)
    if same_model and current.replicas == replicas and current.num_experts == model.num_experts:
        return None
    version = max(current.version if current else 0, last_seen) + 1
    return RoutingTable(version=version, num_experts=model.num_experts, replicas=replicas, model=model)


def observed_table(
    desired: GroupPlacement, held: Mapping[str, frozenset[tuple[int, int]]], model: ModelIdentity, version: int
) -> RoutingTable:
    """The table of what runs: each (layer, expert) of ``desired`` served by the groups that report holding it
    (``held``: group -> its pairs), the file's groups first; a pair no group reported keeps the file's groups."""
    replicas = {}
    for pair, groups in desired.hosts().items():
        holders = [g for g in groups if pair in held.get(g, ())] + sorted(
            g for g, pairs in held.items() if pair in pairs and g not in groups
        )
        replicas[pair] = tuple(holders) or groups
    return RoutingTable(version=version, num_experts=model.num_experts, replicas=replicas, model=model)


class Reconciler:
    def __init__(
        self,
        store: StateStore,
        spec: MoESpec,
        placement_path: Path,
        observe: Callable[[Iterable[str]], dict[str, frozenset[tuple[int, int]]]] | None = None,
        observe_grace_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``observe(groups)``: group -> the pairs it reports holding, for those of ``groups`` that answered
        (None: an empty store gets the file's table, as for a first start with no groups to ask)."""
        self._store = store
        self._spec = spec
        self._path = placement_path
        self._observe = observe
        self._grace_s = observe_grace_s
        self._clock = clock
        self._last_seen = 0
        #: clock() when this reconciler first found the store without a table (None: it has one)
        self._empty_since: float | None = None

    def desired(self) -> GroupPlacement:
        desired = placement_mod.load(self._path, self._spec)
        placement_mod.validate(desired, self._spec)
        return desired

    def reconcile_once(self) -> RoutingTable | None:
        """One round; returns the table it published, if any. A bad placement file raises PlacementError."""
        desired = self.desired()
        digest = hashlib.sha256(repr(sorted(desired.hosts().items())).encode()).hexdigest()
        current = self._store.routing_table()
        # routers report the version they serve: after a flush only they remember how far versions went
        served = max((b.table_version for b in self._store.router_heartbeats().values()), default=0)
        self._last_seen = max(self._last_seen, served, current.version if current is not None else 0)
        model = ModelIdentity.of(self._spec)
        if current is not None:
            self._empty_since = None
            if self._store.placement_digest() == digest:
                return None
            table = next_table(current, desired, model, self._last_seen)
        elif self._observe is not None:
            table = self._from_what_runs(desired, model)
            if table is None:
                return None
        else:
            table = next_table(current, desired, model, self._last_seen)
        if table is not None and not self._store.publish_routing_table(table):
            log.info("routing table changed under us; will re-read next round")
            return None
        self._store.set_placement_digest(digest)
        if table is not None:
            self._last_seen = table.version
            log.info("published routing table version %d (%d groups)", table.version, len(table.groups()))
        return table

    def _from_what_runs(self, desired: GroupPlacement, model: ModelIdentity) -> RoutingTable | None:
        """The table of an empty store from the groups' reports; None while some group has yet to answer
        (within the grace period)."""
        now = self._clock()
        if self._empty_since is None:
            self._empty_since = now
        groups = sorted(set(desired.groups) | set(self._store.endpoints()))
        held = self._observe(groups)
        missing = sorted(set(desired.groups) - set(held))
        if missing and now - self._empty_since < self._grace_s:
            log.info("empty state store: waiting for expert groups %s to register and describe what they hold", missing)
            return None
        if missing:
            log.warning("groups %s did not describe what they hold; their experts are listed as the placement file says", missing)
        return observed_table(desired, held, model, self._last_seen + 1)
