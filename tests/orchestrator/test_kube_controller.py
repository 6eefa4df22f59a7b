"""The ExpertMigration controller against an in-process Kubernetes API server
(``kube_api_fake``: kmock's emulator with resourceVersions, the status subresource,
schema validation, 409 on a stale write, 410 Gone on an expired watch) and real
expert groups on loopback running each move through the executor (``migration_mesh``).

No API server can run on these machines; the fake speaks the real HTTP protocol
to the real ``kubernetes`` client, so the code under test is the code that runs
in a pod.
"""

from __future__ import annotations

import time
from dataclasses import replace

import kubernetes
import pytest
from migration_mesh import EXPERT, LAYER, PAIR, FollowingRouter

from conftest import NAMESPACE, RESOURCE
from expertmesh.contracts.errors import MigrationRefused
from expertmesh.orchestrator.kube.api import KubeApiError, connect, create_migration_object
from expertmesh.orchestrator.kube.conditions import status_of
from expertmesh.orchestrator.kube.controller import migration_id_for
from expertmesh.orchestrator.kube.resource import ConditionType, ExpertMigration, MigrationSpec, Origin, camel
from expertmesh.orchestrator.migration.executor import MigrationExecutor
from expertmesh.orchestrator.migration.plan import PHASES
from expertmesh.orchestrator.migration.state import MigrationMode, Phase, load, load_all

MOVE = MigrationSpec(LAYER, EXPERT, MigrationMode.MOVE, None, "g2")


