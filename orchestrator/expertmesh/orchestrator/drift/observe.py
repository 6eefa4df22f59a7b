"""The drift controller's I/O: one ``Observation`` from the state store (routing
table, endpoints, the routers' load pulses, migration records) and every group's
Describe (weights, budget, busy seconds).

A group that does not answer is left out of the observation and logged: it is
then neither a source nor a target, and its consecutive-scan count starts again,
since nobody knows what it did meanwhile.

A router's load record that is stale (``contracts.load_report``: its router gone
for two windows) is left out of the sum (``orchestrator.retention`` deletes it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from expertmesh.contracts.errors import MigrationRefused
from expertmesh.contracts.load_report import LoadPulse, summed_pulses
from expertmesh.orchestrator.drift.state import ExpertLoad, GroupSample, Observation
from expertmesh.orchestrator.migration.group_calls import GroupCallFailed, GroupChannels
from expertmesh.orchestrator.migration.state import load_all
from expertmesh.store import StateStore

log = logging.getLogger(__name__)


class Observer:
    def __init__(self, store: StateStore, clock: Callable[[], float] = time.time):
        self._store = store
        self._clock = clock
        self._groups = GroupChannels(store.endpoints)

    def close(self) -> None:
        self._groups.close()

    def observe(self) -> Observation:
        table = self._store.routing_table()
        if table is None:
            raise MigrationRefused("no routing table in the state store yet; start the expert groups first")
        samples = []
        for group in sorted(self._store.endpoints()):
            try:
                view = self._groups.describe(group)
            except GroupCallFailed as err:
                log.warning("drift: leaving group %s out of this scan: %s", group, err)
                continue
            samples.append(
                GroupSample(
                    group=group,
                    weight_bytes=view.weight_bytes,
                    budget_bytes=view.budget_bytes,
                    busy_seconds=view.busy_seconds,
                    expert_bytes=view.weight_bytes // len(view.pairs) if view.pairs else 0,
                    memory_used_bytes=view.memory_used_bytes,
                    memory_total_bytes=view.memory_total_bytes,
                )
            )
        now = self._clock()
        snapshot = summed_pulses(self._store.loads(), now=now)  # the load alone, no router gone; no co-activation
        return Observation(
            at=now,
            table=table,
            groups=tuple(samples),
            loads=expert_loads(snapshot) if snapshot is not None else (),
            top_k=snapshot.top_k if snapshot is not None else 0,
            migrations=tuple(load_all(self._store)),
        )


def expert_loads(snapshot: LoadPulse) -> tuple[ExpertLoad, ...]:
    """Rows of the windows are MoE layers in order; the routing table names layers by index."""
    return tuple(
        ExpertLoad(layer, expert, float(snapshot.load[row, expert]))
        for row, layer in enumerate(snapshot.moe_layers)
        for expert in range(snapshot.num_experts)
    )
