"""Cluster topology: nodes → NUMA nodes → NVLink islands → GPUs.

Glossary
--------
node
    One machine (a Kubernetes node, a Ray node). Traffic between nodes crosses
    the network (InfiniBand/Ethernet), the slowest hop.
NUMA node
    A CPU socket's memory domain inside a node; host-side buffers are best
    pinned on the GPU's NUMA node. Kept as an attribute of islands and GPUs,
    not as a level of its own, because one NVSwitch island may span sockets.
NVLink island
    GPUs that reach each other over NVLink (direct links or an NVSwitch). A
    token whose chosen experts all sit in one island needs no slower hop.
    Islands normally live inside one node; an island with a ``clique`` (the
    ``nvidia.com/gpu.clique`` of multi-node NVLink, e.g. GB200 NVL72) is one
    NVLink domain with every other island of the same clique, on any node.
GPU
    One device, with an ``id`` unique across the cluster and its memory in GB.

The topology file (YAML) is accepted as is::

    nodes:
      - name: node-0
        islands:
          - name: nvl-0
            numa: 0                  # optional
            clique: "uuid.1"         # optional
            gpus: [{id: 0, memory_gb: 80}, {id: 1, memory_gb: 80}]

Everything here is pure: parsing takes already-read text or already-decoded
``kubectl get nodes -o json`` objects; the I/O lives in ``topology_discovery``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from expertmesh.contracts.errors import InputError

#: the Ray custom resource a node declares for each NVLink island it has is this plus the island's name (the
#: Helm chart's worker groups and ``ray start --resources`` set it; expert groups pinned to an island request 1)
ISLAND_RESOURCE_PREFIX = "expertmesh.io/island-"


def island_resource(island: str) -> str:
    """The Ray custom resource of NVLink island ``island``: ``island_resource("nvl-0")`` is
    ``"expertmesh.io/island-nvl-0"``."""
    return f"{ISLAND_RESOURCE_PREFIX}{island}"


# GPU feature discovery labels (NVIDIA GPU operator / k8s-device-plugin).
LABEL_GPU_COUNT = "nvidia.com/gpu.count"
LABEL_GPU_MEMORY_MIB = "nvidia.com/gpu.memory"
LABEL_GPU_CLIQUE = "nvidia.com/gpu.clique"
CAPACITY_GPU = "nvidia.com/gpu"


@dataclass(frozen=True)
class Gpu:
    id: int
    memory_gb: float
    numa: int | None = None


@dataclass(frozen=True)
class Island:
    name: str
    gpus: tuple[Gpu, ...]
    numa: int | None = None
    clique: str | None = None


@dataclass(frozen=True)
class Node:
    name: str
    islands: tuple[Island, ...]


@dataclass(frozen=True)
class GpuSite:
    """Where one GPU sits, as dense indices the planner can vectorise over."""

    gpu: Gpu
    node: int  # index into Topology.nodes
    island: int  # index into Topology.island_keys(): same value = same NVLink domain


@dataclass(frozen=True)
class Topology:
    nodes: tuple[Node, ...]

    def sites(self) -> tuple[GpuSite, ...]:
        """Every GPU in tree order (node, island, listed order)."""
        keys = self.island_keys()
        out = []
        for n, node in enumerate(self.nodes):
            for island in node.islands:
                k = keys.index(_island_key(node, island))
                out.extend(GpuSite(gpu, n, k) for gpu in island.gpus)
        return tuple(out)

    def island_keys(self) -> list[tuple[str, str]]:
        """Distinct NVLink domains in first-seen order."""
        keys: list[tuple[str, str]] = []
        for node in self.nodes:
            for island in node.islands:
                key = _island_key(node, island)
                if key not in keys:
                    keys.append(key)
        return keys

    @property
    def num_gpus(self) -> int:
        return sum(len(i.gpus) for node in self.nodes for i in node.islands)

    def validate(self) -> Topology:
        if not self.nodes:
            raise InputError("topology has no nodes")
        seen: dict[int, str] = {}
        names: set[str] = set()
        for node in self.nodes:
            if node.name in names:
                raise InputError(f"topology: node name {node.name!r} appears twice")
            names.add(node.name)
            if not node.islands or not any(i.gpus for i in node.islands):
                raise InputError(f"topology: node {node.name!r} has no GPUs")
            for island in node.islands:
                if not island.gpus:
                    raise InputError(f"topology: island {island.name!r} of node {node.name!r} has no GPUs")
                for gpu in island.gpus:
                    if gpu.id in seen:
                        raise InputError(
                            f"topology: GPU id {gpu.id} appears twice (node {seen[gpu.id]!r} and node {node.name!r});"
                            " GPU ids must be unique across the cluster"
                        )
                    seen[gpu.id] = node.name
        return self

    def render(self) -> str:
        """The tree as text: node → NUMA node → NVLink island → GPU."""
        lines = [f"{len(self.nodes)} nodes, {len(self.island_keys())} NVLink islands, {self.num_gpus} GPUs"]
        for node in self.nodes:
            gpus = sum(len(i.gpus) for i in node.islands)
            lines.append(f"node {node.name} ({gpus} GPUs)")
            numas = sorted({i.numa for i in node.islands}, key=lambda v: (v is None, v))
            for numa in numas:
                lines.append(f"  numa {'?' if numa is None else numa}")
                for island in (i for i in node.islands if i.numa == numa):
                    clique = f", clique {island.clique}" if island.clique else ""
                    lines.append(f"    island {island.name} ({len(island.gpus)} GPUs{clique})")
                    for gpu in island.gpus:
                        numa = f" (numa {gpu.numa})" if gpu.numa is not None and gpu.numa != island.numa else ""
                        lines.append(f"      gpu {gpu.id}: {gpu.memory_gb:g} GB{numa}")
        return "\n".join(lines)


def _island_key(node: Node, island: Island) -> tuple[str, str]:
    # A clique is one NVLink domain across nodes; otherwise an island is local to its node.
    return ("clique", island.clique) if island.clique else (node.name, island.name)


# --- topology file -------------------------------------------------------------------------------


def parse_topology_yaml(text: str) -> Topology:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise InputError(f"topology file is not valid YAML: {_first_line(err)}") from None
    return topology_from_dict(doc)


def topology_from_dict(doc: Any) -> Topology:
    if not isinstance(doc, dict) or "nodes" not in doc:
        raise InputError("topology file must be a mapping with a 'nodes' list")
    nodes_raw = _expect(doc["nodes"], list, "nodes")
    nodes = []
    for n, node_raw in enumerate(nodes_raw):
        where = f"nodes[{n}]"
        node_raw = _expect(node_raw, dict, where)
        name = _expect(node_raw.get("name", f"node-{n}"), str, f"{where}.name")
        islands = []
        for i, isl_raw in enumerate(_expect(node_raw.get("islands", []), list, f"{where}.islands")):
            iwhere = f"{where}.islands[{i}]"
            isl_raw = _expect(isl_raw, dict, iwhere)
            numa = _optional_int(isl_raw.get("numa"), f"{iwhere}.numa")
            clique = isl_raw.get("clique")
            if clique is not None:
                clique = str(clique)
            gpus = tuple(
                _parse_gpu(g, f"{iwhere}.gpus[{k}]", numa)
                for k, g in enumerate(_expect(isl_raw.get("gpus", []), list, f"{iwhere}.gpus"))
            )
            iname = _expect(isl_raw.get("name", f"nvl-{i}"), str, f"{iwhere}.name")
            islands.append(Island(iname, gpus, numa, clique))
        nodes.append(Node(name, tuple(islands)))
    return Topology(tuple(nodes)).validate()


def topology_to_dict(topo: Topology) -> dict[str, Any]:
    """The file format back (for writing a discovered topology)."""
    nodes = []
    for node in topo.nodes:
        islands = []
        for island in node.islands:
            entry: dict[str, Any] = {"name": island.name}
            if island.numa is not None:
                entry["numa"] = island.numa
            if island.clique:
                entry["clique"] = island.clique
            entry["gpus"] = [{"id": g.id, "memory_gb": g.memory_gb} for g in island.gpus]
            islands.append(entry)
        nodes.append({"name": node.name, "islands": islands})
    return {"nodes": nodes}


def _parse_gpu(raw: Any, where: str, numa: int | None) -> Gpu:
    raw = _expect(raw, dict, where)
    if "id" not in raw:
        raise InputError(f"topology: {where} has no 'id'")
    gid = raw["id"]
    if isinstance(gid, bool) or not isinstance(gid, int) or gid < 0:
        raise InputError(f"topology: {where}.id must be a non-negative integer, got {gid!r}")
    mem = raw.get("memory_gb", 0)
    if isinstance(mem, bool) or not isinstance(mem, (int, float)) or mem < 0:
        raise InputError(f"topology: {where}.memory_gb must be a non-negative number, got {mem!r}")
    return Gpu(gid, float(mem), numa)


def _expect(value: Any, kind: type, where: str) -> Any:
    if not isinstance(value, kind):
        raise InputError(f"topology: {where} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _optional_int(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"topology: {where} must be an integer, got {value!r}")
    return value


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


# --- Kubernetes node objects ---------------------------------------------------------------------


def topology_from_k8s_nodes(doc: Any) -> Topology:
    """From ``kubectl get nodes -o json`` (a ``List`` with ``items``) or a bare list of nodes.

    Nodes are taken in name order and GPU ids numbered in that order, so the same
    cluster always yields the same ids. Nodes without GPUs (CPU pools) are skipped.
    Labels carry no NVLink detail below the node, so each node is one island
    (true of HGX/NVSwitch boards), joined across nodes when they share a clique.
    """
    items = doc.get("items") if isinstance(doc, dict) else doc
    if not isinstance(items, list):
        raise InputError("k8s nodes JSON must be a List object with 'items' (kubectl get nodes -o json)")
    parsed = []
    for k, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("metadata"), dict):
            raise InputError(f"k8s nodes JSON: items[{k}] has no metadata")
        meta = item["metadata"]
        name = meta.get("name")
        if not isinstance(name, str) or not name:
            raise InputError(f"k8s nodes JSON: items[{k}].metadata.name is missing")
        labels = meta.get("labels") or {}
        capacity = (item.get("status") or {}).get("capacity") or {}
        count = _k8s_int(labels.get(LABEL_GPU_COUNT, capacity.get(CAPACITY_GPU, 0)), name, LABEL_GPU_COUNT)
        if count == 0:
            continue
        mem_mib = _k8s_int(labels.get(LABEL_GPU_MEMORY_MIB, 0), name, LABEL_GPU_MEMORY_MIB)
        parsed.append((name, count, round(mem_mib / 1024, 1), labels.get(LABEL_GPU_CLIQUE)))
    if not parsed:
        raise InputError("k8s nodes JSON: no node reports GPUs (nvidia.com/gpu.count or capacity nvidia.com/gpu)")
    nodes = []
    next_id = 0
    for name, count, mem_gb, clique in sorted(parsed):
        gpus = tuple(Gpu(next_id + i, mem_gb) for i in range(count))
        next_id += count
        island_name = f"clique-{clique}" if clique else "nvl-0"
        nodes.append(Node(name, (Island(island_name, gpus, None, clique),)))
    return Topology(tuple(nodes)).validate()


def _k8s_int(value: Any, node: str, key: str) -> int:
    try:
        out = int(str(value))
    except ValueError:
        raise InputError(f"k8s node {node!r}: {key} must be an integer, got {value!r}") from None
    if out < 0:
        raise InputError(f"k8s node {node!r}: {key} must not be negative, got {out}")
    return out


# --- NVML facts ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class NvmlGpuFacts:
    """What NVML tells about one local GPU; plain data so grouping stays pure."""

    index: int
    bus_id: str
    memory_bytes: int
    numa: int | None
    nvlink_peers: tuple[str, ...]  # remote PCI bus ids of active NVLinks (GPUs or NVSwitches)


def topology_from_nvml_facts(node_name: str, facts: list[NvmlGpuFacts], first_id: int = 0) -> Topology:
    """One node: GPUs joined by NVLink (directly or through a shared NVSwitch) form an island."""
    if not facts:
        raise InputError(f"NVML reports no GPUs on {node_name!r}")
    parent = {f.bus_id: f.bus_id for f in facts}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for f in facts:
        for peer in f.nvlink_peers:
            parent.setdefault(peer, peer)
            a, b = find(f.bus_id), find(peer)
            if a != b:
                parent[max(a, b)] = min(a, b)
    groups: dict[str, list[NvmlGpuFacts]] = {}
    for f in sorted(facts, key=lambda f: f.index):
        groups.setdefault(find(f.bus_id), []).append(f)
    islands = []
    for k, members in enumerate(sorted(groups.values(), key=lambda m: m[0].index)):
        gpus = tuple(Gpu(first_id + m.index, round(m.memory_bytes / 2**30, 1), m.numa) for m in members)
        numas = {m.numa for m in members}
        islands.append(Island(f"nvl-{k}", gpus, numas.pop() if len(numas) == 1 else None))
    return Topology((Node(node_name, tuple(islands)),)).validate()