def wait_for(check, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def finished(kube_api, obj: ExpertMigration) -> ExpertMigration:
    return wait_for(
        lambda: (o := kube_api.get(NAMESPACE, obj.name)) is not None and o.status.finished and o,
        f"{obj.name} to finish",
    )


def truth(obj_doc: dict) -> dict[str, str]:
    return {c["type"]: c["status"] for c in (obj_doc.get("status") or {}).get("conditions", [])}


def events_of(kubeconfig, name: str) -> list[tuple[str, str]]:
    """(type, reason) of the Events about ``name``, in the order they were recorded."""
    core = kubernetes.client.CoreV1Api(connect(str(kubeconfig)).client)
    items = core.list_namespaced_event(NAMESPACE).items
    mine = sorted((e for e in items if e.involved_object.name == name), key=lambda e: int(e.metadata.resource_version))
    assert all(
        e.involved_object.kind == "ExpertMigration" and e.source.component == "expertmesh-orchestrator" for e in mine
    )
    return [(e.type, e.reason) for e in mine]


# -- create -> conditions progress -> Succeeded --------------------------------------------------


def test_an_object_runs_through_the_executor_and_its_conditions_progress(
    api_server, kube_api, kubeconfig, group_mesh, run_controller
):
    store = group_mesh.store
    with run_controller():
        # One router that stops at v2: the move gets loaded, checked and switched, then waits to drain.
        with FollowingRouter(store, "r1", stop_at=2):
            obj = create_migration_object(kube_api, MOVE, origin=Origin.MANUAL)
            draining = wait_for(
                lambda: (o := kube_api.get(NAMESPACE, obj.name)) and o.status.phase == "Draining" and o,
                "the move to drain",
            )
        assert {c.type.value: c.status for c in draining.status.conditions} == {
            "Loaded": "True",
            "Switched": "True",
            "Drained": "Unknown",
        }
        assert not draining.status.finished
        with FollowingRouter(store, "r1"):  # the router takes v3: the source drains
            done = finished(kube_api, obj)

    assert done.status.phase == "Succeeded", done.status
    assert {c.type.value: (c.status, c.reason) for c in done.status.conditions} == {
        "Loaded": ("True", "CanaryPassed"),
        "Switched": ("True", "TablePublished"),
        "Drained": ("True", "SourceDrained"),
        "Succeeded": ("True", "Completed"),
    }
    assert (done.status.source, done.status.target, done.status.routing_table_version) == ("g0", "g2", 3)
    assert done.status.bytes_loaded > 0 and done.status.completed_at >= done.status.started_at
    assert done.status.migration_id == migration_id_for(done.uid)
    record = load(store, done.status.migration_id)
    assert record.phase is Phase.SUCCEEDED and record.initiator == f"kubernetes:{NAMESPACE}/{obj.name}"
    assert (
        store.routing_table().replicas[PAIR] == ("g2",)
        and PAIR in group_mesh.held("g2")
        and PAIR not in group_mesh.held("g0")
    )

    # Every stored version of the object: a condition, once True, stays True, and they turn True in order.
    versions = [truth(doc) for doc in api_server.history(RESOURCE, NAMESPACE, obj.name)]
    first_true = {
        k: next(i for i, v in enumerate(versions) if v.get(k) == "True")
        for k in ("Loaded", "Switched", "Drained", "Succeeded")
    }
    assert first_true["Loaded"] <= first_true["Switched"] < first_true["Drained"] <= first_true["Succeeded"]
    for kind, i in first_true.items():
        assert all(v.get(kind) == "True" for v in versions[i:]), kind
    # One Event per phase the record entered, in order.
    assert events_of(kubeconfig, obj.name) == [("Normal", camel(p.value)) for p in PHASES[MigrationMode.MOVE]]


def test_a_spec_the_executor_refuses_fails_the_object_with_its_reason(kube_api, kubeconfig, group_mesh, run_controller):
    with run_controller():
        unknown = create_migration_object(
            kube_api, MigrationSpec(LAYER, EXPERT, MigrationMode.MOVE, None, "g9"), origin=Origin.MANUAL
        )
        last = create_migration_object(
            kube_api, MigrationSpec(LAYER, EXPERT, MigrationMode.EVICT), origin=Origin.MANUAL
        )
        unknown, last = finished(kube_api, unknown), finished(kube_api, last)
    for obj, words in ((unknown, "unknown group 'g9'"), (last, "holds the only replica")):
        failed = obj.status.condition(ConditionType.FAILED)
        assert obj.status.phase == "Failed" and failed.reason == "Refused" and words in failed.message
        assert events_of(kubeconfig, obj.name) == [("Warning", "Refused")]
    assert load_all(group_mesh.store) == [] and group_mesh.store.routing_table().version == 1


def test_the_api_server_refuses_an_invalid_spec_by_the_crd_schema(kube_api):
    for spec, words in [
        ({"layer": -1, "expert": 0, "to": "g2"}, "spec.layer"),
        ({"layer": 0, "expert": -3, "to": "g2"}, "spec.expert"),
        ({"layer": 0, "expert": 0, "to": "g2", "mode": "teleport"}, "spec.mode"),
        ({"expert": 0, "to": "g2"}, "'layer' is a required property"),
    ]:
        body = {
            "apiVersion": "expertmesh.io/v1alpha1",
            "kind": "ExpertMigration",
            "metadata": {"name": "bad"},
            "spec": spec,
        }
        with pytest.raises(KubeApiError, match="422") as err:
            kube_api.create(NAMESPACE, body)
        assert words in str(err.value)
    created = kube_api.create(
        NAMESPACE,
        {
            "apiVersion": "expertmesh.io/v1alpha1",
            "kind": "ExpertMigration",
            "metadata": {"name": "ok"},
            "spec": {"layer": 0, "expert": 0, "to": "g2"},
        },
    )
    assert created.spec.mode is MigrationMode.MOVE, "the schema's default mode is applied"


def test_a_conflicting_status_write_is_reread_and_retried(api_server, kube_api, group_mesh, run_controller):
    # Another client labels the object between the controller's read and its first status write.
    def touched(doc: dict) -> None:
        doc["metadata"].setdefault("labels", {})["team"] = "inference"

    api_server.call(
        api_server.fake.interfere_once, lambda r: r.method.value == "PATCH" and r.subresource == "status", touched
    )
    with run_controller(), FollowingRouter(group_mesh.store, "r1"):
        done = finished(kube_api, create_migration_object(kube_api, MOVE, origin=Origin.MANUAL))
    assert api_server.call(lambda: api_server.fake.conflicts) == 1
    assert done.status.phase == "Succeeded" and done.labels["team"] == "inference", "neither write undid the other"


# -- restarts: finished objects are left alone, started ones resume their record ------------------


def test_a_finished_object_is_left_alone(api_server, kube_api, kubeconfig, group_mesh, run_controller):
    doc = {
        "apiVersion": "expertmesh.io/v1alpha1",
        "kind": "ExpertMigration",
        "metadata": {"name": "old", "namespace": NAMESPACE},
        "spec": {"layer": LAYER, "expert": EXPERT, "to": "g2", "mode": "move"},
        "status": {
            "phase": "Failed",
            "conditions": [
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "DrainTimeout",
                    "message": "x",
                    "lastTransitionTime": "2024-01-01T00:00:00Z",
                }
            ],
        },
    }
    stored = api_server.call(api_server.fake.put, RESOURCE, doc)
    with run_controller():
        time.sleep(1.0)  # many polls and one watch round
    after = kube_api.get(NAMESPACE, "old")
    assert after.resource_version == stored["metadata"]["resourceVersion"], "not written"
    assert load_all(group_mesh.store) == [] and events_of(kubeconfig, "old") == []


