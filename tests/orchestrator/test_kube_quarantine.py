"""Quarantines in Kubernetes (``kube.quarantine``, ``kube.quarantine_controller``): an
ExpertQuarantine created with kubectl quarantines, deleting it releases, a quarantine the
health monitor makes shows as a mirror object that goes away once the replica is healthy,
status and Events follow the replicas, and a spec the monitor refuses is ``Refused``.

Real parts: the in-process API server (kmock, real HTTP, the chart's CRD schema), the
``kubernetes`` client through a kubeconfig, the health monitor over real expert-group gRPC
servers on loopback (``health_mesh``). Corrupted weights are the fault
``health_mesh.corrupt`` injects in-process. Passes are driven one at a time with
``sync_once`` (the thread only repeats them).
"""

from __future__ import annotations

import kubernetes
import pytest
from health_mesh import CONFIG, REPLICATED, corrupt, rid, running

from conftest import NAMESPACE
from expertmesh.orchestrator.health.monitor import HealthMonitor
from expertmesh.orchestrator.health.state import HealthState, Initiator, load_all
from expertmesh.orchestrator.kube.api import connect
from expertmesh.orchestrator.kube.quarantine import ExpertQuarantine, QuarantineSpec, manifest, mirror_name
from expertmesh.orchestrator.kube.quarantine_controller import QuarantineApi, QuarantineController


@pytest.fixture
def mesh(tiny_checkpoints):
    with running(tiny_checkpoints("mixtral")) as m:
        yield m


@pytest.fixture
def connection(kubeconfig):
    return connect(str(kubeconfig))


@pytest.fixture
def api(connection) -> QuarantineApi:
    return QuarantineApi(connection)


@pytest.fixture
def monitor(mesh):
    m = HealthMonitor(mesh.store, mesh.checkpoint, CONFIG)
    yield m
    m.close()


@pytest.fixture
def controller(api, monitor) -> QuarantineController:
    return QuarantineController(api, monitor, NAMESPACE)


def events(connection, name: str) -> list[tuple[str, str]]:
    items = kubernetes.client.CoreV1Api(connection.client).list_namespaced_event(NAMESPACE).items
    return [(e.type, e.reason) for e in items if e.involved_object.name == name]


def objects(api) -> dict[str, ExpertQuarantine]:
    return {o.name: o for o in api.list(NAMESPACE)}


def test_a_created_object_quarantines_and_deleting_it_releases(mesh, api, controller, monitor, connection):
    monitor.update()  # baselines
    api.create(NAMESPACE, manifest(QuarantineSpec(*REPLICATED, "g1", "suspicious outputs"), "q1"))
    controller.sync_once()
    record = load_all(mesh.store)[rid(REPLICATED, "g1")]
    assert record.state is HealthState.QUARANTINED and record.quarantined_by is Initiator.KUBERNETES
    assert record.reason == "suspicious outputs" and mesh.replicas(REPLICATED) == ("g0",)
    status = objects(api)["q1"].status
    assert (status.state, status.quarantined_by, status.reason) == ("Quarantined", "kubernetes", "suspicious outputs")
    assert [(r.group, r.state, r.listed) for r in status.replicas] == [("g1", "Quarantined", False)]
    assert events(connection, "q1") == [("Warning", "Quarantined")]
    controller.sync_once()
    assert events(connection, "q1") == [("Warning", "Quarantined")], "no change, no Event"

    api.delete(objects(api)["q1"])
    controller.sync_once()
    released = load_all(mesh.store)[rid(REPLICATED, "g1")]
    assert released.state is HealthState.PROBATION and released.repairs == 1, released.reason
    (mirror,) = objects(api).values()
    assert mirror.mirror and mirror.name == mirror_name(*REPLICATED, "g1") and mirror.status.state == "Probation"
    for _ in range(CONFIG.probation_checks):
        monitor.update()
    controller.sync_once()
    assert objects(api) == {}, "healthy again: the mirror goes"
    assert events(connection, mirror.name) == [("Normal", "Probation"), ("Normal", "Healthy")]
    assert mesh.replicas(REPLICATED) == ("g0", "g1")


def test_a_monitor_quarantine_shows_as_a_mirror_until_the_replica_is_healthy(
    mesh, api, controller, monitor, connection
):
    monitor.update()
    corrupt(mesh, "g1", REPLICATED)
    monitor.update()
    controller.sync_once()
    name = mirror_name(*REPLICATED, "g1")
    mirror = objects(api)[name]
    assert mirror.mirror and mirror.spec == QuarantineSpec(*REPLICATED, "g1")
    assert (mirror.status.state, mirror.status.quarantined_by) == (
        "Quarantined",
        "monitor",
    ) and "fingerprint" in mirror.status.reason
    monitor.update()  # the monitor repairs its own quarantine: probation
    controller.sync_once()
    assert objects(api)[name].status.state == "Probation"
    for _ in range(CONFIG.probation_checks):
        monitor.update()
    controller.sync_once()
    assert name not in objects(api)
    assert events(connection, name) == [("Warning", "Quarantined"), ("Normal", "Probation"), ("Normal", "Healthy")]


def test_deleting_a_mirror_releases_its_replica(mesh, api, controller, monitor):
    monitor.quarantine(*REPLICATED, "g1", reason="operator says so")  # `expertmesh quarantine`: not repaired on its own
    controller.sync_once()
    (mirror,) = objects(api).values()
    assert (mirror.status.state, mirror.status.quarantined_by) == ("Quarantined", "operator")
    api.delete(mirror)
    controller.sync_once()
    assert load_all(mesh.store)[rid(REPLICATED, "g1")].state is HealthState.PROBATION


def test_an_object_deleted_while_no_controller_ran_is_released_at_the_next_start(mesh, api, monitor):
    api.create(NAMESPACE, manifest(QuarantineSpec(*REPLICATED), "all-replicas"))
    QuarantineController(api, monitor, NAMESPACE).sync_once()
    assert {load_all(mesh.store)[rid(REPLICATED, g)].state for g in ("g0", "g1")} == {HealthState.QUARANTINED}
    assert mesh.replicas(REPLICATED) == ("g0", "g1"), "no healthy replica left: still listed, routers fall back"
    api.delete(objects(api)["all-replicas"])
    QuarantineController(api, monitor, NAMESPACE).sync_once()  # a new process: it never saw the object
    assert {load_all(mesh.store)[rid(REPLICATED, g)].state for g in ("g0", "g1")} == {HealthState.PROBATION}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"layer": 1, "expert": 9}, "not in routing table v1"),
        ({"layer": 1, "expert": 2, "group": "g0"}, "does not serve layer 1 expert 2"),
    ],
)
def test_a_quarantine_the_monitor_refuses_is_refused_with_the_reason(mesh, api, controller, connection, spec, message):
    api.create(NAMESPACE, {**manifest(QuarantineSpec(0, 0), "bad"), "spec": spec})
    controller.sync_once()
    status = objects(api)["bad"].status
    assert status.state == "Refused" and message in status.reason
    assert events(connection, "bad") == [("Warning", "Refused")]
    assert mesh.store.quarantined() == {} and load_all(mesh.store) == {}
    controller.sync_once()
    assert events(connection, "bad") == [("Warning", "Refused")], "refused once"


def test_the_api_server_refuses_a_spec_outside_the_schema(api):
    from expertmesh.orchestrator.kube.api import KubeApiError

    with pytest.raises(KubeApiError, match="422"):
        api.create(NAMESPACE, {**manifest(QuarantineSpec(0, 0), "neg"), "spec": {"layer": -1, "expert": 0}})
