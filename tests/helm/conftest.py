"""Fixtures of the Helm chart tests: a ``helm`` runner, rendered value sets (see helmchart.py for
where helm comes from), and the CRD of a test module's ``CRD_FILE`` with its schema."""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml
from helmchart import VALUE_SETS, HelmResult, find_helm, template_args


@pytest.fixture(scope="session")
def helm_bin() -> str:
    return find_helm()


@pytest.fixture(scope="session")
def helm(helm_bin, tmp_path_factory):
    """Run helm with its own config/cache/data dirs (nothing written under $HOME)."""
    home = tmp_path_factory.mktemp("helm-home")
    env = dict(os.environ)
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[var] = str(home / var.lower())
    env.pop("KUBECONFIG", None)

    def run(*args: str) -> HelmResult:
        proc = subprocess.run([helm_bin, *args], capture_output=True, text=True, env=env, timeout=120)
        return HelmResult(proc.returncode, proc.stdout, proc.stderr)

    return run


@pytest.fixture(scope="session")
def render(helm):
    """value-set name -> rendered objects (cached); fails with helm's message on error."""
    cache: dict[str, list[dict]] = {}

    def get(name: str) -> list[dict]:
        if name not in cache:
            res = helm(*template_args(VALUE_SETS[name]))
            assert res.returncode == 0, f"helm template ({name}) failed:\n{res.stderr}"
            cache[name] = res.docs
        return cache[name]

    return get


@pytest.fixture(scope="module")
def crd(request) -> dict:
    """The CRD in the test module's ``CRD_FILE``."""
    return yaml.safe_load(request.module.CRD_FILE.read_text())


@pytest.fixture(scope="module")
def schema(crd) -> dict:
    """The ``openAPIV3Schema`` of the CRD's one version."""
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]
