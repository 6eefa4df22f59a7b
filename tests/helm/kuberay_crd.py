"""Checks of a rendered KubeRay ``RayService`` (``ray.io/v1``) without a cluster.

No pip or npm package ships KubeRay's CRD, so its rules are written down here from
KubeRay's own sources (ray-project/kuberay, ``ray-operator/``):

* ``apis/ray/v1/rayservice_types.go`` / ``raycluster_types.go``, from which
  ``config/crd/bases/ray.io_rayservices.yaml`` is generated: a json tag without
  ``omitempty`` and without ``+optional`` is a required property. Required:
  ``spec.rayClusterConfig.headGroupSpec``; ``headGroupSpec.template`` and
  ``headGroupSpec.rayStartParams`` (required up to KubeRay 1.2, optional since);
  ``workerGroupSpecs[].groupName``, ``.template``, ``.rayStartParams`` (ditto),
  ``.minReplicas``, ``.maxReplicas``. ``rayStartParams`` is ``map[string]string``;
  ``serveConfigV2`` is a string, "a YAML multi-line scalar".
  Fields used must exist since KubeRay v1.1 (the chart's documented minimum):
  ``KNOWN_*`` below lists the v1.1 field sets.
* ``controllers/ray/utils/validation.go`` (``ValidateRayServiceMetadata``,
  ``ValidateRayClusterSpec``): the name is a DNS-1035 label of at most
  ``MaxRayServiceNameLength`` = 53 - 6 = 47 characters; the head and every worker
  group have at least one container (the first is the Ray container); with
  autoscaling off every worker group sets minReplicas and maxReplicas, both >= 0,
  min <= max; ``rayStartParams['labels']`` is rejected.
* ``serveConfigV2`` is what KubeRay PUTs to the Serve REST API, so it is also
  validated with Ray's own ``ray.serve.schema.ServeDeploySchema`` (installed with
  ``ray[serve]``), plus: every application has ``name`` and ``import_path``, names and
  route prefixes are unique, and a deployment's ``ray_actor_options`` fit in its first
  placement-group bundle (Ray Serve's rule).

Pod templates are validated separately against the Kubernetes OpenAPI schema as
``v1/PodTemplate`` objects (see test_helm_chart.py).
"""

from __future__ import annotations

import json
import re

import yaml

MAX_RAYSERVICE_NAME = 47
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")

KNOWN_SPEC = {
    "serveConfigV2",
    "rayClusterConfig",
    "serviceUnhealthySecondThreshold",
    "deploymentUnhealthySecondThreshold",
    "serveService",
}
KNOWN_CLUSTER = {
    "headGroupSpec",
    "workerGroupSpecs",
    "rayVersion",
    "enableInTreeAutoscaling",
    "autoscalerOptions",
    "headServiceAnnotations",
    "suspend",
}
KNOWN_HEAD = {"serviceType", "headService", "enableIngress", "rayStartParams", "template"}
KNOWN_WORKER = {
    "groupName",
    "replicas",
    "minReplicas",
    "maxReplicas",
    "numOfHosts",
    "rayStartParams",
    "template",
    "scaleStrategy",
}


def _require(obj: dict, keys, where: str, errors: list[str]) -> None:
    for key in keys:
        if not isinstance(obj, dict) or key not in obj or obj[key] is None:
            errors.append(f"{where}.{key}: required by the KubeRay CRD")


def _unknown(obj: dict, known: set[str], where: str, errors: list[str]) -> None:
    for key in sorted(set(obj) - known):
        errors.append(f"{where}.{key}: not a field of KubeRay v1.1+ (the API server would drop or reject it)")


def _start_params(params, where: str, errors: list[str]) -> None:
    if not isinstance(params, dict):
        errors.append(f"{where}: must be a map of strings")
        return
    for k, v in params.items():
        if not isinstance(v, str):
            errors.append(f"{where}.{k}: must be a string (map[string]string), got {type(v).__name__}")
    if "labels" in params:
        errors.append(f"{where}.labels: rejected by KubeRay validation")


def parse_start_resources(value: str) -> dict[str, float]:
    """``rayStartParams.resources`` as KubeRay documents it: '"{\\"name\\": 1}"'."""
    text = value.strip()
    if text.startswith('"') and text.endswith('"'):
        text = text[1:-1].replace('\\"', '"')
    return json.loads(text)


