"""``expertmesh plan``, ``topology`` and ``bench placement`` through ``expertmesh.cli.main.main``."""

import json

import pytest

from expertmesh.bench.placement import synthetic_stats
from expertmesh.cli.main import main
from expertmesh.orchestrator.placement.stats import stats_to_dict

TOPO = """
nodes:
  - name: node-0
    islands:
      - {name: nvl-0, numa: 0, gpus: [{id: 0, memory_gb: 80}, {id: 1, memory_gb: 80}]}
      - {name: nvl-1, numa: 1, gpus: [{id: 2, memory_gb: 80}, {id: 3, memory_gb: 80}]}
  - name: node-1
    islands:
      - {name: nvl-0, numa: 0, gpus: [{id: 10, memory_gb: 80}, {id: 11, memory_gb: 80}]}
"""


@pytest.fixture
def files(tmp_path):
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps(stats_to_dict(synthetic_stats(3, 8, 2, 1.0, 3, seed=5))))
    topo = tmp_path / "topo.yaml"
    topo.write_text(TOPO)
    return tmp_path, stats, topo


def _plan(stats, topo, out, *extra):
    return main(["plan", "--stats", str(stats), "--topology", str(topo), "--out", str(out), *extra])


def test_plan_writes_the_documented_format(files, capsys):
    tmp, stats, topo = files
    out = tmp / "placement.json"
    assert _plan(stats, topo, out, "--redundant", "4") == 0
    report = capsys.readouterr().out
    assert "planner" in report and "eplb" in report and "balanced" in report
    doc = json.loads(out.read_text())
    assert set(doc) == {"layers"} and [layer["layer"] for layer in doc["layers"]] == [0, 1, 2]
    slots = {}
    for layer in doc["layers"]:
        assert [e["expert"] for e in layer["experts"]] == list(range(8))
        for e in layer["experts"]:
            gpus = [r["gpu"] for r in e["replicas"]]
            assert set(e) == {"expert", "replicas"} and all(set(r) == {"gpu", "share"} for r in e["replicas"])
            assert gpus and len(set(gpus)) == len(gpus) and set(gpus) <= {0, 1, 2, 3, 10, 11}
            assert sum(r["share"] for r in e["replicas"]) == pytest.approx(1.0)
            for g in gpus:
                slots[(layer["layer"], g)] = slots.get((layer["layer"], g), 0) + 1
    assert max(slots.values()) <= 2  # ceil((8 + 4) / 6)


def test_plan_with_current_placement_moves_nothing_when_good_enough(files, capsys):
    tmp, stats, topo = files
    first, second = tmp / "a.json", tmp / "b.json"
    assert _plan(stats, topo, first, "--redundant", "4") == 0
    assert _plan(stats, topo, second, "--redundant", "4", "--current", str(first), "--min-gain", "0.05") == 0
    assert "3 layers kept as current" in capsys.readouterr().out
    a, b = json.loads(first.read_text()), json.loads(second.read_text())
    for la, lb in zip(a["layers"], b["layers"]):
        for ea, eb in zip(la["experts"], lb["experts"]):
            assert [r["gpu"] for r in ea["replicas"]] == [
                r["gpu"] for r in eb["replicas"]
            ]  # no weight moved (shares may be re-split: free)


