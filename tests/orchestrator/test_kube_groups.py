"""Expert groups added and removed live on Kubernetes (``orchestrator.kube.groups.KubeRayGroups``): the
launcher against the fake API server holding a RayService as the chart renders it (CPU mode, the tiny
Mixtral's two groups, one NVLink-island worker group and the default pool), with Redis as the state store.

No KubeRay and no Ray here: the test plays them. ``KubeRay`` below watches the RayService, checks each new
serveConfigV2 with Ray Serve's own schema and code-version hash (what Serve would restart), and stands in for
Serve's replica of a group added live by starting a real ``expertmesh group serve --group NAME --empty
--state-url redis://...`` process on the application's port, and stopping it (SIGTERM) when the application
is taken out. The chart's groups are the in-process groups of ``migration_mesh``; every move is a real
make-before-break migration by the orchestrator's ``GroupController``. ExpertGroup objects
(``kube.group_objects_controller``) drive the same launcher: created and deleted on the fake API server (the
chart's CRDs installed, real HTTP), as ``kubectl apply`` / ``delete`` would."""

from __future__ import annotations

import copy
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import kubernetes
import pytest
import yaml
from migration_mesh import FAST, PLACEMENT, Mesh, mesh_in_redis

from expertmesh.contracts.errors import GroupChangeRefused
from expertmesh.infra.ports import free_port_range
from expertmesh.orchestrator.admin import MigrationRunner
from expertmesh.orchestrator.elastic.controller import GroupController, GroupRequest
from expertmesh.orchestrator.elastic.state import GroupPhase
from expertmesh.orchestrator.kube.api import connect
from expertmesh.orchestrator.kube.group_objects import ExpertGroup, GroupSpec, manifest
from expertmesh.orchestrator.kube.group_objects_controller import ExpertGroupApi, ExpertGroupController
from expertmesh.orchestrator.kube.groups import (
    KubeRayGroups,
    added_app,
    fixed_groups,
    group_app,
    refusal,
    serve_config,
    serve_config_change,
    stop_refusal,
)
from expertmesh.orchestrator.migration.executor import MigrationExecutor
from helpers import held_pairs, thread_stacks, wait_for

NAMESPACE = "expertmesh"
SERVICE = "expertmesh-rs"
RESOURCE = "ray.io/v1/rayservices"
#: a minimal RayService CRD: what the launcher reads and writes (KubeRay's own schema is far larger)
RAYSERVICE_CRD = {
    "spec": {
        "group": "ray.io",
        "names": {"kind": "RayService", "plural": "rayservices", "singular": "rayservice"},
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["rayClusterConfig"],
                                "properties": {
                                    "serveConfigV2": {"type": "string"},
                                    "rayClusterConfig": {"type": "object"},
                                },
                            },
                            "status": {"type": "object"},
                        },
                    }
                },
            }
        ],
    }
}


def chart_apps(placement: dict, common: dict, *, gpus: float = 0, island: str = "") -> list[dict]:
    """The applications the chart renders (templates/rayservice.yaml: one per group, group i of the name order on
    ``port_base + i``; tests/helm checks the chart against ``group_app``)."""
    base = common["port_base"]
    return [
        group_app(g, common, port=base + i, gpus=gpus, island=island, experts=placement[g])
        for i, g in enumerate(sorted(placement))
    ]


def rayservice(model: str, state_url: str, port_base: int) -> dict:
    """The RayService the chart renders (templates/rayservice.yaml) for two groups in CPU mode."""
    placement = {
        g: {layer: sorted(e for lay, e in pairs if lay == layer) for layer in (0, 1)}
        for g, pairs in PLACEMENT.groups.items()
    }
    common = {
        "model": model,
        "dtype": "float32",
        "state_url": state_url,
        "host": "127.0.0.1",
        "port_base": port_base,
        "num_cpus": 1,
    }
    apps = chart_apps(placement, common)
    serve = {"proxy_location": "EveryNode", "http_options": {"host": "0.0.0.0", "port": 8000}, "applications": apps}
    island = '"{\\"expertmesh.io/island-a\\":1}"'  # rayStartParams.resources, quoted as the chart quotes it
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": SERVICE, "namespace": NAMESPACE},
        "spec": {
            "serveConfigV2": yaml.safe_dump(serve),
            "rayClusterConfig": {
                "rayVersion": "2.60.0",
                "headGroupSpec": {"rayStartParams": {"num-cpus": "0"}, "template": {}},
                "workerGroupSpecs": [
                    {"groupName": "island-a", "replicas": 1, "rayStartParams": {"resources": island}, "template": {}},
                    {"groupName": "workers", "replicas": 1, "rayStartParams": {}, "template": {}},
                ],
            },
        },
    }


