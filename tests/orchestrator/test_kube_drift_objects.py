"""Drift's moves as ExpertMigration objects (kube/drift_objects.py): against the in-process
Kubernetes API fake of these tests (the chart's CRD installed; no API server can run here), a
real migration runner and real expert groups on loopback."""

from migration_mesh import EXPERT, LAYER, FollowingRouter
from test_kube_controller import finished

from conftest import NAMESPACE
from expertmesh.orchestrator.drift.controller import DriftRecord, Result
from expertmesh.orchestrator.drift.state import Decision, Hold, Move, Trigger
from expertmesh.orchestrator.kube.drift_objects import DriftObjects
from expertmesh.orchestrator.migration.state import MigrationMode, load_all


def test_a_started_drift_move_becomes_an_object_the_controller_reports_on(kube_api, group_mesh, runner, run_controller):
    hook = DriftObjects(kube_api, NAMESPACE)
    decision = Decision(Trigger.HIGH_WATERMARK, "g0 at 95 %", Move(LAYER, EXPERT, "g0", "g2"))
    with run_controller(), FollowingRouter(group_mesh.store, "r1"):
        migration = runner.submit(LAYER, EXPERT, "g2", "g0", MigrationMode.MOVE, initiator="drift:high_watermark")
        hook(DriftRecord(decision, Result.SUBMITTED, migration_id=migration.id))
        hook(DriftRecord(Decision(Trigger.HIGH_WATERMARK, "held", hold=Hold.LOW_TRAFFIC), Result.HELD))
        (obj,) = kube_api.list(NAMESPACE).items
        done = finished(kube_api, obj)
    assert done.status.phase == "Succeeded"
    assert (done.spec.source, done.spec.target, done.spec.layer, done.spec.expert) == ("g0", "g2", LAYER, EXPERT)
    assert [m.id for m in load_all(group_mesh.store)] == [migration.id], "the controller must not start it again"