@pytest.mark.parametrize(
    "stats_doc, extra, message",
    [
        ("{not json", [], "stats file is not valid JSON"),
        ({"num_layers": 1, "num_experts": 2, "top_k": 1, "load": [[1, 2, 3]]}, [], "load has shape [1, 3]"),
        ({"num_layers": 1, "num_experts": 2, "top_k": 1, "load": [[1, -2]]}, [], "non-negative"),
        ({"num_layers": 1, "num_experts": 2, "top_k": 1, "load": [[1], [2, 3]]}, [], "rectangular"),
        (
            {"num_layers": 1, "num_experts": 2, "top_k": 1, "load": [[1, 2]], "coactivation": [[[0, 1], [2, 0]]]},
            [],
            "symmetric",
        ),
        ({"num_layers": 1, "num_experts": 2, "top_k": 3, "load": [[1, 2]]}, [], "top_k must be between"),
        ({"num_layers": 1, "num_experts": 2, "load": [[1, 2]]}, [], "no 'top_k'"),
        ({"num_layers": 1, "num_experts": 8, "top_k": 1, "load": [[1] * 8]}, ["--slots-per-gpu", "1"], "too few slots"),
    ],
)
def test_plan_input_errors_exit_2_with_one_line(files, capsys, stats_doc, extra, message):
    tmp, stats, topo = files
    stats.write_text(stats_doc if isinstance(stats_doc, str) else json.dumps(stats_doc))
    assert _plan(stats, topo, tmp / "p.json", "--redundant", "4", *extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("expertmesh plan: error: ") and message in err and err.count("\n") == 1
    assert not (tmp / "p.json").exists()


def test_plan_topology_and_current_errors(files, capsys):
    tmp, stats, topo = files
    empty = tmp / "empty.yaml"
    empty.write_text("nodes:\n  - {name: a, islands: []}\n")
    assert _plan(stats, empty, tmp / "p.json", "--redundant", "0") == 2
    assert "node 'a' has no GPUs" in capsys.readouterr().err
    assert _plan(tmp / "missing.json", topo, tmp / "p.json", "--redundant", "0") == 2
    assert "cannot read stats file" in capsys.readouterr().err
    bad = tmp / "cur.json"
    bad.write_text(
        json.dumps({"layers": [{"layer": 0, "experts": [{"expert": 0, "replicas": [{"gpu": 99, "share": 1}]}]}]})
    )
    assert _plan(stats, topo, tmp / "p.json", "--redundant", "0", "--current", str(bad)) == 2
    assert "names GPU 99, not in the topology" in capsys.readouterr().err


def test_topology_from_file_and_k8s(files, capsys, tmp_path):
    _, _, topo = files
    assert main(["topology", "--file", str(topo)]) == 0
    out = capsys.readouterr().out
    assert "2 nodes, 3 NVLink islands, 6 GPUs" in out and "gpu 11: 80 GB" in out
    nodes = tmp_path / "nodes.json"
    item = {"metadata": {"name": "n1", "labels": {"nvidia.com/gpu.count": "8", "nvidia.com/gpu.memory": "81920"}}}
    nodes.write_text(json.dumps({"kind": "List", "items": [item]}))
    assert main(["topology", "--source", "k8s", "--file", str(nodes), "--format", "yaml"]) == 0
    out = capsys.readouterr().out
    assert "name: n1" in out and "memory_gb: 80.0" in out
    assert main(["topology", "--source", "file"]) == 2
    assert "needs --file" in capsys.readouterr().err


def test_topology_k8s_without_file_or_credentials_says_so(monkeypatch, tmp_path, capsys):
    # Nodes come from the Kubernetes API (tests/orchestrator/test_kube_topology.py); without a
    # service account or kubeconfig the command says what to do instead.
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    assert main(["topology", "--source", "k8s"]) == 2
    err = capsys.readouterr().err
    assert "no Kubernetes credentials" in err and "pass --file with saved `kubectl get nodes -o json`" in err


def test_bench_placement_quick(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "placement", "--quick", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "quick-1node planner" in table and "quick-2node eplb" in table
    doc = json.loads(out.read_text())
    assert len(doc["cases"]) == 2
    for case in doc["cases"]:
        assert case["planner"]["balancedness"] >= case["eplb"]["balancedness"]
        assert {"cross_island", "cross_node", "max_gpu_load", "weights_moved", "plan_seconds"} <= set(case["planner"])


def test_bench_unwritable_out_is_an_input_error(tmp_path, capsys):
    assert main(["bench", "placement", "--quick", "--out", str(tmp_path / "no" / "dir.json")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_plan_incremental_starts_from_a_placement_on_other_gpus(files, capsys):
    """GPU 11 leaves the topology and GPU 12 joins it: --incremental re-homes 11's replicas, uses only the new
    topology's GPUs, and keeps what it can of the current placement (every replica it did not have to move)."""
    tmp, stats, topo = files
    first, second = tmp / "a.json", tmp / "b.json"
    assert _plan(stats, topo, first, "--redundant", "4") == 0
    changed = tmp / "topo2.yaml"
    changed.write_text(TOPO.replace("{id: 11, memory_gb: 80}", "{id: 12, memory_gb: 80}"))
    capsys.readouterr()
    assert _plan(stats, changed, second, "--redundant", "4", "--current", str(first), "--incremental") == 0
    assert "incremental:" in capsys.readouterr().out
    a, b = json.loads(first.read_text()), json.loads(second.read_text())
    kept = moved = 0
    for la, lb in zip(a["layers"], b["layers"]):
        for ea, eb in zip(la["experts"], lb["experts"]):
            before, after = {r["gpu"] for r in ea["replicas"]}, {r["gpu"] for r in eb["replicas"]}
            assert after <= {0, 1, 2, 3, 10, 12} and sum(r["share"] for r in eb["replicas"]) == pytest.approx(1.0)
            kept += len(before & after)
            moved += len(after - before)
    assert kept > moved  # most replicas stay where they were
    assert _plan(stats, changed, second, "--redundant", "4", "--incremental") == 2
    assert "--incremental re-plans from a placement: give it with --current" in capsys.readouterr().err
