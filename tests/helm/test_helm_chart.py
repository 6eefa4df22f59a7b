"""The Helm chart helm/expertmesh, rendered and validated without a cluster.

Per value set (chart defaults; GPU 2 nodes x 8 GPUs in 2 NVLink islands each; external
Redis with TLS; CPU-only): `helm lint --strict`, `helm template`, every object validated
against the Kubernetes 1.30 and newest bundled OpenAPI schemas (kubernetes-validate, strict:
unknown fields fail), the RayService against KubeRay's CRD rules (kuberay_crd.py) and its
pod templates as core/v1 PodTemplates; then what the issue asks of the objects.
"""

from __future__ import annotations

import base64
import importlib
import json
import re

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helmchart import CHART, K8S_VERSIONS, NAMESPACE, RELEASE, VALUE_SETS, VALUES_DIR, template_args, values_of
from kuberay_crd import check_rayservice, check_serve_config, parse_start_resources

SETS = list(VALUE_SETS)
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
FULLNAME = f"{RELEASE}-expertmesh"


# -- helpers ---------------------------------------------------------------------------


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def one(docs, kind, name):
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def rayservice(docs):
    (rs,) = by_kind(docs, "RayService")
    return rs


def serve_apps(docs) -> dict[str, dict]:
    """group name -> its Serve application (the chart renders one per group)."""
    cfg = yaml.safe_load(rayservice(docs)["spec"]["serveConfigV2"])
    out = {}
    for app in cfg["applications"]:
        (group,) = app["args"]["placement"]["groups"]
        out[group] = app
    return out


def shared_args(docs) -> dict:
    """The args every group's application has alike (the chart's values)."""
    from expertmesh.orchestrator.kube.groups import COMMON_ARGS

    apps = serve_apps(docs).values()
    (shared,) = {json.dumps({k: a["args"][k] for k in COMMON_ARGS if k in a["args"]}) for a in apps}
    return json.loads(shared)


