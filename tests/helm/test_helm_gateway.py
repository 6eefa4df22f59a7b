"""Behind an inference gateway: the chart's InferencePool, its endpoint picker and the router HPA on the waiting
gauge. No pip package ships the Gateway API Inference Extension's CRD, so ``check_inference_pool`` writes down
the rules of its v1 types (kubernetes-sigs/gateway-api-inference-extension, ``api/v1/inferencepool_types.go``,
``shared_types.go``): ``spec.selector.matchLabels`` (at most 64, Kubernetes label keys and values), ``targetPorts``
(1 to 8 ``{number}``, unique, 1..65535), ``appProtocol`` (http or kubernetes.io/h2c), ``endpointPickerRef``
(``group``, ``kind`` (default Service: then ``port`` is required), ``name``, ``port.number``, ``failureMode``
FailOpen|FailClose); no other fields."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest
from helmchart import RELEASE, template_args

from expertmesh.serving.protocol_metrics import EPP_METRIC_FLAGS

FULLNAME = f"{RELEASE}-expertmesh"
GATEWAY = ["router.http.enabled=true", "inferencePool.enabled=true"]

_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$"
)
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_OBJECT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _port_problems(port, where: str) -> list[str]:
    if not isinstance(port, dict) or set(port) != {"number"}:
        return [f"{where}: a port is exactly {{number}}, got {port!r}"]
    number = port["number"]
    return [] if isinstance(number, int) and 1 <= number <= 65535 else [f"{where}.number {number!r} not in 1..65535"]


def check_inference_pool(obj: dict) -> list[str]:
    """What the extension's v1 API server would reject in ``obj`` (empty: nothing)."""
    problems = []
    if (obj.get("apiVersion"), obj.get("kind")) != ("inference.networking.k8s.io/v1", "InferencePool"):
        problems.append(
            f"not an inference.networking.k8s.io/v1 InferencePool: {obj.get('apiVersion')} {obj.get('kind')}"
        )
    spec = obj.get("spec") or {}
    unknown = set(spec) - {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
    if unknown:
        problems.append(f"spec has unknown fields {sorted(unknown)}")
    selector = spec.get("selector") or {}
    if set(selector) - {"matchLabels"}:
        problems.append(f"spec.selector takes matchLabels only, got {sorted(selector)}")
    labels = selector.get("matchLabels") or {}
    if not labels or len(labels) > 64:
        problems.append(f"spec.selector.matchLabels needs 1 to 64 labels, got {len(labels)}")
    for key, value in labels.items():
        if len(key) > 253 or not _LABEL_KEY.match(key):
            problems.append(f"spec.selector.matchLabels: bad key {key!r}")
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            problems.append(f"spec.selector.matchLabels[{key}]: bad value {value!r}")
    ports = spec.get("targetPorts")
    if not isinstance(ports, list) or not 1 <= len(ports) <= 8:
        problems.append(f"spec.targetPorts needs 1 to 8 ports, got {ports!r}")
    else:
        for i, port in enumerate(ports):
            problems += _port_problems(port, f"spec.targetPorts[{i}]")
        numbers = [p.get("number") for p in ports if isinstance(p, dict)]
        if len(numbers) != len(set(numbers)):
            problems.append("spec.targetPorts: port number must be unique")
    if spec.get("appProtocol", "http") not in ("http", "kubernetes.io/h2c"):
        problems.append(f"spec.appProtocol {spec['appProtocol']!r} not http or kubernetes.io/h2c")
    ref = spec.get("endpointPickerRef")
    if ref is not None:
        unknown = set(ref) - {"group", "kind", "name", "port", "failureMode"}
        if unknown:
            problems.append(f"spec.endpointPickerRef has unknown fields {sorted(unknown)}")
        name = ref.get("name", "")
        if not name or len(name) > 253 or not _OBJECT_NAME.match(name):
            problems.append(f"spec.endpointPickerRef.name {name!r} is not an object name")
        if ref.get("kind", "Service") == "Service" and "port" not in ref:
            problems.append("spec.endpointPickerRef: port is required when kind is 'Service' or unspecified")
        if "port" in ref:
            problems += _port_problems(ref["port"], "spec.endpointPickerRef.port")
        if ref.get("failureMode", "FailClose") not in ("FailOpen", "FailClose"):
            problems.append(f"spec.endpointPickerRef.failureMode {ref['failureMode']!r} not FailOpen or FailClose")
    return problems


def _render(helm, *sets: str):
    args = template_args(None)
    for s in sets:
        args += ["--set", s]
    return helm(*args)


def _docs(helm, *sets: str) -> list[dict]:
    res = _render(helm, *sets)
    assert res.returncode == 0, res.stderr
    return res.docs


def _one(docs, kind: str, name: str) -> dict:
    (obj,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return obj


def test_defaults_render_no_gateway_objects(render):
    docs = render("defaults")
    assert not [d for d in docs if d["kind"] in ("InferencePool", "HorizontalPodAutoscaler")]
    assert not [d for d in docs if d["metadata"]["name"].endswith(("-epp", "-pool"))]


def test_the_inference_pool_selects_the_router_pods_on_their_http_port_through_the_charts_picker(helm):
    docs = _docs(helm, *GATEWAY)
    pool = _one(docs, "InferencePool", f"{FULLNAME}-pool")
    assert check_inference_pool(pool) == []
    router = _one(docs, "Deployment", f"{FULLNAME}-router")["spec"]["template"]
    (http,) = [p for p in router["spec"]["containers"][0]["ports"] if p["name"] == "http"]
    assert pool["spec"]["targetPorts"] == [{"number": http["containerPort"]}]
    labels = router["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in pool["spec"]["selector"]["matchLabels"].items())
    epp_pod = _one(docs, "Deployment", f"{FULLNAME}-epp")["spec"]["template"]
    assert not all(
        epp_pod["metadata"]["labels"].get(k) == v for k, v in pool["spec"]["selector"]["matchLabels"].items()
    ), "the pool selects routers only"
    assert "app.kubernetes.io/part-of" not in epp_pod["metadata"]["labels"], "Redis admits platform pods only"
    service = _one(docs, "Service", f"{FULLNAME}-epp")
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == service["metadata"]["name"] and ref["failureMode"] == "FailClose"
    assert ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    assert all(epp_pod["metadata"]["labels"].get(k) == v for k, v in service["spec"]["selector"].items())


def test_the_endpoint_picker_reads_the_metric_names_the_router_exports(helm):
    docs = _docs(helm, *GATEWAY, "tls.enabled=false")
    epp = _one(docs, "Deployment", f"{FULLNAME}-epp")
    container = epp["spec"]["template"]["spec"]["containers"][0]
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])
    for flag, name in EPP_METRIC_FLAGS.items():
        assert flags[flag] == name, flag
    assert flags["pool-name"] == f"{FULLNAME}-pool" and flags["pool-namespace"] == "expertmesh"
    assert flags["model-server-metrics-scheme"] == "http"
    assert container["image"] == "registry.k8s.io/gateway-api-inference-extension/epp:v1.0.1"
    tls_flags = _one(_docs(helm, *GATEWAY), "Deployment", f"{FULLNAME}-epp")["spec"]["template"]["spec"]
    assert "--model-server-metrics-scheme=https" in tls_flags["containers"][0]["args"], "routers serve HTTPS"
    role = _one(docs, "Role", f"{FULLNAME}-epp")
    assert all(set(rule["verbs"]) == {"get", "list", "watch"} for rule in role["rules"]), "read-only"
    image = _docs(helm, *GATEWAY, "inferencePool.endpointPicker.image.tag=v1.2.3")
    assert _one(image, "Deployment", f"{FULLNAME}-epp")["spec"]["template"]["spec"]["containers"][0]["image"].endswith(
        "/epp:v1.2.3"
    )


def test_every_standard_object_validates_and_the_picker_pod_is_hardened(helm):
    docs = _docs(helm, *GATEWAY, "router.autoscaling.enabled=true", "router.autoscaling.requestsWaiting.enabled=true")
    for obj in docs:
        if obj["kind"] not in ("RayService", "InferencePool"):
            kubernetes_validate.validate(obj, "1.30.0", strict=True)
    spec = _one(docs, "Deployment", f"{FULLNAME}-epp")["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    (container,) = spec["containers"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["resources"]["requests"] and container["resources"]["limits"]


def test_an_existing_picker_is_referenced_and_none_rendered(helm):
    docs = _docs(
        helm,
        *GATEWAY,
        "inferencePool.endpointPicker.enabled=false",
        "inferencePool.endpointPicker.existingService=my-epp",
        "inferencePool.endpointPicker.failureMode=FailOpen",
    )
    ref = _one(docs, "InferencePool", f"{FULLNAME}-pool")["spec"]["endpointPickerRef"]
    assert ref == {"name": "my-epp", "port": {"number": 9002}, "failureMode": "FailOpen"}
    assert not [d for d in docs if d["metadata"]["name"] == f"{FULLNAME}-epp"]


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (["inferencePool.enabled=true"], "needs router.http.enabled"),
        ([*GATEWAY, "inferencePool.endpointPicker.enabled=false"], "existingService"),
        ([*GATEWAY, "inferencePool.endpointPicker.failureMode=Maybe"], "failureMode"),
        ([*GATEWAY, "inferencePool.endpointPicker.port=70000"], "port"),
        ([*GATEWAY, "inferencePool.endpointPicker.existingService=Bad_Name"], "existingService"),
        (["router.autoscaling.enabled=true", "router.autoscaling.maxReplicas=101"], "maxReplicas"),
        (
            ["router.autoscaling.enabled=true", "router.autoscaling.minReplicas=5", "router.autoscaling.maxReplicas=3"],
            "minReplicas (5) is above router.autoscaling.maxReplicas (3)",
        ),
        (["router.autoscaling.enabled=true", "router.autoscaling.requestsWaiting.enabled=true"], "router.http"),
        (["router.autoscaling.enabled=true", "router.autoscaling.targetCPUUtilizationPercentage=0"], "a metric"),
    ],
)
def test_bad_gateway_values_fail_naming_the_value(helm, sets, words):
    res = _render(helm, *sets)
    assert res.returncode != 0 and words in res.stderr, res.stderr