def check_serve_config(text, where: str = "spec.serveConfigV2") -> tuple[dict | None, list[str]]:
    errors: list[str] = []
    if not isinstance(text, str):
        return None, [f"{where}: must be a string"]
    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        return None, [f"{where}: not YAML: {exc}"]
    if not isinstance(cfg, dict) or not isinstance(cfg.get("applications"), list) or not cfg["applications"]:
        return cfg, [f"{where}.applications: must be a non-empty list"]
    names, prefixes = set(), set()
    for i, app in enumerate(cfg["applications"]):
        at = f"{where}.applications[{i}]"
        _require(app, ("name", "import_path"), at, errors)
        if not isinstance(app, dict):
            continue
        if app.get("name") in names:
            errors.append(f"{at}.name: duplicate application {app.get('name')!r}")
        names.add(app.get("name"))
        prefix = app.get("route_prefix", "/")
        if prefix is not None and prefix in prefixes:  # None: no HTTP route (Serve allows many)
            errors.append(f"{at}.route_prefix: duplicate {prefix!r}")
        prefixes.add(prefix)
        if not re.match(r"^[A-Za-z_][\w.]*[:.][A-Za-z_]\w*$", str(app.get("import_path", ""))):
            errors.append(f"{at}.import_path: {app.get('import_path')!r} is not module:attribute")
        seen = set()
        for j, dep in enumerate(app.get("deployments") or []):
            dat = f"{at}.deployments[{j}]"
            _require(dep, ("name",), dat, errors)
            if dep.get("name") in seen:
                errors.append(f"{dat}.name: duplicate deployment {dep.get('name')!r}")
            seen.add(dep.get("name"))
            bundles = dep.get("placement_group_bundles")
            if bundles:
                opts = dep.get("ray_actor_options") or {}
                first = bundles[0]
                need = {"CPU": opts.get("num_cpus", 1), "GPU": opts.get("num_gpus", 0), **(opts.get("resources") or {})}
                for res, amount in need.items():
                    if amount and first.get(res, 0) < amount:
                        errors.append(
                            f"{dat}: ray_actor_options need {res}={amount} but the first bundle has {first.get(res, 0)}"
                        )
                if dep.get("placement_group_strategy", "PACK") not in (
                    "PACK",
                    "SPREAD",
                    "STRICT_PACK",
                    "STRICT_SPREAD",
                ):
                    errors.append(f"{dat}.placement_group_strategy: unknown {dep.get('placement_group_strategy')!r}")
    try:
        from ray.serve.schema import ServeDeploySchema
    except ImportError as exc:  # ray[serve] is a dependency of the package
        errors.append(f"{where}: cannot import ray.serve.schema to validate: {exc}")
    else:
        try:
            ServeDeploySchema.model_validate(cfg) if hasattr(
                ServeDeploySchema, "model_validate"
            ) else ServeDeploySchema.parse_obj(cfg)
        except Exception as exc:  # pydantic ValidationError
            errors.append(f"{where}: Ray Serve rejects it: {exc}")
    return cfg, errors


def check_rayservice(obj: dict) -> list[str]:
    """Every violation found, as 'path: reason'; [] when the object is valid."""
    errors: list[str] = []
    if obj.get("apiVersion") != "ray.io/v1" or obj.get("kind") != "RayService":
        return [f"not a ray.io/v1 RayService: {obj.get('apiVersion')}/{obj.get('kind')}"]
    name = (obj.get("metadata") or {}).get("name", "")
    if len(name) > MAX_RAYSERVICE_NAME or not DNS1035.match(name):
        errors.append(f"metadata.name: {name!r} must be a DNS-1035 label of at most {MAX_RAYSERVICE_NAME} characters")
    spec = obj.get("spec") or {}
    _unknown(spec, KNOWN_SPEC, "spec", errors)
    _require(spec, ("rayClusterConfig", "serveConfigV2"), "spec", errors)
    _, serve_errors = check_serve_config(spec.get("serveConfigV2"))
    errors += serve_errors
    cluster = spec.get("rayClusterConfig") or {}
    _unknown(cluster, KNOWN_CLUSTER, "spec.rayClusterConfig", errors)
    _require(cluster, ("headGroupSpec",), "spec.rayClusterConfig", errors)
    head = cluster.get("headGroupSpec") or {}
    where = "spec.rayClusterConfig.headGroupSpec"
    _unknown(head, KNOWN_HEAD, where, errors)
    _require(head, ("template", "rayStartParams"), where, errors)
    _start_params(head.get("rayStartParams", {}), f"{where}.rayStartParams", errors)
    if not ((head.get("template") or {}).get("spec") or {}).get("containers"):
        errors.append(f"{where}.template.spec.containers: headGroupSpec should have at least one container")
    autoscaling = bool(cluster.get("enableInTreeAutoscaling"))
    groups = cluster.get("workerGroupSpecs") or []
    if not isinstance(groups, list):
        return errors + ["spec.rayClusterConfig.workerGroupSpecs: must be a list"]
    names = set()
    for i, wg in enumerate(groups):
        where = f"spec.rayClusterConfig.workerGroupSpecs[{i}]"
        _unknown(wg, KNOWN_WORKER, where, errors)
        _require(wg, ("groupName", "template", "rayStartParams", "minReplicas", "maxReplicas"), where, errors)
        _start_params(wg.get("rayStartParams", {}), f"{where}.rayStartParams", errors)
        if wg.get("groupName") in names:
            errors.append(f"{where}.groupName: duplicate {wg.get('groupName')!r}")
        names.add(wg.get("groupName"))
        if not ((wg.get("template") or {}).get("spec") or {}).get("containers"):
            errors.append(f"{where}.template.spec.containers: workerGroupSpec should have at least one container")
        lo, hi, n = wg.get("minReplicas"), wg.get("maxReplicas"), wg.get("replicas")
        for key, v in (("minReplicas", lo), ("maxReplicas", hi), ("replicas", n)):
            if v is not None and (not isinstance(v, int) or v < 0):
                errors.append(f"{where}.{key}: must be a non-negative integer")
        if not autoscaling and (lo is None or hi is None):
            errors.append(f"{where}: minReplicas and maxReplicas are required with autoscaling off")
        if isinstance(lo, int) and isinstance(hi, int):
            if lo > hi:
                errors.append(f"{where}: minReplicas {lo} > maxReplicas {hi}")
            if isinstance(n, int) and not lo <= n <= hi:
                errors.append(f"{where}.replicas: {n} outside [{lo}, {hi}]")
        res = (wg.get("rayStartParams") or {}).get("resources")
        if res is not None:
            try:
                parsed = parse_start_resources(res)
                assert isinstance(parsed, dict) and all(isinstance(v, (int, float)) for v in parsed.values())
            except Exception:
                errors.append(
                    f"{where}.rayStartParams.resources: {res!r} is not the quoted JSON object "
                    "`ray start --resources` takes"
                )
    return errors
