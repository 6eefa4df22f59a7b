"""Topology discovery I/O: NVML on this machine, the Kubernetes API's nodes for a cluster.

The pure halves (grouping GPUs into islands, reading labels) are in ``topology``;
this module only gathers facts. Nodes are read with the ``kubernetes`` client
(the orchestrator pod's service account, or a kubeconfig outside a cluster), not
by running kubectl: an orchestrator image has no kubectl, and the chart grants
its service account get/list/watch on nodes for exactly this.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

from expertmesh.contracts.errors import InputError
from expertmesh.contracts.topology import (
    NvmlGpuFacts,
    Topology,
    parse_topology_yaml,
    topology_from_k8s_nodes,
    topology_from_nvml_facts,
)


def load_topology_file(path: str | Path) -> Topology:
    return parse_topology_yaml(read_text(path, "topology file"))


def load_k8s_topology(path: str | Path | None = None) -> Topology:
    """From a saved ``kubectl get nodes -o json``, or from the Kubernetes API when no path."""
    if path is not None:
        text, where = read_text(path, "k8s nodes file"), str(path)
    else:
        text, where = _list_nodes(), "the Kubernetes API's node list"
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError(f"{where} is not valid JSON: {err}") from None
    return topology_from_k8s_nodes(doc)


def _list_nodes() -> str:
    """``GET /api/v1/nodes`` as JSON text, the same document ``kubectl get nodes -o json`` prints."""
    import kubernetes
    import urllib3
    from kubernetes.client.exceptions import ApiException

    from expertmesh.orchestrator.kube.api import KubeApiError, connect

    try:
        connection = connect()
        response = kubernetes.client.CoreV1Api(connection.client).list_node(_preload_content=False, _request_timeout=60)
        return response.data.decode()
    except KubeApiError as err:
        raise InputError(f"{err}; pass --file with saved `kubectl get nodes -o json`") from None
    except ApiException as err:
        raise InputError(f"cannot list nodes: {err.status} {err.reason}") from None
    except urllib3.exceptions.HTTPError as err:
        raise InputError(f"cannot list nodes: the Kubernetes API is unreachable ({err})") from None


def discover_nvml(node_name: str | None = None) -> Topology:
    """This machine's GPUs, memory, NUMA node and NVLink peers, read through NVML."""
    try:
        import pynvml
    except ImportError:
        raise InputError("NVML discovery needs nvidia-ml-py (pip install nvidia-ml-py)") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise InputError(f"NVML is not available on this machine: {err}") from None
    try:
        facts = [_gpu_facts(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()
    return topology_from_nvml_facts(node_name or socket.gethostname(), facts)


def _gpu_facts(pynvml, index: int) -> NvmlGpuFacts:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    bus_id = _bus_id(pynvml.nvmlDeviceGetPciInfo(handle))
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total
    try:
        numa = pynvml.nvmlDeviceGetNumaNodeId(handle)
        numa = None if numa < 0 else numa  # -1: the platform reports no NUMA affinity
    except pynvml.NVMLError:
        numa = None  # older drivers lack the call; the tree then shows "numa ?"
    peers = []
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                continue
            peers.append(_bus_id(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)))
        except pynvml.NVMLError:
            # Links past the device's count, and PCIe-only GPUs, answer NOT_SUPPORTED.
            continue
    return NvmlGpuFacts(index, bus_id, int(memory), numa, tuple(peers))


def _bus_id(pci) -> str:
    raw = pci.busId
    # Bus ids are compared across calls; normalise case and the 4- vs 8-digit domain.
    text = (raw.decode() if isinstance(raw, bytes) else str(raw)).strip().lower()
    domain, _, rest = text.partition(":")
    return f"{int(domain, 16):08x}:{rest}" if rest else text


def read_text(path: str | Path, what: str) -> str:
    """A file's text, or InputError naming what it was meant to be."""
    try:
        return Path(path).read_text()
    except OSError as err:
        raise InputError(f"cannot read {what} {str(path)!r}: {err.strerror}") from None
