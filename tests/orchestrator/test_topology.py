"""Topology from the YAML file, from Kubernetes node JSON, and from NVML.

NVML is faked only at the device-query level: the test monkeypatches the pynvml
functions ``discover_nvml`` calls (nvmlInit, nvmlShutdown, nvmlDeviceGetCount,
nvmlDeviceGetHandleByIndex, nvmlDeviceGetPciInfo, nvmlDeviceGetMemoryInfo,
nvmlDeviceGetNumaNodeId, nvmlDeviceGetNvLinkState, nvmlDeviceGetNvLinkRemotePciInfo)
with fakes of the same signatures that return the real ctypes structures
(``nvmlPciInfo_t`` with a bytes ``busId``, ``c_nvmlMemory_t`` with ``total`` in
bytes) and raise ``pynvml.NVMLError(NVML_ERROR_NOT_SUPPORTED)`` where a driver does.
"""

import ctypes
import json

import pytest

from expertmesh.contracts.errors import InputError
from expertmesh.contracts.topology import parse_topology_yaml, topology_from_k8s_nodes

FILE = """
nodes:
  - name: node-0
    islands:                # NVLink islands
      - name: nvl-0
        numa: 0
        gpus: [{id: 0, memory_gb: 80}, {id: 1, memory_gb: 80}]
"""


def test_file_format_is_accepted_as_is():
    topo = parse_topology_yaml(FILE)
    assert [g.gpu.id for g in topo.sites()] == [0, 1]
    island = topo.nodes[0].islands[0]
    assert (island.name, island.numa, island.gpus[0].memory_gb) == ("nvl-0", 0, 80.0)
    text = topo.render()
    assert "node node-0" in text and "numa 0" in text and "island nvl-0" in text and "gpu 1: 80 GB" in text


def test_islands_are_per_node_unless_they_share_a_clique():
    doc = """
nodes:
  - {name: a, islands: [{name: nvl-0, gpus: [{id: 0}]}, {name: nvl-1, clique: c1, gpus: [{id: 1}]}]}
  - {name: b, islands: [{name: nvl-0, gpus: [{id: 2}]}, {name: x, clique: c1, gpus: [{id: 3}]}]}
"""
    sites = parse_topology_yaml(doc).sites()
    assert [s.island for s in sites] == [0, 1, 2, 1]
    assert [s.node for s in sites] == [0, 0, 1, 1]


@pytest.mark.parametrize(
    "doc, message",
    [
        (
            "nodes:\n - {name: a, islands: [{gpus: [{id: 0}]}]}\n - {name: b, islands: [{gpus: [{id: 0}]}]}",
            "GPU id 0 appears twice",
        ),
        ("nodes:\n - {name: a, islands: []}", "node 'a' has no GPUs"),
        ("nodes:\n - {name: a}", "node 'a' has no GPUs"),
        ("nodes: []", "no nodes"),
        ("nodes:\n - {name: a, islands: [{gpus: [{id: x}]}]}", "id must be a non-negative integer"),
        (
            "nodes:\n - {name: a, islands: [{gpus: [{id: 1, memory_gb: lots}]}]}",
            "memory_gb must be a non-negative number",
        ),
        ("nodes:\n - {name: a, islands: [{numa: zero, gpus: [{id: 1}]}]}", "numa must be an integer"),
        ("nodes: {a: 1}", "nodes must be a list"),
        ("gpus: 8", "mapping with a 'nodes' list"),
        ("nodes: [", "not valid YAML"),
    ],
)
def test_file_errors_are_clear(doc, message):
    with pytest.raises(InputError, match=message):
        parse_topology_yaml(doc)


def _k8s_node(name, count=None, memory=None, clique=None, capacity=None):
    labels = {"kubernetes.io/hostname": name}
    if count is not None:
        labels["nvidia.com/gpu.count"] = str(count)
    if memory is not None:
        labels["nvidia.com/gpu.memory"] = str(memory)
    if clique is not None:
        labels["nvidia.com/gpu.clique"] = clique
    status = {"capacity": {"cpu": "96", **({"nvidia.com/gpu": str(capacity)} if capacity is not None else {})}}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}, "status": status}