def pod_templates(docs):
    """(where, pod template) for every pod the release creates, Ray pods included."""
    out = []
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            out.append((f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"]))
        elif d["kind"] == "RayService":
            cluster = d["spec"]["rayClusterConfig"]
            out.append(("RayService head", cluster["headGroupSpec"]["template"]))
            for wg in cluster["workerGroupSpecs"]:
                out.append((f"RayService worker {wg['groupName']}", wg["template"]))
    return out


def env_of(container):
    return {e["name"]: e for e in container.get("env", [])}


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


# -- lint, render, schemas ---------------------------------------------------------------


@pytest.mark.parametrize("name", SETS)
def test_helm_lint_strict(helm, name):
    args = ["lint", "--strict", str(CHART), "--kube-version", "1.30.0", "--set", "kuberay.checkCRD=false"]
    if VALUE_SETS[name] is not None:
        args += ["-f", str(VALUE_SETS[name])]
    res = helm(*args)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 chart(s) failed" in res.stdout


@pytest.mark.parametrize("name", SETS)
def test_every_object_validates_against_kubernetes_openapi(render, name):
    docs = render(name)
    assert len(docs) >= 10
    failures = []
    for version in K8S_VERSIONS:
        for obj in docs:
            where = f"{obj['kind']}/{obj['metadata']['name']} (k8s {version})"
            if obj["kind"] == "RayService":
                # A CRD: its pod templates are core/v1 PodTemplateSpecs, validated as PodTemplates.
                for tw, tpl in pod_templates([obj]):
                    wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": tpl}
                    try:
                        kubernetes_validate.validate(wrapped, version, strict=True)
                    except kubernetes_validate.ValidationError as exc:
                        failures.append(f"{where} {tw}: {'.'.join(map(str, exc.path))}: {exc.message}")
                continue
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                failures.append(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}")
            except kubernetes_validate.SchemaNotFoundError as exc:
                failures.append(f"{where}: no schema: {exc.message}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", SETS)
def test_rayservice_satisfies_kuberay_crd(render, name):
    rs = rayservice(render(name))
    assert check_rayservice(rs) == []


def test_kuberay_checker_catches_missing_fields(render):
    import copy

    rs = copy.deepcopy(rayservice(render("defaults")))
    del rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    wg = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    del wg["groupName"]
    wg["rayStartParams"]["num-gpus"] = 1
    rs["spec"]["serveConfigV2"] = "applications:\n- name: x\n"
    errors = "\n".join(check_rayservice(rs))
    assert "headGroupSpec.template: required" in errors
    assert "workerGroupSpecs[0].groupName: required" in errors
    assert "rayStartParams.num-gpus: must be a string" in errors
    assert "applications[0].import_path: required" in errors


@pytest.mark.parametrize("name", SETS)
def test_namespaced_objects_and_names(render, name):
    for obj in render(name):
        assert obj["metadata"]["name"].startswith(FULLNAME) or obj["kind"] in ("ClusterRole", "ClusterRoleBinding")
        assert "namespace" not in obj["metadata"], "helm sets the namespace at install"
        labels = obj["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/instance") == RELEASE
        assert labels.get("helm.sh/chart", "").startswith("expertmesh-")


# -- pods: security context and resources on everything ----------------------------------


@pytest.mark.parametrize("name", SETS)
def test_every_pod_is_non_root_with_hardened_containers(render, name):
    for where, tpl in pod_templates(render(name)):
        spec = tpl["spec"]
        psc = spec.get("securityContext", {})
        assert psc.get("runAsNonRoot") is True, where
        assert psc.get("runAsUser", 0) != 0, where
        assert psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
        assert spec.get("automountServiceAccountToken") is (where.endswith("-orchestrator")), where
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False, (where, c["name"])
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], (where, c["name"])
            assert sc.get("readOnlyRootFilesystem") is True, (where, c["name"])
            assert not sc.get("privileged"), (where, c["name"])
            mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
            assert "/tmp" in mounts, f"{where}/{c['name']}: read-only root needs a writable /tmp"


@pytest.mark.parametrize("name", SETS)
def test_every_container_has_requests_and_limits(render, name):
    for where, tpl in pod_templates(render(name)):
        for c in tpl["spec"]["containers"] + tpl["spec"].get("initContainers", []):
            res = c.get("resources", {})
            for kind in ("requests", "limits"):
                for r in ("cpu", "memory"):
                    q = str(res.get(kind, {}).get(r, ""))
                    assert QUANTITY.match(q), f"{where}/{c['name']}: resources.{kind}.{r}={q!r}"


# -- router --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SETS)
def test_router_grpc_service_probes_and_pdb(render, name):
    docs = render(name)
    dep = one(docs, "Deployment", f"{FULLNAME}-router")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["expertmesh"]
    args = c["args"]
    assert args[:2] == ["up", "--router-only"]
    flags = dict(zip(args[2::2], args[3::2]))
    assert flags["--host"] == "0.0.0.0" and flags["--port"] == "50051"
    assert set(flags) >= {"--model", "--state-url", "--dtype"}
    assert c["ports"] == [{"name": "grpc", "containerPort": 50051, "protocol": "TCP"}]
    # Under TLS (the default) the kubelet's plaintext gRPC probes use the health-only port.
    assert flags["--health-port"] == "50061"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["grpc"] == {"port": 50061}, probe
    svc = one(docs, "Service", f"{FULLNAME}-router")
    assert svc["spec"]["ports"][0]["port"] == 50051 and svc["spec"]["ports"][0]["appProtocol"] == "grpc"
    assert selects({"matchLabels": svc["spec"]["selector"]}, dep["spec"]["template"]["metadata"]["labels"])
    pdbs = by_kind(docs, "PodDisruptionBudget")
    if values_of(name)["router"]["podDisruptionBudget"]["enabled"]:
        (pdb,) = pdbs
        assert selects(pdb["spec"]["selector"], dep["spec"]["template"]["metadata"]["labels"])
    else:
        assert pdbs == []


def test_router_hpa_optional(render):
    assert by_kind(render("defaults"), "HorizontalPodAutoscaler") == []
    docs = render("external-redis-tls")
    (hpa,) = by_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": f"{FULLNAME}-router",
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert "replicas" not in one(docs, "Deployment", f"{FULLNAME}-router")["spec"], "the HPA owns replicas"


# -- orchestrator and RBAC -------------------------------------------------------------------


def test_orchestrator_rbac_grants_only_what_it_uses(render):
    docs = render("defaults")
    sa = f"{FULLNAME}-orchestrator"
    dep = one(docs, "Deployment", sa)
    spec = dep["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == sa
    args = spec["containers"][0]["args"]
    assert args[0] == "orchestrator"
    flags = dict(zip(args[1::2], args[2::2]))
    assert flags["--placement"] == "/etc/expertmesh/placement.yaml" and flags["--admin-port"] == "50052"
    assert flags["--health-port"] == "50062"
    c = spec["containers"][0]
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": 50062}, probe
    (cr,) = by_kind(docs, "ClusterRole")
    assert cr["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}]
    # What the ExpertMigration controller calls, and the groups added live (get and patch of this release's
    # RayService alone; ExpertGroups and their status), nothing else: no pods, no ConfigMaps (the placement: a volume).
    rayservice_name = rayservice(docs)["metadata"]["name"]
    assert flags["--ray-service"] == rayservice_name
    (role,) = by_kind(docs, "Role")
    assert role["rules"] == [
        {
            "apiGroups": ["expertmesh.io"],
            "resources": ["expertmigrations"],
            "verbs": ["get", "list", "watch", "create"],
        },
        {"apiGroups": ["expertmesh.io"], "resources": ["expertmigrations/status"], "verbs": ["patch"]},
        {
            "apiGroups": ["expertmesh.io"],
            "resources": ["expertquarantines"],
            "verbs": ["get", "list", "create", "delete"],
        },
        {"apiGroups": ["expertmesh.io"], "resources": ["expertquarantines/status"], "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
        {
            "apiGroups": ["ray.io"],
            "resources": ["rayservices"],
            "resourceNames": [rayservice_name],
            "verbs": ["get", "patch"],
        },
        {"apiGroups": ["expertmesh.io"], "resources": ["expertgroups"], "verbs": ["get", "list", "create", "delete"]},
        {"apiGroups": ["expertmesh.io"], "resources": ["expertgroups/status"], "verbs": ["patch"]},
    ]
    for kind, role_kind, role_name in (
        ("ClusterRoleBinding", "ClusterRole", cr["metadata"]["name"]),
        ("RoleBinding", "Role", role["metadata"]["name"]),
    ):
        (b,) = by_kind(docs, kind)
        assert b["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": role_name}
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
    # Nobody else gets a token.
    accounts = {d["metadata"]["name"]: d for d in by_kind(docs, "ServiceAccount")}
    assert accounts[FULLNAME]["automountServiceAccountToken"] is False


def test_no_live_groups_no_rayservice_or_expertgroup_access(helm):
    res = helm(*template_args(None, "--set", "orchestrator.liveGroups=false"))
    assert res.returncode == 0, res.stderr
    args = one(res.docs, "Deployment", f"{FULLNAME}-orchestrator")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--ray-service" not in args
    (role,) = by_kind(res.docs, "Role")
    assert all("ray.io" not in rule["apiGroups"] for rule in role["rules"])
    # no launcher, no ExpertGroup controller: the objects would never act
    assert all(not r.startswith("expertgroups") for rule in role["rules"] for r in rule["resources"])


def test_placement_configmap_from_values(render):
    for name in ("gpu-2x8", "cpu-only", "defaults"):
        docs = render(name)
        cm = one(docs, "ConfigMap", f"{FULLNAME}-placement")
        placement = yaml.safe_load(cm["data"]["placement.yaml"])
        want = {
            g["name"]: {str(k): v for k, v in g["experts"].items()} for g in values_of(name)["expertGroups"]["groups"]
        }
        assert placement == {"groups": want}
        assert {g: a["args"]["placement"]["groups"][g] for g, a in serve_apps(docs).items()} == want
        vols = one(docs, "Deployment", f"{FULLNAME}-orchestrator")["spec"]["template"]["spec"]["volumes"]
        assert {"name": "placement", "configMap": {"name": cm["metadata"]["name"]}} in vols


# -- expert groups: RayService --------------------------------------------------------------


@pytest.mark.parametrize("name", SETS)
def test_serve_config_one_application_per_group(render, name):
    """Every group is a Serve application of its own, the shape the orchestrator's launcher gives a group added
    live (``group_app``), so one removed live leaves the others' code versions, and replicas, as they were."""
    from ray.serve._private.deploy_utils import get_app_code_version
    from ray.serve.schema import ServeDeploySchema

    from expertmesh.expert_group.deployment import GroupsAppArgs, build_app
    from expertmesh.orchestrator.kube.groups import fixed_groups, group_app, serve_config_change, stop_refusal

    docs = render(name)
    values = values_of(name)
    text = rayservice(docs)["spec"]["serveConfigV2"]
    cfg, errors = check_serve_config(text)
    assert errors == []
    apps = serve_apps(docs)
    groups = sorted(g["name"] for g in values["expertGroups"]["groups"])
    assert sorted(apps) == groups and len(cfg["applications"]) == len(groups)
    args = shared_args(docs)
    assert args["host"] == "0.0.0.0" and args["port_base"] == values["expertGroups"]["portBase"]
    assert args["model"] == values["model"]["path"] and args["dtype"] == values["model"]["dtype"]
    assert (
        args["state_url"]
        == env_of(one(docs, "Deployment", f"{FULLNAME}-router")["spec"]["template"]["spec"]["containers"][0])[
            "EXPERTMESH_STATE_URL"
        ]["value"]
    )
    experts = {g["name"]: {str(k): v for k, v in g["experts"].items()} for g in values["expertGroups"]["groups"]}
    by_name = {g["name"]: g for g in values["expertGroups"]["groups"]}
    gpu = values["mode"] == "gpu"
    for i, g in enumerate(groups):
        app = apps[g]
        assert app["name"] == f"expertmesh-group-{g}" and app["route_prefix"] is None
        # what Ray Serve does with it (ray.serve's import_attr): the module imports and names the builder
        module, attribute = app["import_path"].split(":")
        assert getattr(importlib.import_module(module), attribute) is build_app
        GroupsAppArgs.model_validate(app["args"])
        # Group i (name order) keeps port_base + i, as before one application per group: NetworkPolicies and
        # dialled addresses stay.
        assert app["args"]["ports"] == {g: args["port_base"] + i}
        gpus = by_name[g].get("gpus", values["expertGroups"]["gpusPerGroup"]) if gpu else 0
        island = by_name[g].get("island", "")
        assert app == group_app(g, args, port=args["port_base"] + i, gpus=gpus, island=island, experts=experts[g])
        assert [d["name"] for d in app["deployments"]] == ["directory", f"group-{g}"]
        assert app["deployments"][0]["ray_actor_options"]["num_cpus"] == 0
    # Group i listens on port_base + i (i in name order): the NetworkPolicy range covers them all.
    np_ = one(docs, "NetworkPolicy", f"{FULLNAME}-expert-groups")
    ranges = [p for rule in np_["spec"]["ingress"] for p in rule.get("ports", []) if "endPort" in p]
    (rng,) = ranges
    assert rng["port"] == args["port_base"] and rng["endPort"] >= args["port_base"] + len(groups) - 1
    # Any of them is removed live (the last one stays); the others' code versions, Ray's own hash, stay.
    assert fixed_groups(cfg) == set(groups)
    versions = {a.name: get_app_code_version(a) for a in ServeDeploySchema.model_validate(cfg).applications}
    if len(groups) > 1:
        assert stop_refusal(cfg, groups[0]) is None
        after = ServeDeploySchema.model_validate(serve_config_change(cfg, remove=groups[0]))
        assert {a.name: get_app_code_version(a) for a in after.applications} == {
            n: v for n, v in versions.items() if n != f"expertmesh-group-{groups[0]}"
        }
    else:
        assert "last expert group" in stop_refusal(cfg, groups[0])


def test_gpu_placement_lands_each_group_on_its_node_and_island(render):
    """Each group's Serve deployment requests the custom resource of its island, which exactly
    one Ray worker group declares, and that worker group's pod is pinned to the group's node
    (kubernetes.io/hostname) and the island's clique and GPU product, with enough GPUs."""
    docs = render("gpu-2x8")
    values = values_of("gpu-2x8")
    islands = {i["name"]: i for i in values["expertGroups"]["islands"]}
    rs = rayservice(docs)
    workers = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    provides = {}
    for wg in workers:
        for res, amount in parse_start_resources(wg["rayStartParams"].get("resources", "{}")).items():
            assert res not in provides, f"{res} declared by two worker groups"
            provides[res] = (wg, amount)
    deps = {d["name"]: d for app in serve_apps(docs).values() for d in app["deployments"]}
    gpus_used: dict[str, int] = {}
    assert len(values["expertGroups"]["groups"]) == 8
    for group in values["expertGroups"]["groups"]:
        dep = deps[f"group-{group['name']}"]
        opts = dep["ray_actor_options"]
        gpus = group.get("gpus", values["expertGroups"]["gpusPerGroup"])
        assert opts["num_gpus"] == gpus == 2
        (res,) = opts["resources"]
        assert res == f"expertmesh.io/island-{group['island']}"
        wg, capacity = provides[res]
        assert capacity >= 1
        tpl = wg["template"]["spec"]
        island = islands[group["island"]]
        assert tpl["nodeSelector"]["kubernetes.io/hostname"] == group["node"] == island["node"]
        assert tpl["nodeSelector"]["nvidia.com/gpu.clique"] == island["clique"]
        assert tpl["nodeSelector"]["nvidia.com/gpu.product"] == island["gpuProduct"]
        assert wg["template"]["metadata"]["labels"]["expertmesh.io/island"] == group["island"]
        assert wg["replicas"] == wg["minReplicas"] == wg["maxReplicas"] == 1, "one pod = one island"
        limits = tpl["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == island["gpus"]
        # The placement group packs the replica's CPUs, GPUs and island token on one Ray node.
        (bundle,) = dep["placement_group_bundles"]
        assert dep["placement_group_strategy"] == "STRICT_PACK"
        assert bundle == {"CPU": opts["num_cpus"], "GPU": gpus, res: 1}
        gpus_used[wg["groupName"]] = gpus_used.get(wg["groupName"], 0) + gpus
        # The serveConfigV2 args carry the same per-group resources.
        assert serve_apps(docs)[group["name"]]["args"]["resources"] == {group["name"]: {res: 1}}
    # 2 nodes x 2 islands, each island's 4 GPUs filled by its 2 groups.
    assert len(workers) == 4
    assert (
        {
            wg["groupName"]: wg["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
            for wg in workers
        }
        == gpus_used
        == {f"island-{n}": 4 for n in islands}
    )
    nodes = {wg["template"]["spec"]["nodeSelector"]["kubernetes.io/hostname"] for wg in workers}
    assert nodes == {"gpu-node-0", "gpu-node-1"}


@pytest.mark.parametrize("name", ["defaults", "gpu-2x8"])
def test_gpu_workers_request_gpus_tolerate_taints_and_select_gpu_nodes(render, name):
    for wg in rayservice(render(name))["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        spec = wg["template"]["spec"]
        res = spec["containers"][0]["resources"]
        assert (
            res["limits"]["nvidia.com/gpu"] >= 1
            and res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"]
        )
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]} in terms[0]["matchExpressions"]
        assert spec["containers"][0]["image"].endswith("-cuda")
    head = rayservice(render(name))["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0", "no expert group on the head"
    assert "nvidia.com/gpu" not in str(head["template"])


def test_cpu_only_has_no_gpu_anything(render):
    docs = render("cpu-only")
    assert "nvidia.com" not in json.dumps(docs), "no GPU request, selector, affinity or toleration"
    for app in serve_apps(docs).values():
        assert app["args"]["num_gpus"] == 0
        for d in app["deployments"]:
            assert "num_gpus" not in d["ray_actor_options"]
            assert "GPU" not in str(d.get("placement_group_bundles", ""))
    workers = {wg["groupName"]: wg for wg in rayservice(docs)["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert set(workers) == {"island-local-a", "workers"}
    assert workers["workers"]["replicas"] == 2
    assert workers["island-local-a"]["template"]["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "kind-worker"}
    for wg in workers.values():
        assert "tolerations" not in wg["template"]["spec"] and "affinity" not in wg["template"]["spec"]
        assert not wg["template"]["spec"]["containers"][0]["image"].endswith("-cuda")


# -- Redis -----------------------------------------------------------------------------------


def test_bundled_redis_statefulset_with_pvc(render):
    docs = render("defaults")
    sts = one(docs, "StatefulSet", f"{FULLNAME}-redis")
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data" and claim["spec"]["resources"]["requests"]["storage"] == "2Gi"
    assert sts["spec"]["replicas"] == 1
    one(docs, "Service", f"{FULLNAME}-redis")
    url = shared_args(docs)["state_url"]
    assert url == f"rediss://{FULLNAME}-redis:6379/0"
    # cpu-only: same Redis on an emptyDir.
    sts = one(render("cpu-only"), "StatefulSet", f"{FULLNAME}-redis")
    assert "volumeClaimTemplates" not in sts["spec"]
    assert {"name": "data", "emptyDir": {}} in sts["spec"]["template"]["spec"]["volumes"]


def test_external_redis_tls_password_from_secret(render):
    docs = render("external-redis-tls")
    assert by_kind(docs, "StatefulSet") == []
    assert not [d for d in docs if d["metadata"]["name"].endswith("-redis")]
    url = "rediss://redis.data.svc.cluster.local:6380/0"
    assert shared_args(docs)["state_url"] == url
    for where, tpl in pod_templates(docs):
        c = tpl["spec"]["containers"][0]
        env = env_of(c)
        assert env["EXPERTMESH_STATE_URL"]["value"] == url, where
        assert "EXPERTMESH_REDIS_PASSWORD" not in env and "EXPERTMESH_REDIS_USERNAME" not in env, where
        assert env["EXPERTMESH_REDIS_PASSWORD_FILE"]["value"] == "/etc/expertmesh-redis/password", where
        auth = next(v for v in tpl["spec"]["volumes"] if v["name"] == "redis-auth")["secret"]
        assert auth["secretName"] == "expertmesh-redis", where
        assert auth["items"] == [{"key": "redis-password", "path": "password"}], where
        ca = env["EXPERTMESH_REDIS_CA_FILE"]["value"]
        mount = next(m for m in c["volumeMounts"] if m["name"] == "redis-tls")
        assert ca.startswith(mount["mountPath"] + "/") and mount["readOnly"] is True
        vol = next(v for v in tpl["spec"]["volumes"] if v["name"] == "redis-tls")
        assert vol["secret"]["secretName"] == "expertmesh-redis-ca"


# -- Control loops and routing settings ---------------------------------------------------------


def test_loop_and_routing_values_render_into_the_settings_the_code_reads(helm, monkeypatch, tmp_path):
    from expertmesh.config.settings import DataPlaneConfig, ServingConfig
    from expertmesh.orchestrator.capacity.config import CapacityConfig
    from expertmesh.orchestrator.drift.config import DriftConfig
    from expertmesh.orchestrator.health.config import HealthConfig

    profiles = '[{"domain": "code", "moe_layers": [0], "choices": [[1]], "share": [[1.0]], "lift": [[1.0]]}]'
    (tmp_path / "profiles.json").write_text(profiles)
    res = helm(
        *template_args(None),
        "--set",
        "orchestrator.drift.enabled=true",
        "--set",
        "orchestrator.drift.settings.scan_interval_s=120",
        "--set",
        "orchestrator.drift.settings.dry_run=true",
        "--set",
        "orchestrator.healthMonitor.enabled=true",
        "--set",
        "orchestrator.healthMonitor.settings.kl_suspect=0.02",
        "--set",
        "orchestrator.capacity.enabled=true",
        "--set",
        "orchestrator.capacity.settings.replicate_below=0.8",
        "--set",
        "router.routingPolicy=restrict+delta_gap",
        "--set",
        "router.hiddenSampleTokens=256",
        "--set-file",
        f"router.profiles={tmp_path / 'profiles.json'}",
    )
    assert res.returncode == 0, res.stderr
    docs = res.docs
    orchestrator = one(docs, "Deployment", f"{FULLNAME}-orchestrator")["spec"]["template"]["spec"]["containers"][0]
    router_pod = one(docs, "Deployment", f"{FULLNAME}-router")["spec"]["template"]["spec"]
    router = router_pod["containers"][0]
    env = {
        **{k: v["value"] for k, v in env_of(orchestrator).items() if "value" in v},
        **{k: v["value"] for k, v in env_of(router).items() if "value" in v},
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    drift, health = DriftConfig(), HealthConfig()  # what the orchestrator reads from that environment
    assert (drift.enabled, drift.scan_interval_s, drift.dry_run) == (True, 120.0, True)
    assert (health.enabled, health.kl_suspect) == (True, 0.02)
    capacity = CapacityConfig()
    assert (capacity.enabled, capacity.replicate_below) == (True, 0.8)
    assert ServingConfig().routing_policy == "restrict+delta_gap"
    assert DataPlaneConfig(model="/m").hidden_sample_tokens == 256
    assert env["EXPERTMESH_PROFILES"] == "/etc/expertmesh/profiles/profiles.json"
    configmap = one(docs, "ConfigMap", f"{FULLNAME}-profiles")
    assert json.loads(configmap["data"]["profiles.json"]) == json.loads(profiles)
    assert {"name": "profiles", "configMap": {"name": f"{FULLNAME}-profiles"}} in router_pod["volumes"]
    # off by default: the loops say so, no profiles anywhere
    defaults = helm(*template_args(None)).docs
    assert not [d for d in defaults if d["metadata"]["name"].endswith("-profiles")]
    default_env = env_of(
        one(defaults, "Deployment", f"{FULLNAME}-orchestrator")["spec"]["template"]["spec"]["containers"][0]
    )
    assert (
        default_env["EXPERTMESH_DRIFT_ENABLED"]["value"] == "false"
        and default_env["EXPERTMESH_HEALTH_ENABLED"]["value"] == "false"
        and default_env["EXPERTMESH_CAPACITY_ENABLED"]["value"] == "false"
    )


def test_default_routing_policies_with_parameters_and_per_domain_render_into_the_serving_config(
    helm, monkeypatch, tmp_path
):
    from expertmesh.config.settings import ServingConfig, read_config_file

    values = tmp_path / "values.yaml"
    values.write_text(
        "router:\n"
        "  routingPolicy: restrict+delta_gap(top_n=4,delta=0.2)\n"
        "  domainRoutingPolicies:\n"
        "    legal: restrict(top_n=4)\n"
        "    code/python: confidence_k(k_max=3)\n"
    )
    res = helm(*template_args(values))
    assert res.returncode == 0, res.stderr
    router = one(res.docs, "Deployment", f"{FULLNAME}-router")["spec"]["template"]["spec"]["containers"][0]
    env = {k: v["value"] for k, v in env_of(router).items() if "value" in v}
    assert env["EXPERTMESH_DOMAIN_ROUTING_POLICIES"] == "code/python=confidence_k(k_max=3);legal=restrict(top_n=4)"
    for name in ("EXPERTMESH_ROUTING_POLICY", "EXPERTMESH_DOMAIN_ROUTING_POLICIES"):
        monkeypatch.setenv(name, env[name])
    config = ServingConfig()  # what the router reads from that environment
    assert config.routing_policy == "restrict+delta_gap(top_n=4,delta=0.2)"
    assert config.domain_routing_policies == {"legal": "restrict(top_n=4)", "code/python": "confidence_k(k_max=3)"}
    # the same values file as a --config file gives the same settings
    monkeypatch.delenv("EXPERTMESH_ROUTING_POLICY")
    monkeypatch.delenv("EXPERTMESH_DOMAIN_ROUTING_POLICIES")
    file = read_config_file(values)
    assert file.values["domain_routing_policies"] == config.domain_routing_policies
    assert file.keys["routing_policy"] == "router.routingPolicy"
    assert "EXPERTMESH_DOMAIN_ROUTING_POLICIES" not in env_of(
        one(helm(*template_args(None)).docs, "Deployment", f"{FULLNAME}-router")["spec"]["template"]["spec"][
            "containers"
        ][0]
    )
    for bad in ("router.routingPolicy=delta_gap(delta=x)", "router.domainRoutingPolicies.legal=bad policy"):
        assert helm(*template_args(None), "--set", bad).returncode != 0, bad


def test_the_anomaly_action_renders_into_the_serving_config(helm, monkeypatch, tmp_path):
    from expertmesh.config.settings import ServingConfig, read_config_file

    values = tmp_path / "values.yaml"
    values.write_text("router:\n  anomalyAction: exact_routing\n  anomalySigma: 4.5\n")
    res = helm(*template_args(values))
    assert res.returncode == 0, res.stderr
    router = one(res.docs, "Deployment", f"{FULLNAME}-router")["spec"]["template"]["spec"]["containers"][0]
    env = {k: v["value"] for k, v in env_of(router).items() if "value" in v}
    for name in ("EXPERTMESH_ANOMALY_ACTION", "EXPERTMESH_ANOMALY_SIGMA"):
        monkeypatch.setenv(name, env[name])
    config = ServingConfig()  # what the router reads from that environment
    assert (config.anomaly_action, config.anomaly_sigma) == ("exact_routing", 4.5)
    assert read_config_file(values).values["anomaly_action"] == "exact_routing"
    defaults = env_of(
        one(helm(*template_args(None)).docs, "Deployment", f"{FULLNAME}-router")["spec"]["template"]["spec"][
            "containers"
        ][0]
    )
    assert defaults["EXPERTMESH_ANOMALY_ACTION"]["value"] == "none"
    for bad in ("router.anomalyAction=circuit_break", "router.anomalySigma=0"):
        assert helm(*template_args(None), "--set", bad).returncode != 0, bad


def test_loop_settings_are_the_config_fields_and_nothing_else(helm):
    from expertmesh.orchestrator.capacity.config import CapacityConfig
    from expertmesh.orchestrator.drift.config import DriftConfig
    from expertmesh.orchestrator.health.config import HealthConfig

    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["orchestrator"]["properties"]
    for key, cls in (("drift", DriftConfig), ("healthMonitor", HealthConfig), ("capacity", CapacityConfig)):
        names = schema[key]["properties"]["settings"]["propertyNames"]["enum"]
        assert set(names) == set(cls.model_fields) - {"enabled"}, key
    bad = helm(*template_args(None), "--set", "orchestrator.drift.settings.scan_every=5")
    assert bad.returncode != 0 and "scan_every" in bad.stderr


# -- Alerts -----------------------------------------------------------------------------------


def test_alert_rules_render_as_a_prometheus_rule_only_when_asked(helm, render):
    assert not by_kind(render("defaults"), "PrometheusRule")
    docs = render_with(helm, "monitoring.alerts.enabled=true", "monitoring.alerts.labels.release=kube-prometheus")
    rule = one(docs, "PrometheusRule", f"{FULLNAME}-alerts")
    assert (
        rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["metadata"]["labels"]["release"] == "kube-prometheus"
    )
    # the same rules as the plain-Prometheus file, word for word (their {{ $labels }} templates untouched by Helm)
    assert rule["spec"] == yaml.safe_load((CHART / "files" / "expertmesh-alerts.yaml").read_text())
    alerts = [r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert len(alerts) == 14 and "{{ $labels.layer }}" in json.dumps(rule["spec"])


# -- OpenTelemetry -----------------------------------------------------------------------------


def test_otel_environment(render):
    docs = render("external-redis-tls")
    names = set()
    for where, tpl in pod_templates(docs):
        env = env_of(tpl["spec"]["containers"][0])
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "https://otlp.example.com:4317", where
        assert env["OTEL_EXPORTER_OTLP_HEADERS"]["valueFrom"]["secretKeyRef"] == {
            "name": "expertmesh-otlp",
            "key": "headers",
        }
        assert env["OTEL_TRACES_SAMPLER"]["value"] == "parentbased_traceidratio"
        assert float(env["OTEL_TRACES_SAMPLER_ARG"]["value"]) == 0.25
        assert "deployment.environment=prod" in env["OTEL_RESOURCE_ATTRIBUTES"]["value"]
        names.add(env["OTEL_SERVICE_NAME"]["value"])
    assert names == {"expertmesh-router", "expertmesh-orchestrator", "expertmesh-expert-group"}
    for where, tpl in pod_templates(render("defaults")):
        if "redis" in where:
            continue
        env = env_of(tpl["spec"]["containers"][0])
        assert env["OTEL_SDK_DISABLED"]["value"] == "true" and "OTEL_EXPORTER_OTLP_ENDPOINT" not in env


# -- NetworkPolicies -------------------------------------------------------------------------


def _policies_for(docs, labels):
    return [np_ for np_ in by_kind(docs, "NetworkPolicy") if selects(np_["spec"]["podSelector"], labels)]


def _allowed(docs, src_labels, dst_labels, port) -> bool:
    """Whether some ingress rule of a policy selecting dst admits src on port (same namespace)."""
    for np_ in _policies_for(docs, dst_labels):
        for rule in np_["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(p["port"] <= port <= p.get("endPort", p["port"]) for p in ports):
                continue
            peers = rule.get("from")
            if peers is None or any(
                "namespaceSelector" not in p and "podSelector" in p and selects(p["podSelector"], src_labels)
                for p in peers
            ):
                return True
    return False


@pytest.mark.parametrize("name", SETS)
def test_network_policies(render, name):
    docs = render(name)
    labels = {}
    for where, tpl in pod_templates(docs):
        comp = tpl["metadata"]["labels"]["app.kubernetes.io/component"]
        labels.setdefault(comp, tpl["metadata"]["labels"])
        assert _policies_for(docs, tpl["metadata"]["labels"]), f"{where} is selected by no NetworkPolicy"
    router, orch, groups = labels["router"], labels["orchestrator"], labels["expert-group"]
    stranger = {"app.kubernetes.io/name": "other", "app.kubernetes.io/instance": "other"}
    admin = {"expertmesh.io/admin": "true"}
    base = values_of(name)["expertGroups"]["portBase"]
    # Only the router (and the orchestrator, whose LoadExperts calls share the port) reaches group gRPC ports.
    assert _allowed(docs, router, groups, base) and _allowed(docs, router, groups, base + 7)
    assert _allowed(docs, orch, groups, base)
    assert not _allowed(docs, stranger, groups, base) and not _allowed(docs, admin, groups, base)
    # Ray internals stay between Ray pods; admin surfaces only from the orchestrator and admins.
    assert _allowed(docs, groups, groups, 6379)
    assert not _allowed(docs, router, groups, 6379) and not _allowed(docs, stranger, groups, 8265)
    assert _allowed(docs, orch, groups, 8265) and _allowed(docs, admin, groups, 8265)
    assert not _allowed(docs, router, groups, 8265)
    # The KubeRay operator reaches the dashboard from its own namespace only, never "any pod so labelled anywhere".
    groups_np = one(docs, "NetworkPolicy", f"{FULLNAME}-expert-groups")
    operator = [
        p
        for rule in groups_np["spec"]["ingress"]
        for p in rule.get("from", ())
        if p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/name") == "kuberay-operator"
    ]
    assert operator and all(
        p["namespaceSelector"].get("matchLabels", {}).get("kubernetes.io/metadata.name") for p in operator
    )
    head = rayservice(docs)["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    assert head["dashboard-host"] == values_of(name)["expertGroups"]["head"]["dashboardHost"]
    # Orchestrator admin API: admins only.
    assert _allowed(docs, admin, orch, 50052)
    assert not _allowed(docs, router, orch, 50052) and not _allowed(docs, stranger, orch, 50052)
    # Router gRPC: clients (anyone unless clientFrom is set); nothing else on the router.
    assert _allowed(docs, stranger, router, 50051) == (not values_of(name)["networkPolicy"]["clientFrom"])
    assert not _allowed(docs, stranger, router, 8080)
    if "redis" in labels:
        redis = labels["redis"]
        for comp in ("router", "orchestrator", "expert-group"):
            assert _allowed(docs, labels[comp], redis, 6379), comp
        assert not _allowed(docs, stranger, redis, 6379)


# -- Security: Redis password, gRPC TLS, admin token, egress --------------------------------------

TLS_DIR = "/etc/expertmesh-tls/grpc"
TLS_ENV = {
    "EXPERTMESH_TLS_CERT_FILE": "tls.crt",
    "EXPERTMESH_TLS_KEY_FILE": "tls.key",
    "EXPERTMESH_TLS_CA_FILE": "ca.crt",
}


def render_with(helm, *sets: str) -> list[dict]:
    args = template_args(None)
    for s in sets:
        args += ["--set", s]
    res = helm(*args)
    assert res.returncode == 0, res.stderr
    return res.docs


def platform_pods(docs):
    """(where, component, first container, pod spec) of every expertmesh pod (not Redis)."""
    for where, tpl in pod_templates(docs):
        component = tpl["metadata"]["labels"]["app.kubernetes.io/component"]
        if component != "redis":
            yield where, component, tpl["spec"]["containers"][0], tpl["spec"]


def test_bundled_redis_has_a_user_per_component_and_no_password_on_a_command_line(helm, render):
    """Issue 39: every component had the one Redis password, given on redis-server's command line. Now each
    has a user of its own whose rights `expertmesh store acl` derives from the store's key layout (written by
    an init container from the mounted Secret), and each pod mounts its own password as a file."""
    from expertmesh.store.access import Role

    docs = render("defaults")
    secret = one(docs, "Secret", f"{FULLNAME}-redis-auth")
    assert secret["type"] == "Opaque" and set(secret["data"]) == {r.value for r in Role}
    assert {len(base64.b64decode(v)) for v in secret["data"].values()} == {40}
    assert len(set(secret["data"].values())) == 3, "a password per user"
    pod = one(docs, "StatefulSet", f"{FULLNAME}-redis")["spec"]["template"]["spec"]
    (acl,) = pod["initContainers"]
    assert acl["command"] == ["expertmesh"] and acl["args"][1:3] == ["store", "acl"]
    assert acl["args"][acl["args"].index("--password-dir") + 1] == "/etc/expertmesh-redis/users"
    acl_file = acl["args"][acl["args"].index("--out") + 1]
    users = next(v for v in pod["volumes"] if v["name"] == "users")["secret"]
    assert users["secretName"] == f"{FULLNAME}-redis-auth"
    assert [i["key"] for i in users["items"]] == [i["path"] for i in users["items"]] == [r.value for r in Role]
    (redis,) = pod["containers"]
    assert f"--aclfile {acl_file}" in redis["args"][0]
    assert "requirepass" not in redis["args"][0] and "PASSWORD" not in redis["args"][0]
    probe = " ".join(redis["readinessProbe"]["exec"]["command"])
    assert "REDISCLI_AUTH=" in probe and " -a " not in probe, "the probe's password stays off its command line"
    assert not [e for e in redis.get("env", []) if "valueFrom" in e], "no password in the environment"
    for where, component, c, spec in platform_pods(docs):
        env = env_of(c)
        assert env["EXPERTMESH_REDIS_USERNAME"]["value"] == component == Role(component).value, where
        assert env["EXPERTMESH_REDIS_PASSWORD_FILE"]["value"] == "/etc/expertmesh-redis/password", where
        assert not [e for e in c["env"] if e["name"].startswith("EXPERTMESH_REDIS") and "valueFrom" in e], where
        volume = next(v for v in spec["volumes"] if v["name"] == "redis-auth")["secret"]
        assert volume["secretName"] == f"{FULLNAME}-redis-auth", where
        assert volume["items"] == [{"key": component, "path": "password"}], f"{where}: its own password alone"
        assert volume["defaultMode"] == 0o440, where
        assert {"name": "redis-auth", "mountPath": "/etc/expertmesh-redis", "readOnly": True} in c["volumeMounts"]
    # The Secret is looked up before it is generated, so upgrades keep the passwords.
    template = (CHART / "templates" / "secrets.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $name' in template and "randAlphaNum" in template
    # An existing Secret replaces the generated one; an external Redis brings its own.
    mine = render_with(helm, "redis.auth.existingSecret=mine")
    assert not [d for d in mine if d["metadata"]["name"].endswith("-redis-auth")]
    for where, _, _, spec in platform_pods(mine):
        assert next(v for v in spec["volumes"] if v["name"] == "redis-auth")["secret"]["secretName"] == "mine", where
    assert not [d for d in render("external-redis-tls") if d["metadata"]["name"].endswith("-redis-auth")]


def test_bundled_redis_tls_is_a_value(helm, render):
    """On by default: Redis serves TLS only, with a certificate for its Service from a CA of its own, which every
    component verifies (rediss://, EXPERTMESH_REDIS_CA_FILE); off: plaintext on 6379; or a Secret of yours."""
    from cryptography import x509

    docs = render("defaults")
    secret = one(docs, "Secret", f"{FULLNAME}-redis-tls")
    assert secret["type"] == "kubernetes.io/tls" and set(secret["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert f"{FULLNAME}-redis" in names and f"{FULLNAME}-redis.{NAMESPACE}.svc.cluster.local" in names
    pod = one(docs, "StatefulSet", f"{FULLNAME}-redis")["spec"]["template"]["spec"]
    (redis,) = pod["containers"]
    assert (
        "--port 0 --tls-port 6379" in redis["args"][0] and "--tls-cert-file /etc/redis-tls/tls.crt" in redis["args"][0]
    )
    assert "--tls --cacert /etc/redis-tls/ca.crt" in " ".join(redis["readinessProbe"]["exec"]["command"])
    assert next(v for v in pod["volumes"] if v["name"] == "tls")["secret"]["secretName"] == f"{FULLNAME}-redis-tls"
    for where, _, c, spec in platform_pods(docs):
        env = env_of(c)
        assert env["EXPERTMESH_STATE_URL"]["value"] == f"rediss://{FULLNAME}-redis:6379/0", where
        assert env["EXPERTMESH_REDIS_CA_FILE"]["value"] == "/etc/expertmesh-tls/redis/ca.crt", where
        ca = next(v for v in spec["volumes"] if v["name"] == "redis-tls")["secret"]
        assert ca["secretName"] == f"{FULLNAME}-redis-tls", where
        assert ca["items"] == [{"key": "ca.crt", "path": "ca.crt"}], f"{where}: the CA only, not the key"

    plain = render_with(helm, "redis.tls.enabled=false")
    assert not [d for d in plain if d["metadata"]["name"].endswith("-redis-tls")]
    (redis,) = one(plain, "StatefulSet", f"{FULLNAME}-redis")["spec"]["template"]["spec"]["containers"]
    assert "--port 6379" in redis["args"][0] and "tls" not in redis["args"][0]
    for where, _, c, spec in platform_pods(plain):
        assert env_of(c)["EXPERTMESH_STATE_URL"]["value"] == f"redis://{FULLNAME}-redis:6379/0", where
        assert "EXPERTMESH_REDIS_CA_FILE" not in env_of(c) and "redis-tls" not in {v["name"] for v in spec["volumes"]}

    mine = render_with(helm, "redis.tls.existingSecret=my-redis-tls")
    assert not [d for d in mine if d["metadata"]["name"].endswith("-redis-tls")]
    for where, _, _, spec in platform_pods(mine):
        assert next(v for v in spec["volumes"] if v["name"] == "redis-tls")["secret"]["secretName"] == "my-redis-tls"


def test_an_external_redis_with_a_user_per_component(helm):
    args = template_args(VALUE_SETS["external-redis-tls"], "--set", "redis.external.users=true")
    res = helm(*args)
    assert res.returncode == 0, res.stderr
    for where, component, c, spec in platform_pods(res.docs):
        assert env_of(c)["EXPERTMESH_REDIS_USERNAME"]["value"] == component, where
        volume = next(v for v in spec["volumes"] if v["name"] == "redis-auth")["secret"]
        assert volume == {
            "secretName": "expertmesh-redis",
            "items": [{"key": component, "path": "password"}],
            "defaultMode": 0o440,
        }, where
    refused = helm(
        *template_args(None, "--set", "redis.external.url=redis://r:6379/0", "--set", "redis.external.users=true")
    )
    assert refused.returncode != 0 and "redis.external.users: name the Secret" in refused.stderr


@pytest.mark.parametrize("name", SETS)
def test_grpc_tls_is_on_by_default(render, name):
    """Every expertmesh pod mounts its component's certificate Secret and points EXPERTMESH_TLS_* at it;
    routers and the orchestrator verify the name the expert groups' certificate carries."""
    docs = render(name)
    secrets = {d["metadata"]["name"]: d for d in by_kind(docs, "Secret")}
    for where, component, c, spec in platform_pods(docs):
        env = env_of(c)
        for var, key in TLS_ENV.items():
            assert env[var]["value"] == f"{TLS_DIR}/{key}", (where, var)
        assert {"name": "grpc-tls", "mountPath": TLS_DIR, "readOnly": True} in c["volumeMounts"], where
        (vol,) = [v for v in spec["volumes"] if v["name"] == "grpc-tls"]
        assert vol["secret"]["defaultMode"] == 0o440, where
        secret = secrets[vol["secret"]["secretName"]]
        assert secret["metadata"]["name"] == f"{FULLNAME}-tls-{component}", where
        assert secret["type"] == "kubernetes.io/tls" and set(secret["data"]) == {"tls.crt", "tls.key", "ca.crt"}
        if component == "expert-group":
            assert "EXPERTMESH_TLS_GROUP_SERVER_NAME" not in env, "groups dial no groups"
        else:
            assert env["EXPERTMESH_TLS_GROUP_SERVER_NAME"]["value"] == f"{FULLNAME}-groups", where
        assert "EXPERTMESH_TLS_REQUIRE_CLIENT_CERT" not in env, where
    assert one(docs, "Secret", f"{FULLNAME}-tls-ca")["type"] == "kubernetes.io/tls"


def test_tls_disabled_renders_no_certificates(helm):
    docs = render_with(helm, "tls.enabled=false")
    assert not [d for d in by_kind(docs, "Secret") if "-tls-" in d["metadata"]["name"]]
    for where, component, c, spec in platform_pods(docs):
        assert not [k for k in env_of(c) if k.startswith("EXPERTMESH_TLS_")], where
        assert "grpc-tls" not in {v["name"] for v in spec["volumes"]}, where
        assert "--health-port" not in c.get("args", []), where
    router = one(docs, "Deployment", f"{FULLNAME}-router")["spec"]["template"]["spec"]["containers"][0]
    assert router["readinessProbe"]["grpc"] == {"port": 50051}


def test_tls_from_existing_secrets_as_cert_manager_writes_them(helm):
    docs = render_with(
        helm,
        "tls.routerSecret=cm-router",
        "tls.orchestratorSecret=cm-orch",
        "tls.expertGroupsSecret=cm-groups",
        "tls.groupServerName=groups.example.internal",
        "tls.requireClientCert=true",
    )
    assert not [d for d in by_kind(docs, "Secret") if "-tls-" in d["metadata"]["name"]]
    want = {"router": "cm-router", "orchestrator": "cm-orch", "expert-group": "cm-groups"}
    for where, component, c, spec in platform_pods(docs):
        (vol,) = [v for v in spec["volumes"] if v["name"] == "grpc-tls"]
        assert vol["secret"]["secretName"] == want[component], where
        env = env_of(c)
        if component != "expert-group":
            assert env["EXPERTMESH_TLS_GROUP_SERVER_NAME"]["value"] == "groups.example.internal"
            assert env["EXPERTMESH_TLS_REQUIRE_CLIENT_CERT"]["value"] == "true"
        # Only the generated orchestrator certificate is an admin CN by default.
        assert "EXPERTMESH_ADMIN_ALLOWED_CNS" not in env, where
    res = helm(*template_args(None, "--set", "tls.routerSecret=cm-router"))
    assert res.returncode != 0 and "set routerSecret, orchestratorSecret and expertGroupsSecret together" in res.stderr


def test_admin_token_reaches_the_servers_that_check_it_and_the_orchestrator(helm, render):
    docs = render("defaults")
    secret = one(docs, "Secret", f"{FULLNAME}-admin-token")
    assert len(base64.b64decode(secret["data"]["token"])) == 48
    seen = set()
    for where, component, c, _ in platform_pods(docs):
        env = env_of(c)
        if component == "router":
            assert "EXPERTMESH_ADMIN_TOKEN" not in env, "the router makes no admin calls"
            continue
        seen.add(component)
        assert env["EXPERTMESH_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": f"{FULLNAME}-admin-token",
            "key": "token",
        }
        assert env["EXPERTMESH_ADMIN_ALLOWED_CNS"]["value"] == f"{FULLNAME}-orchestrator", where
    assert seen == {"orchestrator", "expert-group"}
    docs = render_with(helm, "auth.existingSecret=admins", "auth.tokenKey=t", "auth.adminCommonNames={ops,ci}")
    assert not [d for d in docs if d["metadata"]["name"].endswith("-admin-token")]
    (orch,) = [c for _, component, c, _ in platform_pods(docs) if component == "orchestrator"]
    assert env_of(orch)["EXPERTMESH_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "admins", "key": "t"}
    assert env_of(orch)["EXPERTMESH_ADMIN_ALLOWED_CNS"]["value"] == f"ops,ci,{FULLNAME}-orchestrator"


def test_generated_certificates_complete_mutual_tls_with_expertmesh(render, tmp_path):
    """Real: the chart's generated Secrets, written to files, drive expertmesh's own TLS code: a group
    server with mutual TLS and the admin CNs the chart sets; the router's certificate reaches it
    by the name the chart gives routers, and is no admin; the orchestrator's certificate is."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from expertmesh.config.settings import AdminAuthConfig, TlsConfig
    from expertmesh.infra.group_channels import group_channel
    from expertmesh.infra.grpc_server import GrpcServer
    from expertmesh.v1 import admin_pb2, admin_pb2_grpc

    docs = render("defaults")
    pods = {component: env_of(c) for _, component, c, _ in platform_pods(docs)}

    def files(component: str) -> dict[str, str]:
        secret = one(docs, "Secret", f"{FULLNAME}-tls-{component}")
        out = {}
        for key, field in (("tls.crt", "cert_file"), ("tls.key", "key_file"), ("ca.crt", "ca_file")):
            path = tmp_path / f"{component}-{key}"
            path.write_bytes(base64.b64decode(secret["data"][key]))
            out[field] = str(path)
        return out

    admin = AdminAuthConfig(allowed_cns=pods["expert-group"]["EXPERTMESH_ADMIN_ALLOWED_CNS"]["value"])
    server = GrpcServer(
        "chart-tls", "127.0.0.1", 0, tls=TlsConfig(**files("expert-group")), admin=admin, require_client_cert=True
    )
    admin_pb2_grpc.add_AdminServicer_to_server(admin_pb2_grpc.AdminServicer(), server.server)
    server.start()
    try:
        for component, admin_code in (
            ("router", grpc.StatusCode.PERMISSION_DENIED),
            ("orchestrator", grpc.StatusCode.UNIMPLEMENTED),
        ):
            tls = TlsConfig(
                **files(component), group_server_name=pods[component]["EXPERTMESH_TLS_GROUP_SERVER_NAME"]["value"]
            )
            with group_channel(f"127.0.0.1:{server.port}", tls) as channel:
                check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert check.status == health_pb2.HealthCheckResponse.SERVING
                with pytest.raises(grpc.RpcError) as err:
                    admin_pb2_grpc.AdminStub(channel).ListMigrations(admin_pb2.ListMigrationsRequest(), timeout=10)
                assert err.value.code() == admin_code, (component, err.value.details())
    finally:
        server.stop(0)


def _peer_admits(peer: dict, labels: dict | None) -> bool:
    """labels None: an address outside the cluster (only ipBlock peers name one)."""
    if labels is None:
        return "ipBlock" in peer
    return "podSelector" in peer and selects(peer["podSelector"], labels)


def _egress_allowed(docs, src_labels, dst_labels, port, protocol="TCP") -> bool:
    """Whether the policies selecting src let it connect to dst on port (unrestricted without an Egress policy)."""
    policies = [p for p in _policies_for(docs, src_labels) if "Egress" in p["spec"]["policyTypes"]]
    if not policies:
        return True
    for np_ in policies:
        for rule in np_["spec"].get("egress", []):
            ports = rule.get("ports")
            if ports and not any(
                p.get("protocol", "TCP") == protocol and p["port"] <= port <= p.get("endPort", p["port"]) for p in ports
            ):
                continue
            peers = rule.get("to")
            if peers is None or any(_peer_admits(p, dst_labels) for p in peers):
                return True
    return False


@pytest.mark.parametrize("name", SETS)
def test_network_policies_restrict_egress(render, name):
    docs = render(name)
    values = values_of(name)
    labels = {}
    for _, tpl in pod_templates(docs):
        labels.setdefault(tpl["metadata"]["labels"]["app.kubernetes.io/component"], tpl["metadata"]["labels"])
    router, orch, groups = labels["router"], labels["orchestrator"], labels["expert-group"]
    dns = {"k8s-app": "kube-dns"}
    base = values["expertGroups"]["portBase"]
    for src in (router, orch, groups):
        assert _egress_allowed(docs, src, dns, 53, "UDP") and _egress_allowed(docs, src, dns, 53, "TCP")
        assert not _egress_allowed(docs, src, None, 80), "no egress to the internet"
        if "redis" in labels:
            assert _egress_allowed(docs, src, labels["redis"], 6379)
        else:
            assert _egress_allowed(docs, src, None, 6380), "the external Redis on its URL's port"
        assert _egress_allowed(docs, src, None, 4317) == values["otel"]["enabled"]
    # The router calls the groups' gRPC ports, nothing else of theirs; the orchestrator also their admin surfaces.
    assert _egress_allowed(docs, router, groups, base) and not _egress_allowed(docs, router, groups, 8265)
    assert _egress_allowed(docs, orch, groups, base) and _egress_allowed(docs, orch, groups, 8265)
    # Ray pods talk among themselves on any port (GCS, raylets, object transfer).
    assert _egress_allowed(docs, groups, groups, 6379) and _egress_allowed(docs, groups, groups, 45123)
    # Only the orchestrator reaches the Kubernetes API server.
    assert _egress_allowed(docs, orch, None, 443) and _egress_allowed(docs, orch, None, 6443)
    assert not _egress_allowed(docs, router, None, 443) and not _egress_allowed(docs, groups, None, 6443)
    if "redis" in labels:
        (redis_np,) = _policies_for(docs, labels["redis"])
        assert "Egress" in redis_np["spec"]["policyTypes"] and not redis_np["spec"].get("egress")


def test_egress_rules_can_be_left_out(helm):
    for np_ in by_kind(render_with(helm, "networkPolicy.egress.enabled=false"), "NetworkPolicy"):
        assert np_["spec"]["policyTypes"] == ["Ingress"] and "egress" not in np_["spec"]


# -- values.schema.json: negative cases and descriptions -------------------------------------


def names_key(out: str, key: str) -> bool:
    """Helm <= 3.17 names a key as router.replicas, Helm >= 3.18 as '/router/replicas'."""
    return key in out or "/" + key.replace(".", "/") in out


# (value file, the key the message must name, words of which one must appear: both Helm schema libraries)
@pytest.mark.parametrize(
    "case,key,words",
    [
        ("wrong-type.yaml", "router.replicas", ["integer"]),
        ("unknown-key.yaml", "expertGroups", ["portbase"]),
    ],
)
@pytest.mark.parametrize("command", ["template", "lint"])
def test_bad_values_fail_schema_validation_naming_the_key(helm, case, key, words, command):
    if command == "template":
        res = helm(*template_args(VALUES_DIR / case))
        out = res.stderr
    else:
        res = helm("lint", str(CHART), "--set", "kuberay.checkCRD=false", "-f", str(VALUES_DIR / case))
        out = res.stdout + res.stderr
    assert res.returncode != 0
    assert "values don't meet the specifications of the schema" in out, out
    assert names_key(out, key) and all(w in out for w in words), out
    if "Invalid type" in out or "Additional property" in out:  # the pinned Helm 3.17: exact wording
        assert {
            "wrong-type.yaml": "- router.replicas: Invalid type. Expected: integer, given: string",
            "unknown-key.yaml": "- expertGroups: Additional property portbase is not allowed",
        }[case] in out, out


@pytest.mark.parametrize(
    "sets,key",
    [
        (["mode=tpu"], "mode"),
        (["router.resources.limits.memory=lots"], "router.resources.limits.memory"),
        (["redis.external.url=http://redis:6379"], "redis.external.url"),
        (["otel.enabled=true"], "otel.endpoint"),
        (["expertGroups.groups[0].name=g0", "expertGroups.groups[0].experts.x[0]=1"], "expertGroups.groups.0.experts"),
    ],
)
def test_more_schema_violations_are_named(helm, sets, key):
    args = template_args(None)
    for s in sets:
        args += ["--set", s]
    res = helm(*args)
    assert res.returncode != 0 and "values don't meet the specifications of the schema" in res.stderr, res.stderr
    assert names_key(res.stderr, key), res.stderr


@pytest.mark.parametrize(
    "values,message",
    [
        (
            {
                "expertGroups": {
                    "groups": [
                        {"name": "a", "experts": {"*": [0]}, "island": "i0", "node": "n1"},
                        {"name": "b", "experts": {"*": [1]}, "island": "i0", "node": "n2"},
                    ]
                }
            },
            'group "b" names node "n2" but island "i0" is on node "n1"',
        ),
        (
            {
                "expertGroups": {
                    "islands": [{"name": "i0", "node": "n1", "gpus": 2}],
                    "groups": [
                        {"name": "a", "experts": {"*": [0]}, "island": "i0", "gpus": 2},
                        {"name": "b", "experts": {"*": [1]}, "island": "i0", "gpus": 1},
                    ],
                }
            },
            'island "i0" has 2 GPUs but its groups [a b] need 3',
        ),
        (
            {"expertGroups": {"groups": [{"name": "a", "experts": {"*": [0]}}, {"name": "a", "experts": {"*": [1]}}]}},
            'group "a" is listed twice',
        ),
    ],
)
def test_topology_mistakes_fail_with_a_clear_message(helm, tmp_path, values, message):
    path = tmp_path / "v.yaml"
    path.write_text(yaml.safe_dump(values))
    res = helm(*template_args(path))
    assert res.returncode != 0 and message in res.stderr, res.stderr


def test_missing_kuberay_crd_fails_clearly(helm):
    res = helm(*template_args(None, api_versions=False))
    assert res.returncode != 0 and "does not serve ray.io/v1 RayService" in res.stderr
    res = helm(*template_args(None, "--set", "kuberay.checkCRD=false", api_versions=False))
    assert res.returncode == 0, res.stderr


def _schema_nodes(node, path="$"):
    yield path, node
    if isinstance(node, dict):
        for key, child in node.get("properties", {}).items():
            yield from _schema_nodes(child, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            yield from _schema_nodes(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            yield from _schema_nodes(node["additionalProperties"], f"{path}.*")


def test_schema_describes_every_value_and_accepts_the_value_sets():
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())
    defs = schema["definitions"]
    missing = [
        p
        for root in [schema, *defs.values()]
        for p, n in _schema_nodes(root)
        if isinstance(n, dict)
        and "$ref" not in n
        and "description" not in n
        and not p.endswith((".cpu", ".memory", ".*"))
    ]
    assert not missing, f"schema nodes without a description: {missing}"
    validator = jsonschema.Draft7Validator(schema)
    for name in SETS:
        errors = [e.message for e in validator.iter_errors(values_of(name))]
        assert not errors, (name, errors)
    for bad in ("wrong-type.yaml", "unknown-key.yaml"):
        merged = yaml.safe_load((CHART / "values.yaml").read_text())
        override = yaml.safe_load((VALUES_DIR / bad).read_text())
        for k, v in override.items():
            merged[k] = {**merged[k], **v}
        assert list(validator.iter_errors(merged)), bad


def _leaf_paths(node, prefix=""):
    if (
        isinstance(node, dict)
        and node
        and not prefix.endswith(("resources", "securityContext", "SecurityContext", "experts"))
    ):
        for k, v in node.items():
            yield from _leaf_paths(v, f"{prefix}.{k}" if prefix else k)
    else:
        yield prefix


def test_readme_lists_every_value_with_its_default():
    readme = (CHART / "README.md").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    undocumented = [p for p in _leaf_paths(values) if f"`{p}`" not in readme]
    assert not undocumented, f"values missing from helm/expertmesh/README.md: {undocumented}"
    for heading in ("Prerequisites", "Install", "Upgrade", "Uninstall", "Values"):
        assert re.search(rf"^#+ .*{heading}", readme, re.M), heading


def test_notes_tell_how_to_reach_the_grpc_api(helm, tmp_path):
    """NOTES.txt is only rendered by install/upgrade (which need a cluster), so render it
    here through a copy of the chart where a ConfigMap carries `tpl` of the notes."""
    import shutil

    chart = tmp_path / "expertmesh"
    shutil.copytree(CHART, chart)
    (chart / "notes.txt").write_text((CHART / "templates" / "NOTES.txt").read_text())
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data:\n  notes: {{ tpl (.Files.Get "notes.txt") . | quote }}\n'
    )
    args = template_args(None, "--show-only", "templates/zz-notes.yaml")
    args[2] = str(chart)
    res = helm(*args)
    assert res.returncode == 0, res.stderr
    notes = yaml.safe_load(res.stdout)["data"]["notes"]
    assert f"{FULLNAME}-router.{NAMESPACE}.svc.cluster.local:50051" in notes
    assert f"kubectl port-forward -n {NAMESPACE} svc/{FULLNAME}-router 50051:50051" in notes
    assert "grpc.health.v1.Health/Check" in notes
    assert "expertmesh-group-<name>" not in notes, "the upgrade note only on upgrade"
    res = helm(*args, "--is-upgrade")
    assert res.returncode == 0, res.stderr
    notes = yaml.safe_load(res.stdout)["data"]["notes"]
    assert "Serve restarted every\ngroup once" in notes and "brings back a chart group removed live" in notes


@pytest.mark.parametrize(
    "sets",
    [
        ["orchestrator.enabled=false"],
        ["networkPolicy.enabled=false", "router.podDisruptionBudget.enabled=false"],
        ["redis.auth.existingSecret=redis-auth", "model.pvc.claimName=models", "model.pvc.subPath=mixtral"],
        ["mode=cpu", "expertGroups.defaultWorkers.replicas=3", "expertGroups.worker.readOnlyRootFilesystem=false"],
        ["expertGroups.defaultWorkers.replicas=2", "expertGroups.defaultWorkers.gpus=4", "image.tag=1.2.3"],
    ],
)
def test_toggles_render_and_validate(helm, sets):
    args = template_args(None)
    for s in sets:
        args += ["--set", s]
    res = helm(*args)
    assert res.returncode == 0, res.stderr
    docs = res.docs
    for obj in docs:
        if obj["kind"] == "RayService":
            assert check_rayservice(obj) == []
        else:
            kubernetes_validate.validate(obj, "1.30.0", strict=True)
    kinds = {d["kind"] for d in docs}
    if "orchestrator.enabled=false" in sets:
        assert not kinds & {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}
        assert not [d for d in docs if d["metadata"]["name"].endswith("-orchestrator")]
    if "networkPolicy.enabled=false" in sets:
        assert "NetworkPolicy" not in kinds and "PodDisruptionBudget" not in kinds
    if "redis.auth.existingSecret=redis-auth" in sets:
        sts = one(docs, "StatefulSet", f"{FULLNAME}-redis")
        users = next(v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "users")
        assert users["secret"]["secretName"] == "redis-auth"
        for where, tpl in pod_templates(docs):
            c = tpl["spec"]["containers"][0]
            if "redis" not in where:
                auth = next(v for v in tpl["spec"]["volumes"] if v["name"] == "redis-auth")
                assert auth["secret"]["secretName"] == "redis-auth"
                model = next(m for m in c["volumeMounts"] if m["name"] == "model")
                assert model == {"name": "model", "mountPath": "/models", "readOnly": True, "subPath": "mixtral"}
                vol = next(v for v in tpl["spec"]["volumes"] if v["name"] == "model")
                assert vol["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    if "expertGroups.defaultWorkers.gpus=4" in sets:
        (wg,) = rayservice(docs)["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        assert (
            wg["replicas"] == 2
            and wg["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4
        )
        assert one(docs, "Deployment", f"{FULLNAME}-router")["spec"]["template"]["spec"]["containers"][0][
            "image"
        ].endswith(":1.2.3")
        assert wg["template"]["spec"]["containers"][0]["image"].endswith(":1.2.3-cuda")
    if "expertGroups.worker.readOnlyRootFilesystem=false" in sets:
        for wg in rayservice(docs)["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
            assert wg["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is False