class KubeRay:
    """Plays KubeRay and Ray Serve: each serveConfigV2 the RayService gets is checked as Serve checks it, and a
    group's application that appears gets a real group process, one that disappears has its process stopped (a
    chart group's: ``stop_chart_group``, its in-process server)."""

    def __init__(self, launcher: KubeRayGroups, model: str, state_url: str, stop_chart_group: Callable[[str], None]):
        self._launcher, self._model, self._state_url = launcher, model, state_url
        self._stop_chart_group = stop_chart_group
        #: the chart's groups Serve runs (their servers are the mesh's)
        self.chart_groups: set[str] | None = None
        self.processes: dict[str, subprocess.Popen] = {}
        self.exit_codes: dict[str, int] = {}
        #: application name -> every code version Serve gave it (a new one restarts all its deployments)
        self.code_versions: dict[str, list[str]] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kuberay", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from ray.serve._private.constants import DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S
        from ray.serve._private.deploy_utils import get_app_code_version
        from ray.serve.schema import ServeDeploySchema

        seen = None
        while not self._stop.wait(0.05):
            text = self._launcher.service()["spec"]["serveConfigV2"]
            if text == seen:
                continue
            seen = text
            try:
                config = ServeDeploySchema.model_validate(yaml.safe_load(text))
            except Exception as err:  # what Serve would answer KubeRay: the config is refused
                self.errors.append(str(err))
                continue
            apps = {app.name: app for app in config.applications}
            for name, app in apps.items():
                versions = self.code_versions.setdefault(name, [])
                version = get_app_code_version(app)
                if not versions or versions[-1] != version:
                    versions.append(version)
            placed = {g for app in apps.values() for g in ((app.args.get("placement") or {}).get("groups") or ())}
            if self.chart_groups is None:
                self.chart_groups = placed
            for group in sorted(self.chart_groups - placed):
                self._stop_chart_group(group)
            self.chart_groups &= placed
            # a group added live, or a chart group's application back after its removal (`helm upgrade`): a
            # process of its own (Serve's replica would load the chart's experts for it; no table lists them)
            live = {g for app in apps.values() for g in [*app.args.get("empty", ()), *app.args.get("ports", {})]}
            live -= self.chart_groups
            for app in apps.values():
                for group in sorted(set(app.args.get("ports", {})) & live - set(self.processes)):
                    self._start(group, app.args["ports"][group])
            for group in [g for g in self.processes if g not in live]:
                proc = self.processes.pop(group)
                proc.send_signal(signal.SIGTERM)
                try:
                    self.exit_codes[group] = proc.wait(timeout=DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S)
                except subprocess.TimeoutExpired:  # as Serve kills a replica past its graceful shutdown
                    proc.kill()
                    self.exit_codes[group] = proc.wait()
                    grace = DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S
                    self.errors.append(f"group {group} was killed: it did not stop within {grace} s of SIGTERM")

    def _start(self, group: str, port: int) -> None:
        argv = [sys.executable, "-m", "expertmesh.cli.main", "group", "serve", "--group", group, "--empty"]
        argv += ["--model", self._model, "--state-url", self._state_url, "--host", "127.0.0.1", "--port", str(port)]
        self.processes[group] = subprocess.Popen(argv, stdout=subprocess.DEVNULL)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for proc in self.processes.values():
            proc.kill()
            proc.wait()


