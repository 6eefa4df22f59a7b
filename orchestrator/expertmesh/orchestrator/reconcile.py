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
The flush took the health monitor's quarantine entries too: given the monitor
(``health``), the reconciler first has it put back what it knows (``restore``:
records, entries, pinned probes), then leaves out of the rebuilt table every
replica the monitor keeps out of service or withdrew, as long as the expert keeps
another replica (``keep_out``): a group still holds a quarantined expert, and
listing it again would send tokens to it.

A changed file over a table in use is applied as live migrations, make before
break (``placement_steps``: a replicate onto each group the file adds for an
expert, then an evict from each group it drops), once a migration runner is
attached (``use_migrations``): overwriting the table would list experts on
groups that never loaded them, and unlisted ones would be left loaded. Each
round submits the next step of every expert not already migrating; the file
counts as applied when the table matches it. Without a runner (a bare
reconciler), the table is overwritten as before.

``next_table``, ``observed_table``, ``keep_out`` and ``placement_steps`` are the pure decisions; ``Reconciler``
does the I/O around them.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Collection, Iterable, Mapping, Protocol

from expertmesh.contracts import group_map as placement_mod
from expertmesh.contracts.errors import ExpertMeshError
from expertmesh.contracts.group_map import GroupPlacement
from expertmesh.contracts.routing_table import ModelIdentity, RoutingTable
from expertmesh.models.checkpoint import MoESpec
from expertmesh.orchestrator.migration.state import MigrationMode, load_all
from expertmesh.store import StateStore

log = logging.getLogger(__name__)

#: ``Migration.initiator`` of the migrations that apply a changed placement file
PLACEMENT_FILE = "placement-file"


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


def keep_out(
    replicas: Mapping[tuple[int, int], tuple[str, ...]], out: Collection[tuple[int, int, str]]
) -> dict[tuple[int, int], tuple[str, ...]]:
    """``replicas`` without the (layer, expert, group) replicas in ``out``, except where that would leave an
    expert without a replica: there all stay listed (a table never leaves an expert unhosted) and routers fall
    back around it, as the quarantine entries tell them."""
    kept = {}
    for pair, groups in replicas.items():
        serving = tuple(g for g in groups if (*pair, g) not in out)
        kept[pair] = serving or groups
    return kept


class HealthMemory(Protocol):
    """What the reconciler asks of the health monitor (``HealthMonitor``) before it rebuilds an empty store."""

    def restore(self) -> frozenset[tuple[int, int, str]]:
        """Put back what the store lost of the monitor's records, quarantine entries and pinned probes; the
        (layer, expert, group) replicas a rebuilt table must not list."""
        ...


@dataclass(frozen=True)
class Step:
    """One live migration towards the placement file: a replicate onto ``target`` or an evict from ``source``."""

    pair: tuple[int, int]
    mode: MigrationMode
    target: str | None
    source: str | None


def placement_steps(current: RoutingTable, desired: GroupPlacement, busy: Iterable[tuple[int, int]] = ()) -> list[Step]:
    """The next step of each (layer, expert) whose replicas differ from ``desired``'s and that has no migration
    running (``busy``): make before break, so first a replicate onto a group the file adds, and only once every
    added group serves it an evict from a group the file drops."""
    steps = []
    busy = set(busy)
    for pair, wanted in sorted(desired.hosts().items()):
        have = current.replicas.get(pair, ())
        if pair in busy or not have:
            continue
        added = [g for g in wanted if g not in have]
        dropped = [g for g in have if g not in wanted]
        if added:
            steps.append(Step(pair, MigrationMode.REPLICATE, added[0], have[0]))
        elif dropped:
            steps.append(Step(pair, MigrationMode.EVICT, None, dropped[0]))
    return steps


class Reconciler:
    def __init__(
        self,
        store: StateStore,
        spec: MoESpec,
        placement: Path | GroupPlacement,
        observe: Callable[[Iterable[str]], dict[str, frozenset[tuple[int, int]]]] | None = None,
        observe_grace_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        health: HealthMemory | None = None,
    ):
        """``observe(groups)``: group -> the pairs it reports holding, for those of ``groups`` that answered
        (None: an empty store gets the file's table, as for a first start with no groups to ask). ``health``:
        the health monitor, asked to restore what an empty store lost before its table is published."""
        self._store = store
        self._spec = spec
        #: the placement file (re-read every round), or a fixed placement (the one `up` started its groups with)
        self._placement = placement
        self._observe = observe
        self._grace_s = observe_grace_s
        self._clock = clock
        self._health = health
        self._last_seen = 0
        #: clock() when this reconciler first found the store without a table (None: it has one)
        self._empty_since: float | None = None
        #: starts a live migration (``MigrationRunner.submit``); None: a changed file overwrites the table
        self._submit: Callable[..., object] | None = None

    def use_migrations(self, submit: Callable[..., object]) -> None:
        """From now on apply file changes as live migrations through ``submit`` (``MigrationRunner.submit``)."""
        self._submit = submit

    def desired(self) -> GroupPlacement:
        if isinstance(self._placement, GroupPlacement):
            return self._placement
        desired = placement_mod.load(self._placement, self._spec)
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
            if table is not None and self._submit is not None and not self._migrate_towards(current, desired):
                return None
            table = None if self._submit is not None else table  # converged by migrations: nothing to publish
        elif self._observe is not None:
            table = self._from_what_runs(desired, model)
            if table is None:
                return None
        else:
            table = next_table(current, desired, model, self._last_seen)
        if current is None and table is not None and self._health is not None:
            # an empty store: the quarantine entries routers read go back before any table does
            kept = keep_out(table.replicas, self._health.restore())
            shares = {pair: s for pair, s in table.shares.items() if kept[pair] == table.replicas[pair]}
            table = replace(table, replicas=kept, shares=shares)
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
            log.warning(
                "groups %s did not describe what they hold; their experts are listed as the placement file says",
                missing,
            )
        return observed_table(desired, held, model, self._last_seen + 1)

    def _migrate_towards(self, current: RoutingTable, desired: GroupPlacement) -> bool:
        """Submit the next make-before-break step of every expert the file places differently; True when there is
        none left to take and none running (every expert on the file's groups, in whatever order they joined)."""
        busy = {m.pair for m in load_all(self._store) if not m.phase.terminal}
        steps = placement_steps(current, desired, busy)
        if not steps and not busy:
            return True
        for step in steps:
            layer, expert = step.pair
            try:
                self._submit(layer, expert, step.target, step.source, step.mode, initiator=PLACEMENT_FILE)
                log.info(
                    "placement file: %s of layer %d expert %d (%s)",
                    step.mode,
                    layer,
                    expert,
                    step.target or step.source,
                )
            except ExpertMeshError as err:  # a group not registered yet, say: the next round tries again
                log.warning(
                    "placement file: cannot start the %s of layer %d expert %d yet: %s", step.mode, layer, expert, err
                )
        return False


def what_runs(
    store: StateStore, model_fingerprint: str = ""
) -> tuple[Callable[[Iterable[str]], dict[str, frozenset[tuple[int, int]]]], Callable[[], None]]:
    """(``observe`` for a Reconciler: each group's Describe over its registered address, close). With the
    checkpoint's ``model_fingerprint``, a group of another checkpoint reports nothing: a rebuilt table never
    lists it."""
    from expertmesh.orchestrator.migration.group_calls import GroupChannels, held_pairs

    channels = GroupChannels(store.endpoints, model_fingerprint)
    return (lambda groups: held_pairs(channels, groups)), channels.close