def test_the_router_hpa_scales_on_the_waiting_gauge_per_pod(helm):
    docs = _docs(
        helm,
        "router.http.enabled=true",
        "router.autoscaling.enabled=true",
        "router.autoscaling.requestsWaiting.enabled=true",
        "router.autoscaling.requestsWaiting.averageValue=6",
        "router.autoscaling.targetCPUUtilizationPercentage=0",
    )
    hpa = _one(docs, "HorizontalPodAutoscaler", f"{FULLNAME}-router")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": EPP_METRIC_FLAGS["total-queued-requests-metric"]},
                "target": {"type": "AverageValue", "averageValue": "6"},
            },
        }
    ]
    both = _docs(helm, "router.http.enabled=true", "router.autoscaling.enabled=true")
    metrics = _one(both, "HorizontalPodAutoscaler", f"{FULLNAME}-router")["spec"]["metrics"]
    assert [m["type"] for m in metrics] == ["Resource"], "the waiting gauge is opt-in: it needs an adapter"


def test_a_restricted_router_admits_the_charts_picker_to_its_http_port(helm):
    docs = _docs(helm, *GATEWAY, "networkPolicy.clientFrom[0].podSelector.matchLabels.role=gateway")
    policy = _one(docs, "NetworkPolicy", f"{FULLNAME}-router")
    epp_labels = _one(docs, "Deployment", f"{FULLNAME}-epp")["spec"]["template"]["metadata"]["labels"]
    admitted = [
        rule
        for rule in policy["spec"]["ingress"]
        if any(
            all(epp_labels.get(k) == v for k, v in peer.get("podSelector", {}).get("matchLabels", {}).items())
            and "podSelector" in peer
            for peer in rule.get("from", [])
        )
    ]
    assert [rule["ports"] for rule in admitted] == [[{"protocol": "TCP", "port": 8000}]]


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (lambda s: s.update(targetPorts=[{"number": 8000 + i} for i in range(9)]), "1 to 8"),
        (lambda s: s.update(targetPorts=[{"number": 8000}, {"number": 8000}]), "unique"),
        (lambda s: s.update(targetPorts=[{"number": 0}]), "not in 1..65535"),
        (lambda s: s["endpointPickerRef"].update(failureMode="Sometimes"), "failureMode"),
        (lambda s: s["endpointPickerRef"].pop("port"), "port is required"),
        (lambda s: s.update(selector={"matchLabels": {"bad key!": "x"}}), "bad key"),
        (lambda s: s.update(selector={"matchLabels": {f"k{i}": "v" for i in range(65)}}), "1 to 64"),
        (lambda s: s.update(modelServers={}), "unknown fields"),
    ],
)
def test_the_pool_checker_catches_what_the_api_rejects(helm, mutate, words):
    pool = _one(_docs(helm, *GATEWAY), "InferencePool", f"{FULLNAME}-pool")
    mutate(pool["spec"])
    assert any(words in p for p in check_inference_pool(pool)), check_inference_pool(pool)


