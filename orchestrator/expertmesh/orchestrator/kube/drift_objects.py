"""Drift decisions as ExpertMigration objects, so that in cluster mode
``kubectl get expertmigrations`` lists every move, manual or automatic.

The drift controller submits its moves to the runner itself (its cooldowns and
batch limits count them at once); this hook then creates an object naming that
record, which the ExpertMigration controller reports on without starting it a
second time. A hook failure (an API server hiccup) is logged by the drift
controller and never stops its scan: the move runs either way.
"""

from __future__ import annotations

from expertmesh.orchestrator.drift.controller import DriftRecord, Result
from expertmesh.orchestrator.kube.api import ExpertMigrationApi, create_migration_object
from expertmesh.orchestrator.kube.resource import MigrationSpec, Origin
from expertmesh.orchestrator.migration.state import MigrationMode


class DriftObjects:
    """``on_decision`` hook of the drift controller: one object per move it started."""

    def __init__(self, api: ExpertMigrationApi, namespace: str):
        self._api = api
        self._namespace = namespace

    def __call__(self, record: DriftRecord) -> None:
        move = record.decision.move
        if record.result is not Result.SUBMITTED or move is None:
            return
        create_migration_object(
            self._api,
            MigrationSpec(move.layer, move.expert, MigrationMode.MOVE, move.source, move.target),
            origin=Origin.DRIFT,
            namespace=self._namespace,
            initiator=f"drift:{record.decision.trigger.value}",
            migration_id=record.migration_id,
        )