def test_an_object_whose_status_names_a_record_resumes_it(
    api_server, kube_api, kubeconfig, group_mesh, runner, run_controller
):
    store = group_mesh.store
    obj = create_migration_object(kube_api, MOVE, origin=Origin.MANUAL)
    # A previous orchestrator started the move, got it to SWITCHING, reported that, and stopped.
    previous = MigrationExecutor(store, poll_s=0.01)
    record = previous.submit(LAYER, EXPERT, target="g2", migration_id=migration_id_for(obj.uid))
    for _ in range(3):
        record = previous.step(record.id)
    previous.close()
    assert record.phase is Phase.SWITCHING
    kube_api.write_status(obj, lambda current: status_of(record, current.generation))

    runner.resume()  # as start_admin does before the controller starts
    with run_controller(), FollowingRouter(store, "r1"):
        done = finished(kube_api, obj)
    assert done.status.phase == "Succeeded" and done.status.migration_id == record.id
    assert [m.id for m in load_all(store)] == [record.id], "no second migration"
    order = PHASES[MigrationMode.MOVE]
    later = order[order.index(Phase.SWITCHING) + 1 :]
    assert events_of(kubeconfig, obj.name) == [("Normal", camel(p.value)) for p in later], "events only for what is new"


def test_an_object_whose_first_status_write_was_lost_finds_its_record(kube_api, group_mesh, run_controller):
    obj = create_migration_object(kube_api, MOVE, origin=Origin.MANUAL)
    executor = MigrationExecutor(group_mesh.store, poll_s=0.01)
    with FollowingRouter(group_mesh.store, "r1"):
        executor.run(executor.submit(LAYER, EXPERT, target="g2", migration_id=migration_id_for(obj.uid)).id)
    executor.close()
    with run_controller():
        done = finished(kube_api, obj)
    assert done.status.phase == "Succeeded" and len(load_all(group_mesh.store)) == 1


def test_an_object_naming_a_record_submitted_first_only_reports_on_it(kube_api, group_mesh, runner, run_controller):
    # The drift controller's way: submit to the runner, then create the object naming the record.
    with run_controller(), FollowingRouter(group_mesh.store, "r1"):
        record = runner.submit(LAYER, EXPERT, "g2", None, MigrationMode.MOVE, initiator="drift:hot_group")
        obj = create_migration_object(
            kube_api, MOVE, origin=Origin.DRIFT, initiator="drift:hot_group", migration_id=record.id
        )
        done = finished(kube_api, obj)
    assert done.status.phase == "Succeeded" and done.status.migration_id == record.id
    assert [m.id for m in load_all(group_mesh.store)] == [record.id] and done.labels["expertmesh.io/origin"] == "drift"


def test_an_object_whose_record_is_gone_fails_instead_of_moving_again(kube_api, kubeconfig, group_mesh, run_controller):
    obj = create_migration_object(kube_api, MOVE, origin=Origin.MANUAL)
    kube_api.write_status(obj, lambda current: replace(current.status, migration_id="feedfacecafe", phase="Draining"))
    with run_controller():
        done = finished(kube_api, obj)
    failed = done.status.condition(ConditionType.FAILED)
    assert (failed.reason, failed.message) == (
        "RecordLost",
        "the state store has no migration feedfacecafe; create a new ExpertMigration",
    )
    assert load_all(group_mesh.store) == [] and events_of(kubeconfig, obj.name) == [("Warning", "RecordLost")]


# -- the watch: 410 Gone -> list again --------------------------------------------------------------


def test_an_expired_watch_lists_again_and_misses_nothing(api_server, kube_api, group_mesh, run_controller):
    doc = {
        "apiVersion": "expertmesh.io/v1alpha1",
        "kind": "ExpertMigration",
        "metadata": {"name": "during-outage", "namespace": NAMESPACE},
        "spec": {"layer": LAYER, "expert": EXPERT, "to": "g2", "mode": "move"},
    }
    with run_controller(), FollowingRouter(group_mesh.store, "r1"):
        wait_for(lambda: any("watch=true" in path.lower() for _, path in api_server.requests()), "the first watch")
        lists_before = sum(1 for m, p in api_server.requests() if m == "GET" and p.endswith("/expertmigrations"))

        def created_then_compacted():  # one step on the server's loop: the ADDED event is gone before anyone reads it
            api_server.fake.put(RESOURCE, doc)
            api_server.fake.expire_history()

        api_server.call(created_then_compacted)
        done = finished(kube_api, kube_api.get(NAMESPACE, "during-outage"))
    assert done.status.phase == "Succeeded"
    lists_after = sum(1 for m, p in api_server.requests() if m == "GET" and p.endswith("/expertmigrations"))
    assert api_server.call(lambda: api_server.fake.expired) >= 1, "a watch was answered 410 Gone"
    assert lists_after > lists_before, "the 410 made the controller list again"


def test_a_record_id_is_refused_twice(group_mesh):
    executor = MigrationExecutor(group_mesh.store, poll_s=0.01)
    assert executor.submit(LAYER, EXPERT, target="g2", migration_id="fixed-id-000").id == "fixed-id-000"
    with pytest.raises(MigrationRefused, match="exists already"):
        executor.submit(0, 0, target="g2", mode="replicate", migration_id="fixed-id-000")
    executor.close()
