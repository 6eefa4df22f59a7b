"""Node-label topology discovery through the Kubernetes API (``topology_discovery``),
as an orchestrator pod does it with its service account: no kubectl involved."""

from __future__ import annotations

import json

from expertmesh.cli.main import main
from expertmesh.contracts.topology import topology_from_k8s_nodes, topology_to_dict
from expertmesh.orchestrator.topology_discovery import load_k8s_topology

NODES = [
    {
        "metadata": {
            "name": "gpu-b",
            "labels": {"nvidia.com/gpu.count": "8", "nvidia.com/gpu.memory": "81920", "nvidia.com/gpu.clique": "c1"},
        }
    },
    {
        "metadata": {
            "name": "gpu-a",
            "labels": {"nvidia.com/gpu.count": "8", "nvidia.com/gpu.memory": "81920", "nvidia.com/gpu.clique": "c1"},
        }
    },
    {"metadata": {"name": "cpu-0", "labels": {}}, "status": {"capacity": {"cpu": "32"}}},
]


def test_nodes_are_read_from_the_api_with_the_kubeconfig(api_server, kubeconfig, monkeypatch, capsys):
    for node in NODES:
        api_server.call(api_server.fake.put, "v1/nodes", node)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))

    topology = load_k8s_topology()
    assert topology_to_dict(topology) == topology_to_dict(topology_from_k8s_nodes({"items": NODES}))
    assert [n.name for n in topology.nodes] == ["gpu-a", "gpu-b"], "CPU nodes skipped, name order"
    assert ("GET", "/api/v1/nodes") in api_server.requests()

    assert main(["topology", "--source", "k8s", "--format", "yaml"]) == 0
    assert "name: gpu-a" in capsys.readouterr().out


def test_an_api_error_is_one_line(api_server, kubeconfig, monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    assert main(["topology", "--source", "k8s"]) == 2  # no node reports GPUs
    assert "no node reports GPUs" in capsys.readouterr().err
    saved = tmp_path / "nodes.json"
    saved.write_text(json.dumps({"kind": "List", "items": NODES}))
    assert main(["topology", "--source", "k8s", "--file", str(saved)]) == 0, "a saved node list still works"
