"""The chart's side of the router's OpenAI-compatible HTTP API (`router.http`): the flag, the
container and Service port, probes on /health, the optional ServiceMonitor, NetworkPolicy
ports and the schema. Rendered and validated without a cluster, as test_helm_chart.py does."""

from __future__ import annotations

import kubernetes_validate
import pytest
from helmchart import CHART, NAMESPACE, RELEASE, template_args

FULLNAME = f"{RELEASE}-expertmesh"
ROUTER = f"{FULLNAME}-router"
HTTP = ["router.http.enabled=true"]


def render(helm, *sets: str) -> list[dict]:
    args = template_args(None)
    for s in sets:
        args += ["--set", s]
    res = helm(*args)
    assert res.returncode == 0, res.stderr
    return res.docs


def one(docs, kind, name=ROUTER):
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def router_container(docs) -> dict:
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def ingress_allows(docs, src: dict, port: int) -> bool:
    """Whether the router's NetworkPolicy admits a pod labelled ``src`` (same namespace) on ``port``."""
    policy = one(docs, "NetworkPolicy")
    for rule in policy["spec"]["ingress"]:
        if not any(p["port"] == port for p in rule.get("ports", [])):
            continue
        peers = rule.get("from")
        if peers is None or any("podSelector" in p and selects(p["podSelector"], src) for p in peers):
            return True
    return False


def test_off_by_default(helm):
    docs = render(helm)
    container = router_container(docs)
    assert "--http-port" not in container["args"] and [p["name"] for p in container["ports"]] == ["grpc"]
    assert [p["name"] for p in one(docs, "Service")["spec"]["ports"]] == ["grpc"]
    assert not [d for d in docs if d["kind"] == "ServiceMonitor"]


@pytest.mark.parametrize("tls", [True, False])
def test_enabled_adds_the_flag_port_and_probes_on_health(helm, tls):
    docs = render(helm, *HTTP, f"tls.enabled={str(tls).lower()}")
    container = router_container(docs)
    args = container["args"]
    assert args[args.index("--http-port") + 1] == "8000"
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in container["ports"]
    scheme = "HTTPS" if tls else "HTTP"
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": scheme}
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health/live", "port": "http", "scheme": scheme}, probe
        assert "grpc" not in container[probe]
    (port,) = [p for p in one(docs, "Service")["spec"]["ports"] if p["name"] == "http"]
    assert (port["port"], port["targetPort"], port["appProtocol"]) == (8000, "http", "https" if tls else "http")
    for obj in docs:
        if obj["kind"] != "RayService":
            kubernetes_validate.validate(obj, "1.30.0", strict=True)


def test_client_certificates_keep_the_grpc_probes(helm):
    """The kubelet has no client certificate: under requireClientCert it cannot call /health."""
    container = router_container(render(helm, *HTTP, "tls.requireClientCert=true"))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": 50061} and "httpGet" not in container[probe], probe


def test_service_monitor_scrapes_metrics_over_the_router_certificate(helm):
    docs = render(
        helm, *HTTP, "router.http.serviceMonitor.enabled=true", "router.http.serviceMonitor.labels.release=prom"
    )
    monitor = one(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["metadata"]["labels"]["release"] == "prom"
    service = one(docs, "Service")
    assert selects(monitor["spec"]["selector"], service["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert (endpoint["path"], endpoint["interval"], endpoint["scheme"]) == ("/metrics", "30s", "https")
    secret = f"{FULLNAME}-tls-router"
    assert endpoint["tlsConfig"] == {"serverName": ROUTER, "ca": {"secret": {"name": secret, "key": "ca.crt"}}}
    assert one(docs, "Secret", secret)["type"] == "kubernetes.io/tls"

    mutual = one(
        render(helm, *HTTP, "router.http.serviceMonitor.enabled=true", "tls.requireClientCert=true"), "ServiceMonitor"
    )
    tls_config = mutual["spec"]["endpoints"][0]["tlsConfig"]
    assert tls_config["cert"] == {"secret": {"name": secret, "key": "tls.crt"}}
    assert tls_config["keySecret"] == {"name": secret, "key": "tls.key"}

    plain = one(render(helm, *HTTP, "router.http.serviceMonitor.enabled=true", "tls.enabled=false"), "ServiceMonitor")
    assert "tlsConfig" not in plain["spec"]["endpoints"][0] and "scheme" not in plain["spec"]["endpoints"][0]


def test_service_monitor_without_the_http_api_fails_clearly(helm):
    res = helm(*template_args(None, "--set", "router.http.serviceMonitor.enabled=true"))
    assert res.returncode != 0 and "router.http.serviceMonitor.enabled needs router.http.enabled" in res.stderr


def test_network_policy_admits_clients_and_scrapers_to_the_http_port(helm):
    stranger = {"app.kubernetes.io/name": "other"}
    docs = render(helm, *HTTP)
    assert ingress_allows(docs, stranger, 8000) and ingress_allows(docs, stranger, 50051)
    app, prometheus = {"app": "chat-frontend"}, {"app.kubernetes.io/name": "prometheus"}
    docs = render(
        helm,
        *HTTP,
        "networkPolicy.clientFrom[0].podSelector.matchLabels.app=chat-frontend",
        "networkPolicy.metricsFrom[0].podSelector.matchLabels.app\\.kubernetes\\.io/name=prometheus",
    )
    assert ingress_allows(docs, app, 8000) and ingress_allows(docs, app, 50051)
    assert ingress_allows(docs, prometheus, 8000) and not ingress_allows(docs, prometheus, 50051)
    assert not ingress_allows(docs, stranger, 8000)


@pytest.mark.parametrize(
    "setting,key",
    [
        ("router.http.port=0", "router.http.port"),
        ("router.http.serviceMonitor.interval=often", "router.http.serviceMonitor.interval"),
        ("router.http.tls=true", "router.http"),
    ],
)
def test_schema_names_bad_http_values(helm, setting, key):
    res = helm(*template_args(None, "--set", setting))
    assert res.returncode != 0 and "values don't meet the specifications of the schema" in res.stderr, res.stderr
    assert key in res.stderr or "/" + key.replace(".", "/") in res.stderr, res.stderr


def test_lint_strict_with_everything_on(helm):
    res = helm(
        "lint",
        "--strict",
        str(CHART),
        "--kube-version",
        "1.30.0",
        "--namespace",
        NAMESPACE,
        "--set",
        "kuberay.checkCRD=false",
        "--set",
        "router.http.enabled=true",
        "--set",
        "router.http.serviceMonitor.enabled=true",
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_router_with_the_http_api_keeps_the_metrics_sdk_on(helm):
    """/metrics reads the OpenTelemetry SDK's meters; without OTLP the chart disables the SDK elsewhere."""
    env = {e["name"]: e.get("value") for e in router_container(render(helm, *HTTP))["env"]}
    assert "OTEL_SDK_DISABLED" not in env and "OTEL_EXPORTER_OTLP_ENDPOINT" not in env
    env = {e["name"]: e.get("value") for e in router_container(render(helm))["env"]}
    assert env["OTEL_SDK_DISABLED"] == "true"
