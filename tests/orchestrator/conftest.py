"""Fixtures of the Kubernetes tests (test_kube_*.py): the in-process API server with the
chart's CRDs installed, a client for it, expert groups on loopback
(``migration_mesh``) and a migration runner over them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from kube_api_fake import ApiServer
from migration_mesh import FAST, Mesh, start_mesh

from expertmesh.orchestrator.admin import MigrationRunner
from expertmesh.orchestrator.kube.api import ExpertMigrationApi, connect
from expertmesh.orchestrator.kube.controller import ControllerSettings, MigrationController
from expertmesh.orchestrator.migration.executor import MigrationExecutor
from expertmesh.store import open_store

CRD_FILE = Path(__file__).resolve().parents[2] / "helm" / "expertmesh" / "crds" / "expertmigrations.expertmesh.io.yaml"
NAMESPACE = "expertmesh"
RESOURCE = "expertmesh.io/v1alpha1/expertmigrations"


@pytest.fixture
def api_server() -> Iterator[ApiServer]:
    server = ApiServer()
    for crd in sorted(CRD_FILE.parent.glob("*.yaml")):  # ExpertGroup, ExpertMigration and ExpertQuarantine
        server.call(server.fake.install_crd, yaml.safe_load(crd.read_text()))
    yield server
    server.close()


@pytest.fixture
def kubeconfig(api_server, tmp_path) -> Path:
    return api_server.kubeconfig(tmp_path, NAMESPACE)


@pytest.fixture
def kube_api(kubeconfig) -> ExpertMigrationApi:
    return ExpertMigrationApi(connect(str(kubeconfig)))


@pytest.fixture
def group_mesh(tiny_checkpoints) -> Iterator[Mesh]:
    mesh = start_mesh(open_store("memory://"), tiny_checkpoints("mixtral"))
    yield mesh
    for group in mesh.groups.values():
        group.server.stop(0)


@pytest.fixture
def runner(group_mesh) -> Iterator[MigrationRunner]:
    runner = MigrationRunner(group_mesh.store, MigrationExecutor(group_mesh.store, **FAST))
    yield runner
    runner.close()


@pytest.fixture
def run_controller(kube_api, runner, group_mesh):
    """A context manager running the controller (fast polls, 1 s watches) over the fixtures."""

    @contextmanager
    def running() -> Iterator[MigrationController]:
        settings = ControllerSettings(NAMESPACE, poll_s=0.02, watch_timeout_s=1, retry_s=0.1)
        controller = MigrationController(kube_api, runner, group_mesh.store, settings).start()
        try:
            yield controller
        finally:
            controller.stop()

    return running
