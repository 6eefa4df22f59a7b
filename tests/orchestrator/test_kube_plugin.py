"""``kubectl expertmesh`` (``kube.plugin``): ``migrate`` against the in-process API server
(with the controller running real moves for ``--wait``), ``experts`` against a state
store holding a routing table and two routers' load."""

from __future__ import annotations

import importlib
import json
import tomllib
from pathlib import Path

import numpy as np
from migration_mesh import EXPERT, LAYER, FollowingRouter

from conftest import NAMESPACE
from expertmesh.cli.kubectl_plugin import main
from expertmesh.contracts.load_window import LoadSnapshot
from expertmesh.contracts.routing_table import RoutingTable
from expertmesh.orchestrator.kube.resource import MigrationSpec
from expertmesh.orchestrator.migration.state import MigrationMode
from expertmesh.store import QuarantinedReplica, open_store

REPO = Path(__file__).resolve().parents[2]


def migrate(kubeconfig, *args: str) -> int:
    return main(["migrate", "--kubeconfig", str(kubeconfig), "--layer", str(LAYER), "--expert", str(EXPERT), *args])


def test_the_package_installs_the_plugin_as_kubectl_expertmesh():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["kubectl-expertmesh"].partition(":")
    assert getattr(importlib.import_module(module), function) is main


def test_migrate_creates_an_expertmigration(kubeconfig, kube_api, capsys):
    assert migrate(kubeconfig, "--to", "g2", "--name", "move-1") == 0
    assert capsys.readouterr().out == "expertmigration.expertmesh.io/move-1 created\n"
    obj = kube_api.get(NAMESPACE, "move-1")
    assert obj.spec == MigrationSpec(LAYER, EXPERT, MigrationMode.MOVE, None, "g2")
    assert obj.labels == {"expertmesh.io/origin": "manual"}
    assert migrate(kubeconfig, "--mode", "evict", "--from", "g0", "-n", "other") == 0
    (evict,) = kube_api.list("other").items
    assert (
        evict.name.startswith(f"l{LAYER}-e{EXPERT}-")
        and evict.spec.mode is MigrationMode.EVICT
        and evict.spec.source == "g0"
    )


def test_migrate_wait_follows_the_object_until_it_succeeds(kubeconfig, group_mesh, run_controller, capsys):
    with run_controller(), FollowingRouter(group_mesh.store, "r1"):
        assert migrate(kubeconfig, "--to", "g2", "--name", "move-2", "--wait", "--timeout", "60") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "expertmigration.expertmesh.io/move-2 created"
    assert "  Succeeded (routing table v3)" in out
    assert out[-2].split() == ["NAME", "LAYER", "EXPERT", "FROM", "TO", "STATUS", "TABLE"]
    assert out[-1].split() == ["move-2", "1", "1", "g0", "g2", "Succeeded", "v3"]


def test_migrate_wait_exits_1_with_the_reason_when_the_move_fails(kubeconfig, run_controller, capsys):
    with run_controller():
        assert migrate(kubeconfig, "--to", "g9", "--name", "move-3", "--wait", "--timeout", "60") == 1
    err = capsys.readouterr().err
    assert "move-3 failed (Refused): unknown group 'g9'" in err


def test_migrate_bad_input_is_one_line_and_exit_2(kubeconfig, tmp_path, capsys):
    assert main(["migrate", "--kubeconfig", str(kubeconfig), "--layer", "-1", "--expert", "0", "--to", "g2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kubectl expertmesh migrate: error: create ExpertMigration: 422") and "spec.layer" in err
    assert migrate(kubeconfig) == 2
    assert "--mode move needs --to GROUP" in capsys.readouterr().err
    assert migrate(tmp_path / "missing-kubeconfig", "--to", "g2") == 2
    assert "no Kubernetes credentials" in capsys.readouterr().err


def test_experts_prints_groups_load_share_quarantines_and_table_version(monkeypatch, capsys):
    store = open_store("memory://")
    table = RoutingTable(1, 2, {(0, 0): ("g0",), (0, 1): ("g0", "g1"), (1, 0): ("g1",), (1, 1): ("g1",)})
    assert store.publish_routing_table(table)
    for router, counts in (("r1", [[6.0, 2.0], [1.0, 1.0]]), ("r2", [[0.0, 2.0], [3.0, 5.0]])):
        load = np.array(counts)
        snapshot = LoadSnapshot((0, 1), 2, 1, load, np.zeros((2, 2, 2)), np.zeros((2, 1, 2)), 64)
        store.publish_load(router, snapshot.to_bytes())
    store.set_quarantined(QuarantinedReplica(1, 1, "g1", "quarantined", "bad outputs", 1.0, withdrawn=False))
    monkeypatch.setattr("expertmesh.store.open_store", lambda url: store)

    assert main(["experts", "--state-url", "redis://redis:6379/0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "routing table v1: 2 MoE layers, 2 groups; load from 2 routers"
    assert [line.split() for line in lines[1:]] == [
        ["LAYER", "EXPERT", "GROUPS", "LOAD"],
        ["0", "0", "g0", "60.0%"],
        ["0", "1", "g0", "(50%),", "g1", "(50%)", "40.0%"],
        ["1", "0", "g1", "40.0%"],
        ["1", "1", "g1", "[quarantined]", "60.0%"],
    ]
    assert main(["experts", "--state-url", "redis://redis:6379/0", "--layer", "1", "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["routing_table_version"] == 1 and doc["routers"] == 2
    assert [(e["expert"], e["replicas"], e["load_share"]) for e in doc["experts"]] == [
        (0, [{"group": "g1", "share": 1.0, "state": ""}], 0.4),
        (1, [{"group": "g1", "share": 1.0, "state": "quarantined"}], 0.6),
    ]


def test_experts_without_a_store_says_how_to_reach_one(monkeypatch, capsys):
    monkeypatch.delenv("EXPERTMESH_STATE_URL", raising=False)
    assert main(["experts"]) == 2
    assert "kubectl port-forward svc/<release>-expertmesh-redis 6379" in capsys.readouterr().err
    monkeypatch.setattr("expertmesh.store.open_store", lambda url: open_store("memory://"))
    assert main(["experts", "--state-url", "redis://empty:6379/0"]) == 2
    assert "no routing table in redis://empty:6379/0 yet" in capsys.readouterr().err