def _gpu_service(groups_on_island: int) -> dict:
    """A GPU chart's RayService: groups g0.. on island ``a`` (2 slots), 2 GPUs each."""
    service = rayservice("/models/m", "redis://r:6379/0", 50100)
    config = serve_config(service)
    common = config["applications"][0]["args"]
    placement = {f"g{i}": {"*": [i]} for i in range(groups_on_island)}
    config["applications"] = chart_apps(placement, common, gpus=2, island="a")
    service["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    island = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    island["rayStartParams"]["resources"] = '"{\\"expertmesh.io/island-a\\":4}"'
    island["template"] = {
        "spec": {"containers": [{"name": "ray-worker", "resources": {"limits": {"nvidia.com/gpu": 4}}}]}
    }
    return service


def test_the_application_of_a_group_added_on_an_island_is_rendered_as_the_chart_renders_its_groups():
    from ray.serve.schema import ServeDeploySchema

    service = _gpu_service(1)
    config = serve_config(service)
    assert refusal(service, gpus=0, island="a", node="") is None
    app = added_app(config, "g7", gpus=0, island="a")
    (directory, deployment) = app["deployments"]
    res = "expertmesh.io/island-a"
    assert deployment == {
        "name": "group-g7",
        "num_replicas": 1,
        "ray_actor_options": {"num_cpus": 1, "num_gpus": 2, "resources": {res: 1}},
        "placement_group_bundles": [{"CPU": 1, res: 1, "GPU": 2}],
        "placement_group_strategy": "STRICT_PACK",
    }
    assert app["args"]["ports"] == {"g7": 50101} and app["args"]["resources"] == {"g7": {res: 1}}
    changed = serve_config_change(config, add=app)
    ServeDeploySchema.model_validate(changed)  # what Serve takes from KubeRay
    assert added_app(changed, "g8", gpus=4, island="")["args"]["ports"] == {"g8": 50102}
    assert serve_config_change(changed, remove="g7") == config
    assert fixed_groups(changed) == {"g0"} and stop_refusal(changed, "g7") is None
    # a chart group's application goes like one added live; the last group stays
    assert stop_refusal(changed, "g0") is None
    assert serve_config_change(changed, remove="g0")["applications"] == [app]
    assert stop_refusal(config, "g0") == (
        "group g0 is the RayService's last expert group; add another first (`expertmesh groups add`)"
    )
    # a release of the chart from before one application per group: its groups stay until helm upgrade
    legacy = serve_config(_gpu_service(2))
    shared = copy.deepcopy(legacy["applications"][0])
    shared["name"] = "expertmesh-groups"
    shared["args"]["placement"] = {"groups": {"g0": {"*": [0]}, "g1": {"*": [1]}}}
    shared["deployments"] += legacy["applications"][1]["deployments"][1:]
    legacy["applications"] = [shared]
    assert fixed_groups(legacy) == {"g0", "g1"}
    assert stop_refusal(legacy, "g1").startswith("group g1 is one of the 2 groups of Serve application expertmesh-gr")
    assert "helm upgrade" in stop_refusal(legacy, "g1")
    full = _gpu_service(2)
    why = refusal(full, gpus=0, island="a", node="")
    assert why == (
        "--island a: its worker pod has 4 GPUs, 4 held by groups g0, g1, and the group needs 2; remove one first "
        "(`expertmesh groups remove NAME`)"
    )
    assert refusal(_gpu_service(1), gpus=3, island="a", node="").startswith("--island a: its worker pod has 4 GPUs")
    cpu = rayservice("/models/m", "redis://r:6379/0", 50100)  # island a: one slot
    taken = serve_config_change(serve_config(cpu), add=added_app(serve_config(cpu), "g5", gpus=0, island="a"))
    why = refusal(cpu, gpus=0, island="a", node="", config=taken)
    assert why == "--island a: its 1 slot(s) hold groups g5; remove one first (`expertmesh groups remove NAME`)"
    assert refusal(full, gpus=4, island="", node="") is None  # a GPU chart: any count; Ray places it or not


@pytest.fixture
def rayservice_api(api_server, kubeconfig, tiny_checkpoints, redis_url):
    api_server.call(api_server.fake.install_crd, RAYSERVICE_CRD)
    model = str(tiny_checkpoints("mixtral"))
    port_base = free_port_range(4)
    api_server.call(api_server.fake.put, RESOURCE, rayservice(model, redis_url, port_base))
    return connect(str(kubeconfig)), model, port_base


def _done(controller, name, phase):
    return wait_for(
        lambda: (r := controller.get(name)).phase in (phase, GroupPhase.FAILED) and r, f"{name} {phase}", 120
    )


@dataclass
class LiveGroups:
    mesh: Mesh
    launcher: KubeRayGroups
    kuberay: KubeRay
    controller: GroupController
    #: the RayService's serve config before any change
    original: dict


@contextmanager
def live_groups(connection, model: str, redis_url: str) -> Iterator[LiveGroups]:
    """The chart's two groups (``migration_mesh``, in Redis), the launcher on the fake RayService, ``KubeRay``
    playing KubeRay and Serve, and the orchestrator's ``GroupController`` over them."""
    with mesh_in_redis(redis_url, model) as mesh:
        mesh.groups["g2"].server.stop(0)  # the mesh's spare group: not this platform's
        mesh.store.remove_endpoint("g2")
        launcher = KubeRayGroups(connection, SERVICE, mesh.store, poll_s=0.05, start_timeout_s=120, stop_timeout_s=60)
        original = copy.deepcopy(serve_config(launcher.service()))
        kuberay = KubeRay(launcher, model, redis_url, lambda g: mesh.groups[g].server.stop(1))
        runner = MigrationRunner(mesh.store, MigrationExecutor(mesh.store, **FAST))
        controller = GroupController(mesh.store, runner.submit, launcher, poll_s=0.01)
        try:
            yield LiveGroups(mesh, launcher, kuberay, controller, original)
        finally:
            controller.close()
            runner.close()
            kuberay.close()


def test_a_group_added_on_kubernetes_is_filled_and_removed_again(api_server, rayservice_api, redis_url):
    connection, model, port_base = rayservice_api
    with live_groups(connection, model, redis_url) as live:
        mesh, launcher, kuberay, controller, original = (
            live.mesh,
            live.launcher,
            live.kuberay,
            live.controller,
            live.original,
        )
        assert [(r.name, r.phase) for r in controller.records()] == [("g0", "serving"), ("g1", "serving")]
        # KubeRay writes the object too: the launcher's first patch meets a newer resourceVersion (409)
        api_server.call(
            api_server.fake.interfere_once,
            lambda request: request.method.value.upper() == "PATCH" and "rayservices" in str(request.url),
            lambda doc: doc["metadata"].setdefault("labels", {}).update({"ray.io/serve": "true"}),
        )
        controller.add(GroupRequest("g3"))
        added = _done(controller, "g3", GroupPhase.SERVING)
        assert added.phase is GroupPhase.SERVING, added.reason
        assert api_server.fake.conflicts == 1
        assert added.address == f"127.0.0.1:{port_base + 2}"  # the first port of the chart's range left free
        table = mesh.store.routing_table()
        assert held_pairs(added.address) == set(table.placement().groups["g3"]) != set()
        assert added.moves_done == added.moves_planned > 0
        config = serve_config(launcher.service())
        assert config["applications"][:2] == original["applications"]  # the chart's applications untouched
        (app,) = config["applications"][2:]
        assert app["name"] == "expertmesh-group-g3" and app["args"]["empty"] == ["g3"]
        assert [d["name"] for d in app["deployments"]] == ["directory", "group-g3"]
        assert set(launcher.running()) == {"g0", "g1", "g3"}

        # what the RayService cannot take, refused before anything changes
        for request, message in [
            (dict(gpus=1), "--gpus 1: the chart runs its expert groups on CPU"),
            (dict(island="b"), r"--island b: the RayService has no worker group for it \(its islands: a\)"),
            (dict(node="n1"), "--node: on Kubernetes a group lands on a worker pod of its island"),
        ]:
            with pytest.raises(GroupChangeRefused, match=message):
                controller.add(GroupRequest(**request))
        launcher.check(island="a")  # its slot is free

        removed = controller.remove("g3")
        assert removed.phase is GroupPhase.DRAINING
        removed = _done(controller, "g3", GroupPhase.STOPPED)
        assert removed.phase is GroupPhase.STOPPED, removed.reason
        assert removed.exit_code == 0  # its port stopped answering: its server has drained
        assert wait_for(lambda: kuberay.exit_codes, "g3's process ended", 60) == {"g3": 0}
        assert serve_config(launcher.service()) == original
        table = mesh.store.routing_table()
        assert set(table.groups()) == {"g0", "g1"} and "g3" not in mesh.store.endpoints()
        assert set(table.replicas) == {(layer, e) for layer in range(2) for e in range(4)}
        # Serve would never have restarted the chart's groups: their applications kept their code versions
        assert {app: len(v) for app, v in kuberay.code_versions.items()} == {
            "expertmesh-group-g0": 1,
            "expertmesh-group-g1": 1,
            "expertmesh-group-g3": 1,
        }
        assert kuberay.errors == []


def test_a_chart_group_is_drained_and_its_application_removed(api_server, rayservice_api, redis_url):
    """One of the chart's groups removed live: drained by live moves, then its application taken out of the
    serveConfigV2; the other group's application keeps its code version (Serve never restarts it). The last group
    is refused."""
    connection, model, _ = rayservice_api
    with live_groups(connection, model, redis_url) as live:
        mesh, launcher, kuberay, controller, original = (
            live.mesh,
            live.launcher,
            live.kuberay,
            live.controller,
            live.original,
        )
        wait_for(lambda: kuberay.chart_groups, "KubeRay saw the chart's groups", 30)
        assert launcher.fixed_groups() == {"g0", "g1"}
        launcher.check_stop("g0")
        removed = controller.remove("g0")
        assert removed.phase is GroupPhase.DRAINING
        removed = _done(controller, "g0", GroupPhase.STOPPED)
        assert removed.phase is GroupPhase.STOPPED, removed.reason
        assert removed.exit_code == 0 and removed.moves_done == removed.moves_planned > 0
        assert serve_config(launcher.service())["applications"] == original["applications"][1:]
        assert kuberay.chart_groups == {"g1"}
        table = mesh.store.routing_table()
        assert set(table.groups()) == {"g1"} and "g0" not in mesh.store.endpoints()
        assert set(table.replicas) == {(layer, e) for layer in range(2) for e in range(4)}
        assert held_pairs(mesh.groups["g1"].address) == set(table.placement().groups["g1"])
        with pytest.raises(GroupChangeRefused, match="last expert group"):
            controller.remove("g1")
        with pytest.raises(GroupChangeRefused, match="g1 is the RayService's last expert group"):
            launcher.check_stop("g1")
        assert controller.get("g1").phase is GroupPhase.SERVING
        # Ray's own hash: g1's application had one code version all along (none of its replicas restarted)
        assert kuberay.code_versions["expertmesh-group-g1"] == kuberay.code_versions["expertmesh-group-g1"][:1]
        assert set(kuberay.code_versions) == {"expertmesh-group-g0", "expertmesh-group-g1"}
        assert kuberay.errors == []

        # What `helm upgrade` does afterwards (g0's application rendered back, its group registering again) is
        # test_elastic_groups' test_a_stopped_group_that_registers_again_is_serving_again: run here end to end, the
        # second stop timed out in 2 of 5 runs (cause not found; see the stop's note).


@pytest.mark.slow
def test_the_orchestrator_process_takes_group_changes_through_its_ray_service(
    api_server, rayservice_api, kubeconfig, redis_url, tmp_path
):
    """``expertmesh orchestrator --kube --ray-service NAME`` (as the chart runs it): its admin API takes adds and
    removes through the RayService, refusing what that RayService cannot take, each with one line, and so does
    its ExpertGroup controller (an object asking for what the chart can never place is Refused with the line)."""
    import os
    import time

    import grpc

    from expertmesh.v1 import admin_pb2 as pb
    from expertmesh.v1 import admin_pb2_grpc as pb_grpc
    from helpers import orchestrator_argv

    _, model, _ = rayservice_api
    placement = tmp_path / "placement.yaml"
    placement.write_text(yaml.safe_dump({"groups": {"g0": {"*": [0, 1]}, "g1": {"*": [2, 3]}}}))
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"} | {"KUBECONFIG": str(kubeconfig)}
    admin_port = free_port_range(1)
    with mesh_in_redis(redis_url, model):
        missing = orchestrator_argv(redis_url, model, placement, "--kube", "--ray-service", "nope")
        result = subprocess.run(missing, capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode != 0 and f"no RayService nope in namespace {NAMESPACE}" in result.stderr, result.stderr
        argv = orchestrator_argv(redis_url, model, placement, "--kube", "--ray-service", SERVICE, admin_port=admin_port)
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        stderr: list[str] = []
        threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
        channel = grpc.insecure_channel(f"127.0.0.1:{admin_port}")
        try:
            deadline = time.monotonic() + 120
            while not any(f"as applications of RayService {SERVICE}" in line for line in stderr):
                assert proc.poll() is None and time.monotonic() < deadline, "".join(stderr)[-3000:]
                time.sleep(0.1)
            stub = pb_grpc.AdminStub(channel)
            for call, request, message in [
                (stub.AddGroup, pb.AddGroupRequest(gpus=1), "--gpus 1: the chart runs its expert groups on CPU"),
                (stub.AddGroup, pb.AddGroupRequest(island="b"), "--island b: the RayService has no worker group"),
            ]:
                with pytest.raises(grpc.RpcError) as refused:
                    call(request, timeout=30)
                assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION, refused.value.details()
                assert message in refused.value.details()
            # its ExpertGroup controller runs too: an object the RayService can never take is refused, saying why
            groups = ExpertGroupApi(connect(str(kubeconfig)))
            groups.create(NAMESPACE, manifest("g7", GroupSpec(gpus=1)))
            status = wait_for(lambda: (o := groups.get(NAMESPACE, "g7")).status.phase and o.status, "g7's status", 60)
            assert (status.phase, status.reason) == ("Refused", "GroupSpecRefused"), status
            assert "--gpus 1: the chart runs its expert groups on CPU" in status.message
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, "".join(stderr)[-3000:]
        finally:
            channel.close()
            if proc.poll() is None:
                proc.kill()


def test_a_group_serve_fails_is_taken_out_again_with_serves_message(api_server, rayservice_api, redis_url):
    """KubeRay reports Serve's failure of the new application in the RayService's status: the start fails with
    that message, and the application is taken out again (the chart's untouched all along)."""
    from kubernetes import client as k8s

    from expertmesh.contracts.errors import GroupUnavailable
    from expertmesh.store import open_store

    connection, _, _ = rayservice_api
    store = open_store(redis_url)
    launcher = KubeRayGroups(connection, SERVICE, store, poll_s=0.05, start_timeout_s=60)
    original = serve_config(launcher.service())
    custom = k8s.CustomObjectsApi(connection.client)

    def fail_it() -> None:
        wait_for(lambda: len(serve_config(launcher.service())["applications"]) == 3, "the new application", 30)
        message = "replica raised OverBudget: 4 MiB over"
        status = {"applicationStatuses": {"expertmesh-group-g9": {"status": "DEPLOY_FAILED", "message": message}}}
        custom.patch_namespaced_custom_object_status(
            "ray.io",
            "v1",
            NAMESPACE,
            "rayservices",
            SERVICE,
            {"status": {"activeServiceStatus": status}},
            _content_type="application/merge-patch+json",
        )

    kuberay = threading.Thread(target=fail_it, daemon=True)
    kuberay.start()
    try:
        with pytest.raises(GroupUnavailable, match="DEPLOY_FAILED: replica raised OverBudget: 4 MiB over"):
            launcher.start("g9")
        kuberay.join(timeout=30)
        assert serve_config(launcher.service()) == original
    finally:
        store.close()


# -- ExpertGroup objects (kube.group_objects_controller) -------------------------------------------------------


def _events(connection, name: str) -> list[tuple[str, str]]:
    items = kubernetes.client.CoreV1Api(connection.client).list_namespaced_event(NAMESPACE).items
    return [(e.type, e.reason) for e in sorted(items, key=lambda e: e.metadata.resource_version)
            if e.involved_object.name == name]  # fmt: skip


def _synced_until(
    objects: ExpertGroupController, done: Callable[[dict[str, ExpertGroup]], object], what: str, live: LiveGroups
):
    """Passes (as the controller's thread makes them) until ``done(objects by name)``; past the wait, where the
    groups, their migrations, the KubeRay stand-in and the threads stood."""

    def step():
        objects.sync_once()
        return done({o.name: o for o in objects.api.list(NAMESPACE)})

    def explain() -> str:
        from expertmesh.orchestrator.migration.state import load_all

        records = [
            f"{r.name}: {r.phase} {r.moves_done}/{r.moves_planned} {r.reason}" for r in live.controller.records()
        ]
        migrations = [
            f"{m.describe()}: {m.phase} {m.reason}" for m in load_all(live.mesh.store) if not m.phase.terminal
        ]
        processes = {g: p.poll() for g, p in live.kuberay.processes.items()}
        return "\n".join(
            [
                f"records: {records}",
                f"migrations in flight: {migrations}",
                f"endpoints: {live.mesh.store.endpoints()}",
                f"KubeRay: processes (exit status) {processes}, stopped {live.kuberay.exit_codes}, "
                f"errors {live.kuberay.errors}",
                thread_stacks("expertmesh-group-", "expertmesh-migration", "kuberay"),
            ]
        )

    return wait_for(step, what, 120, poll_s=0.05, explain=explain)


def test_expert_group_objects_add_and_remove_groups_and_mirror_those_added_another_way(
    api_server, rayservice_api, redis_url
):
    """``kubectl apply`` of an ExpertGroup adds its group, the CLI's group gets a mirror, ``kubectl delete`` of
    either drains and stops its group (the second removal waits for the first: one change at a time), and the
    RayService's serve config is the chart's again; an object with a name no group may have, or a chart group's,
    is Refused and changes nothing. Passes are driven with ``sync_once`` (the thread only repeats them)."""
    connection, model, _ = rayservice_api
    with live_groups(connection, model, redis_url) as live:
        api = ExpertGroupApi(connection)
        objects = ExpertGroupController(api, live.controller, live.launcher.fixed_groups, NAMESPACE)
        objects.sync_once()
        assert api.list(NAMESPACE) == [], "the chart's groups are never mirrored"

        bad = "a-name-longer-than-the-forty-characters-a-group-name-has"
        for name in ("g3", bad, "g0"):
            api.create(NAMESPACE, manifest(name, GroupSpec()))
        objects.sync_once()
        listed = {o.name: o.status for o in api.list(NAMESPACE)}
        assert listed["g3"].phase == "Starting"
        assert (listed[bad].phase, listed[bad].reason) == ("Refused", "InvalidName")
        assert "is no expert group name" in listed[bad].message
        assert (listed["g0"].phase, listed["g0"].reason) == ("Refused", "ChartGroup")
        assert "helm upgrade" in listed["g0"].message
        assert _events(connection, bad) == _events(connection, "g0") == [("Warning", "Refused")]
        assert {r.name for r in live.controller.records()} == {"g0", "g1", "g3"}, "the refused change nothing"
        assert live.controller.get("g0").phase is GroupPhase.SERVING

        serving = _synced_until(
            objects, lambda o: o["g3"].status.phase in ("Serving", "Failed") and o["g3"], "g3", live
        )
        record = live.controller.get("g3")
        assert serving.status.phase == "Serving", serving.status.message
        assert serving.status.endpoint == record.address and serving.status.moves == f"{record.moves_done}/" + str(
            record.moves_planned
        )
        shown = _events(connection, "g3")
        assert shown[0] == ("Normal", "Starting") and shown[-1] == ("Normal", "Serving"), shown
        assert len(set(shown)) == len(shown), "one Event per phase"
        assert set(live.controller.get(n).phase for n in ("g0", "g1")) == {GroupPhase.SERVING}

        live.controller.add(GroupRequest("g4"))  # `expertmesh groups add --name g4`
        mirror = _synced_until(
            objects, lambda o: "g4" in o and o["g4"].status.phase == "Serving" and o["g4"], "g4", live
        )
        assert mirror.mirror and mirror.spec == GroupSpec()

        for name in ("g3", "g4"):
            api.delete(next(o for o in api.list(NAMESPACE) if o.name == name))
        objects.sync_once()
        assert live.controller.get("g3").phase is GroupPhase.DRAINING
        assert live.controller.get("g4").phase is GroupPhase.SERVING, "one change at a time: g4 waits"
        _synced_until(
            objects,
            lambda _: all(
                live.controller.get(n).phase in (GroupPhase.STOPPED, GroupPhase.FAILED) for n in ("g3", "g4")
            ),
            "g3 and g4 removed",
            live,
        )
        for name in ("g3", "g4"):
            record = live.controller.get(name)
            assert record.phase is GroupPhase.STOPPED, record.reason
        assert serve_config(live.launcher.service()) == live.original
        assert sorted(o.name for o in api.list(NAMESPACE)) == sorted([bad, "g0"]), "nothing mirrored again"
        assert set(live.mesh.store.routing_table().groups()) == {"g0", "g1"}
        assert live.kuberay.errors == [] and {len(v) for v in live.kuberay.code_versions.values()} == {1}
        objects.sync_once()
        assert _events(connection, bad) == _events(connection, "g0") == [("Warning", "Refused")], "refused once"