def test_notes_show_an_httproute_to_the_pool(helm, tmp_path):
    """NOTES.txt renders only at install; as test_helm_chart's notes test, through a ConfigMap carrying its `tpl`."""
    import shutil

    import yaml
    from helmchart import CHART

    chart = tmp_path / "expertmesh"
    shutil.copytree(CHART, chart)
    (chart / "notes.txt").write_text((CHART / "templates" / "NOTES.txt").read_text())
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data:\n  notes: {{ tpl (.Files.Get "notes.txt") . | quote }}\n'
    )

    def notes(*sets: str) -> str:
        args = template_args(None, "--show-only", "templates/zz-notes.yaml")
        args[2] = str(chart)
        for s in sets:
            args += ["--set", s]
        res = helm(*args)
        assert res.returncode == 0, res.stderr
        return yaml.safe_load(res.stdout)["data"]["notes"]

    assert "HTTPRoute" not in notes()
    text = notes(*GATEWAY)
    route = yaml.safe_load(text[text.index("  apiVersion: gateway.networking.k8s.io/v1") : text.index("  The routers")])
    assert route["kind"] == "HTTPRoute"
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": f"{FULLNAME}-pool"}
    ]
    assert "BackendTLSPolicy" in text, "tls.enabled: the gateway must trust the routers' CA"
