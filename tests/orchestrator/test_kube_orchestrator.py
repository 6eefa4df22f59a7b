"""``expertmesh orchestrator --kube`` as a process: its ExpertMigration controller, talking
to the in-process API server through a kubeconfig, runs an object's move on real expert
groups (``migration_mesh``, registered in a real redis-server) and reports it; SIGTERM
stops it cleanly. The ``kubectl expertmesh migrate`` path of the same run is in
test_kube_plugin.py; this is the wiring of the controller into the process."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest
import yaml
from migration_mesh import EXPERT, LAYER, PAIR, FollowingRouter, mesh_in_redis

from conftest import NAMESPACE
from expertmesh.orchestrator.kube.api import create_migration_object
from expertmesh.orchestrator.kube.resource import MigrationSpec, Origin
from expertmesh.orchestrator.migration.state import MigrationMode
from helpers import orchestrator_argv

pytestmark = [pytest.mark.slow, pytest.mark.redis]

#: a redis database of its own: other suites flush database 0 of the same server
DATABASE = 5


def test_the_orchestrator_process_runs_expertmigrations(redis_url, tiny_checkpoints, kubeconfig, kube_api, tmp_path):
    url = redis_url.rsplit("/", 1)[0] + f"/{DATABASE}"
    path = tiny_checkpoints("mixtral")
    placement = tmp_path / "placement.yaml"
    placement.write_text(yaml.safe_dump({"groups": {"g0": {"*": [0, 1]}, "g1": {"*": [2, 3]}}}))
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"} | {"KUBECONFIG": str(kubeconfig)}
    with mesh_in_redis(url, path) as mesh:
        store = mesh.store
        proc = subprocess.Popen(
            orchestrator_argv(url, path, placement, "--kube"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        stderr: list[str] = []
        threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
        try:
            deadline = time.monotonic() + 120
            while not any(f"running ExpertMigrations of namespace {NAMESPACE}" in line for line in stderr):
                assert proc.poll() is None and time.monotonic() < deadline, "".join(stderr)[-3000:]
                time.sleep(0.1)
            with FollowingRouter(store, "r1"):
                obj = create_migration_object(
                    kube_api, MigrationSpec(LAYER, EXPERT, MigrationMode.MOVE, None, "g2"), origin=Origin.MANUAL
                )
                while not (current := kube_api.get(NAMESPACE, obj.name)).status.finished:
                    assert proc.poll() is None and time.monotonic() < deadline, "".join(stderr)[-3000:]
                    time.sleep(0.1)
            assert current.status.phase == "Succeeded", current.status
            assert store.routing_table().replicas[PAIR] == ("g2",)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, "".join(stderr)[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
