"""A real multi-node Ray cluster across test hosts (``hosts.TestHosts``): the head on one host, a
worker node on each of others, each a ``ray start`` of its own (GCS, raylet, object store,
workers) at its host's address, so Ray's control and data traffic and the expert groups' gRPC
between nodes cross the bed's network stack, as between machines.

Glossary
--------
node spec
    What one node's ``ray start`` declares: CPUs, GPUs (a count only: on a machine without GPUs
    they are the one thing faked, and a group on them computes on CPU) and custom resources, e.g.
    ``expertmesh.io/island-<island>`` for each NVLink island the node has (``island_nodes``).
cluster token
    Ray's token authentication, on for every process of the cluster with one random token of the
    run's (``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN``): what a real cluster needs (a head that
    finds ``~/.ray/auth_token`` turns it on by itself, and workers without it are refused), and a
    cluster of one run never accepts a process of another.

What Ray needs in a network namespace: ``lo`` up (its processes on a node talk over loopback
too), ``--node-ip-address`` (without a default route Ray cannot guess it), a second try when a
raylet gives up on its agents (``START_ATTEMPTS``), and a temporary
directory per node (Ray's session, logs and sockets: the host's own ``TMPDIR``, which every
command on the host sees, so a driver on a node finds its raylet's sockets). No dashboard, a small
object store, usage stats off. A node is stopped by killing its host's processes (``kill``),
never by ``ray stop``, which stops every Ray on the machine.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from expertmesh.bench.chaos.hosts import TestHosts
from expertmesh.bench.report import BenchError
from expertmesh.contracts.topology import Topology, island_resource

__all__ = ["HEAD_PORT", "HostsRayCluster", "NodeSpec", "island_nodes", "start_argv"]

#: the GCS port of the head
HEAD_PORT = 6380
#: each node's object store: the groups pass no objects through it, only Serve's small calls do
OBJECT_STORE_BYTES = 80 * 2**20
START_TIMEOUT_S = 300.0
#: ``ray start`` of a node tried this often: its raylet exits when the node's dashboard agent (a
#: Python process importing aiohttp and its modules) has not written its port files within 15 s,
#: hard-coded (ray-project/ray#65983), which two busy cores sometimes miss; the node is then killed
#: whole and started again
START_ATTEMPTS = 3


@dataclass(frozen=True)
class NodeSpec:
    num_cpus: float = 1
    num_gpus: int = 0
    resources: dict[str, float] = field(default_factory=dict)


def island_nodes(topology: Topology, group_per: str = "gpu", num_cpus: float = 1) -> dict[str, NodeSpec]:
    """Per node of ``topology``, what its ``ray start`` declares for ``expertmesh up --gpu-placement``:
    its GPUs and, per NVLink island, the island resource with one unit per group the island runs
    (one per GPU with ``group_per`` "gpu", one with "island"), as the Helm chart's worker groups do.

    Example: a node "w1" with island "a" of GPUs 0 and 1 -> ``{"w1": NodeSpec(1, 2, {"expertmesh.io/island-a": 2})}``
    """
    nodes = {}
    for node in topology.nodes:
        resources = {
            island_resource(island.name): float(len(island.gpus) if group_per == "gpu" else 1)
            for island in node.islands
        }
        gpus = sum(len(island.gpus) for island in node.islands)
        nodes[node.name] = NodeSpec(num_cpus, gpus, resources)
    return nodes


def start_argv(ray: str, spec: NodeSpec, node_ip: str, head: str | None = None, port: int = HEAD_PORT) -> list[str]:
    """``ray start`` for one node at ``node_ip``: the head (``head`` None, its GCS on ``port``) or a
    worker joining the head at ``head`` ("ip:port")."""
    role = ["--head", "--port", str(port), "--include-dashboard", "false"] if head is None else ["--address", head]
    return [
        ray,
        "start",
        *role,
        "--node-ip-address",
        node_ip,
        "--num-cpus",
        f"{spec.num_cpus:g}",
        "--num-gpus",
        str(spec.num_gpus),
        *(["--resources", json.dumps(spec.resources, sort_keys=True)] if spec.resources else []),
        "--object-store-memory",
        str(OBJECT_STORE_BYTES),
        "--disable-usage-stats",
    ]


class HostsRayCluster:
    """A Ray head on ``head`` and worker nodes on other hosts of ``hosts``; ``start`` brings them up,
    ``env`` is what every process of the cluster (a driver too) must run with, ``kill`` loses a node
    and ``rejoin`` brings a lost worker node back."""

    def __init__(self, hosts: TestHosts, head: str, port: int = HEAD_PORT):
        self.hosts = hosts
        self.head = head
        self.port = port
        self.address = f"{hosts.address(head)}:{port}"
        self.env = {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(16),
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        self._ray = str(Path(sys.executable).with_name("ray"))
        #: host -> its node spec, for the nodes running
        self.nodes: dict[str, NodeSpec] = {}
        #: host -> its node spec, for every node ever started (a lost one rejoins with it)
        self.declared: dict[str, NodeSpec] = {}

    def command(self, host: str, argv: list[str]) -> list[str]:
        return self.hosts.command(host, argv)

    def environ(self) -> dict[str, str]:
        """This process's environment plus the cluster's: for ``subprocess`` calls into the bed."""
        return {**os.environ, **self.env}

    def start(self, head: NodeSpec, workers: dict[str, NodeSpec]) -> None:
        """The head, then every worker node (at once); returns when each ``ray start`` has (the node
        has registered with the GCS)."""
        self._start(self.head, head, None)
        with ThreadPoolExecutor(max(1, len(workers))) as pool:
            list(pool.map(lambda item: self._start(item[0], item[1], self.address), workers.items()))

    def _start(self, host: str, spec: NodeSpec, head: str | None) -> None:
        """``ray start`` on ``host`` (which runs nothing else yet), again after a failed try."""
        argv = start_argv(self._ray, spec, self.hosts.address(host), head, self.port)
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                done = subprocess.run(
                    self.command(host, argv),
                    capture_output=True,
                    text=True,
                    env=self.environ(),
                    timeout=START_TIMEOUT_S,
                )
            except subprocess.TimeoutExpired:
                raise BenchError(f"`ray start` on host {host} did not finish in {START_TIMEOUT_S:.0f} s") from None
            if done.returncode == 0:
                self.nodes[host] = spec
                self.declared[host] = spec
                return
            self.hosts.kill(host)  # what the failed try left (agents, log monitor) goes with it
            if attempt == START_ATTEMPTS:
                raise BenchError(
                    f"`ray start` on host {host} failed {attempt} times; the last:\n"
                    f"{(done.stdout + done.stderr)[-2000:]}\n{self._raylet_fatal(host)}"
                )

    def _raylet_fatal(self, host: str) -> str:
        """The raylet's fatal line, if it logged one: what ``ray start`` does not say."""
        log = self.logs(host) / "raylet.out"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        return next((line for line in lines if "Check failed" in line or " C " in line[:40]), "")

    def kill(self, host: str) -> int:
        """SIGKILL of every process on the node's host (its raylet, workers and their groups): the
        node lost. How many processes there were."""
        self.nodes.pop(host, None)
        return self.hosts.kill(host)

    def rejoin(self, host: str) -> None:
        """A lost worker node back: ``ray start`` on its host again, joining the head with the spec it
        had. To Ray it is a new node (another node ID) at the same address with the same resources, so
        what waits for those resources (a Serve replica of the island's group) is scheduled on it."""
        if host == self.head or host not in self.declared:
            workers = sorted(set(self.declared) - {self.head})
            raise BenchError(f"{host} is not a worker node of this cluster; its workers: {workers}")
        if host in self.nodes:
            raise BenchError(f"node {host} is running; kill it first")
        self._start(host, self.declared[host], self.address)

    def logs(self, host: str) -> Path:
        """The node's Ray logs (its latest session), as this process sees them (``session_latest``
        links to the path inside the host)."""
        sessions = sorted((self.hosts.tmpdir(host) / "ray").glob("session_2*"))
        return sessions[-1] / "logs" if sessions else self.hosts.tmpdir(host) / "ray"