def test_k8s_labels_give_nodes_islands_and_cluster_unique_ids():
    doc = {
        "apiVersion": "v1",
        "kind": "List",
        "items": [
            _k8s_node("gpu-b", count=2, memory=81559),
            _k8s_node("cpu-pool-1"),
            _k8s_node("gpu-a", capacity=4, memory=81559),
            _k8s_node("nvl72-1", count=4, memory=189471, clique="uuid.7"),
            _k8s_node("nvl72-0", count=4, memory=189471, clique="uuid.7"),
        ],
    }
    topo = topology_from_k8s_nodes(json.loads(json.dumps(doc)))
    assert [n.name for n in topo.nodes] == ["gpu-a", "gpu-b", "nvl72-0", "nvl72-1"]
    sites = topo.sites()
    assert [s.gpu.id for s in sites] == list(range(14))
    assert sites[0].gpu.memory_gb == pytest.approx(79.6, abs=0.1)
    # The two NVL72 nodes share one clique, hence one NVLink domain.
    assert {s.island for s in sites if s.node >= 2} == {2}
    assert len(topo.island_keys()) == 3


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"items": [_k8s_node("cpu")]}, "no node reports GPUs"),
        ({"kind": "Node"}, "List object with 'items'"),
        ({"items": [_k8s_node("g", count="eight")]}, "must be an integer"),
        ({"items": [{"status": {}}]}, "has no metadata"),
    ],
)
def test_k8s_errors(doc, message):
    with pytest.raises(InputError, match=message):
        topology_from_k8s_nodes(doc)


class _FakeNvml:
    """An 8-GPU HGX board: GPUs 0-3 on NUMA 0 and 4-7 on NUMA 1; GPUs 0-5 share NVSwitches,
    GPUs 6 and 7 are linked only to each other."""

    def __init__(self, pynvml):
        self.pynvml = pynvml
        self.calls = []

    def bus(self, i):
        return f"00000000:{0x18 + i:02X}:00.0"

    def links(self, i):
        if i < 6:
            return [f"00000000:{0xA0 + k:02X}:00.0" for k in range(4)]  # NVSwitch bus ids
        return [self.bus(13 - i)] * 2

    def install(self, monkeypatch):
        p = self.pynvml

        # Real handles are opaque c_nvmlDevice_t pointers; the fake encodes index + 1 as the address.
        def nvmlDeviceGetHandleByIndex(index):
            return ctypes.cast(index + 1, p.c_nvmlDevice_t)

        def index_of(handle):
            return ctypes.cast(handle, ctypes.c_void_p).value - 1

        def nvmlDeviceGetPciInfo(handle):
            info = p.nvmlPciInfo_t()
            info.busId = self.bus(index_of(handle)).encode()
            return info

        def nvmlDeviceGetMemoryInfo(handle, version=None):
            mem = p.c_nvmlMemory_t()
            mem.total = 80 * 2**30
            return mem

        def nvmlDeviceGetNumaNodeId(handle):
            return index_of(handle) // 4

        def nvmlDeviceGetNvLinkState(device, link):
            if link >= len(self.links(index_of(device))):
                raise p.NVMLError(p.NVML_ERROR_NOT_SUPPORTED)
            return p.NVML_FEATURE_ENABLED

        def nvmlDeviceGetNvLinkRemotePciInfo(device, link):
            info = p.nvmlPciInfo_t()
            info.busId = self.links(index_of(device))[link].encode()
            return info

        monkeypatch.setattr(p, "nvmlInit", lambda: self.calls.append("init"))
        monkeypatch.setattr(p, "nvmlShutdown", lambda: self.calls.append("shutdown"))
        monkeypatch.setattr(p, "nvmlDeviceGetCount", lambda: 8)
        for fn in (
            nvmlDeviceGetHandleByIndex,
            nvmlDeviceGetPciInfo,
            nvmlDeviceGetMemoryInfo,
            nvmlDeviceGetNumaNodeId,
            nvmlDeviceGetNvLinkState,
            nvmlDeviceGetNvLinkRemotePciInfo,
        ):
            monkeypatch.setattr(p, fn.__name__, fn)


def test_nvml_discovery_groups_gpus_into_islands(monkeypatch):
    pynvml = pytest.importorskip("pynvml")
    from expertmesh.orchestrator.topology_discovery import discover_nvml

    fake = _FakeNvml(pynvml)
    fake.install(monkeypatch)
    topo = discover_nvml("hgx-0")
    assert fake.calls == ["init", "shutdown"]
    (node,) = topo.nodes
    assert node.name == "hgx-0"
    assert [[g.id for g in i.gpus] for i in node.islands] == [[0, 1, 2, 3, 4, 5], [6, 7]]
    assert [i.numa for i in node.islands] == [None, 1]  # the switch island spans both sockets
    assert [g.numa for g in node.islands[0].gpus] == [0, 0, 0, 0, 1, 1]
    assert node.islands[0].gpus[0].memory_gb == 80.0


def test_nvml_unavailable_is_a_clear_error(monkeypatch):
    pynvml = pytest.importorskip("pynvml")
    from expertmesh.orchestrator.topology_discovery import discover_nvml

    def fail():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    with pytest.raises(InputError, match="NVML is not available"):
        discover_nvml()
