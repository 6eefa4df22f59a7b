"""A real multi-node Ray cluster on test hosts (network namespaces, ``bench.chaos.hosts``) and
``expertmesh up --ray-address`` on it with a GPU placement: each expert group runs on the Ray node
whose NVLink-island resource it names, the router on the head reaches the groups by gRPC across
the bridge, and what it generates is stock transformers' greedy output.

Real: Ray's processes (``ray start`` of a head and two worker nodes, each its own GCS or raylet,
object store and workers at its host's address, token authentication on), the network stack
between hosts (veth pairs on a bridge; each host its own loopback and TMPDIR, so no same-host
socket or shared-memory path is found between them), Redis, Ray Serve, the router and the groups'
gRPC servers. Faked: GPU counts only (``ray start --num-gpus``, on a machine without GPUs; torch
sees no CUDA in the replicas, so the groups compute on CPU).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import yaml

from expertmesh.bench.chaos.hosts import TestHosts, check_can_create, plan
from expertmesh.bench.chaos.hosts_ray import HostsRayCluster, NodeSpec, island_nodes
from expertmesh.bench.report import BenchError
from expertmesh.contracts.topology import topology_from_dict
from expertmesh.expert_group.deployment import island_resource
from expertmesh.models.tiny import make_tiny_checkpoint
from helpers import serving_address, stock_greedy


def _why_not() -> str:
    try:
        check_can_create()
    except BenchError as err:
        return str(err)
    return ""


_WHY_NOT = _why_not()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(_WHY_NOT), reason=_WHY_NOT or "namespaces work here")]

#: two worker nodes, one NVLink island of one GPU each: group gpu-0 on w1, gpu-1 on w2
TOPOLOGY = {
    "nodes": [
        {"name": "w1", "islands": [{"name": "nvl-w1", "gpus": [{"id": 0, "memory_gb": 80}]}]},
        {"name": "w2", "islands": [{"name": "nvl-w2", "gpus": [{"id": 1, "memory_gb": 80}]}]},
    ]
}
#: per MoE layer (tiny Mixtral: 2 layers x 4 experts): experts 0-1 on GPU 0, 2-3 on GPU 1, and
#: expert 1 also on GPU 1 (half its tokens each way)
GPU_PLACEMENT = {
    "layers": [
        {
            "layer": layer,
            "experts": [
                {"expert": 0, "replicas": [{"gpu": 0, "share": 1.0}]},
                {"expert": 1, "replicas": [{"gpu": 0, "share": 0.5}, {"gpu": 1, "share": 0.5}]},
                {"expert": 2, "replicas": [{"gpu": 1, "share": 1.0}]},
                {"expert": 3, "replicas": [{"gpu": 1, "share": 1.0}]},
            ],
        }
        for layer in range(2)
    ]
}
GROUP_NODE = {"gpu-0": "w1", "gpu-1": "w2"}
ROUTER_PORT = 50051
REDIS_PORT = 6379
PROMPT = [5, 9, 77, 3, 41]
NEW_TOKENS = 8


def test_each_topology_node_declares_its_gpus_and_one_island_token_per_group():
    islands = [{"name": "a", "gpus": [{"id": 0}, {"id": 1}]}, {"name": "b", "gpus": [{"id": 2}]}]
    topology = topology_from_dict({"nodes": [{"name": "n", "islands": islands}]})
    a, b = island_resource("a"), island_resource("b")
    assert island_nodes(topology) == {"n": NodeSpec(1, 3, {a: 2.0, b: 1.0})}
    assert island_nodes(topology, group_per="island", num_cpus=2) == {"n": NodeSpec(2, 3, {a: 1.0, b: 1.0})}


class Bed:
    """The hosts, the Ray cluster and ``expertmesh up`` on it, and probes run inside hosts."""

    def __init__(self, hosts: TestHosts, ray: HostsRayCluster, redis_url: str):
        self.hosts, self.ray, self.redis_url = hosts, ray, redis_url
        self.up: subprocess.Popen | None = None
        self.up_lines: list[str] = []
        self.target = ""

    def python(self, host: str, code: str, *args: str, timeout: float = 120) -> str:
        """``python -c code args`` inside ``host`` with the cluster's environment; its stdout."""
        done = subprocess.run(
            self.hosts.command(host, [sys.executable, "-c", code, *args]),
            capture_output=True,
            text=True,
            env=self.ray.environ(),
            timeout=timeout,
        )
        assert done.returncode == 0, f"probe on {host} failed:\n{done.stderr[-3000:]}"
        return done.stdout

    def json(self, host: str, code: str, *args: str) -> object:
        return json.loads(self.python(host, code, *args).strip().splitlines()[-1])


#: inside the head: every node and every actor as the GCS knows them (ray.nodes(), and the actor table:
#: the state API's list_actors needs the dashboard, which these nodes do not run)
RAY_STATE = """
import json, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
nodes = [{"id": n["NodeID"], "ip": n["NodeManagerAddress"], "alive": n["Alive"], "resources": n["Resources"]}
         for n in ray.nodes()]
actors = [{"name": a["Name"], "class": a["ActorClassName"], "node": a["Address"]["NodeID"], "state": a["State"]}
          for a in ray._private.state.actors().values()]
print(json.dumps({"nodes": nodes, "actors": actors}))
"""

#: inside the client host: greedy tokens from the router, what ListModels says of its transports, the store's endpoints
GENERATE = """
import json, sys
from expertmesh.client import Client
from expertmesh.store import open_store
with Client(sys.argv[1], timeout=120) as client:
    chunks = list(client.generate(json.loads(sys.argv[2]), max_new_tokens=int(sys.argv[3]), stop_at_eos=False))
    (info,) = client.models()
store = open_store(sys.argv[4])
print(json.dumps({"tokens": [t for c in chunks for t in c.token_ids],
                  "transports": dict(info.group_transports), "endpoints": store.endpoints()}))
"""


def _ray_errors(ray: HostsRayCluster, lines: int = 40) -> str:
    """The last lines of each node's Ray worker and Serve logs that name an error: why a replica failed."""
    out = []
    for host in ("head", "w1", "w2"):
        for log in sorted(ray.logs(host).glob("*")) + sorted(ray.logs(host).glob("serve/*")):
            if log.is_file() and log.suffix in (".err", ".log", ".out"):
                text = log.read_text(errors="replace").splitlines()
                hits = [i for i, line in enumerate(text) if "Error" in line or "Traceback" in line]
                if hits:
                    out.append(f"--- {host}: {log.name}\n" + "\n".join(text[hits[0] : hits[0] + lines]))
    return "\n".join(out)[-8000:]


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    work = tmp_path_factory.mktemp("multinode")
    model = make_tiny_checkpoint("mixtral", work / "mixtral", with_tokenizer=True, vocab_size=300)
    (work / "topology.yaml").write_text(yaml.safe_dump(TOPOLOGY))
    (work / "placement.json").write_text(json.dumps(GPU_PLACEMENT))
    started = time.monotonic()
    with TestHosts(plan(["redis", "head", "w1", "w2", "client"])) as hosts:
        ray = HostsRayCluster(hosts, head="head")
        redis_url = f"redis://{hosts.address('redis')}:{REDIS_PORT}/0"
        state = Bed(hosts, ray, redis_url)
        redis_argv = ["redis-server", "--bind", hosts.address("redis"), "--port", str(REDIS_PORT)]
        redis = subprocess.Popen(
            hosts.command("redis", [*redis_argv, "--save", "", "--appendonly", "no", "--protected-mode", "no"]),
            stdout=subprocess.DEVNULL,
        )
        try:
            ray.start(NodeSpec(num_cpus=0), island_nodes(topology_from_dict(TOPOLOGY)))
            print(f"[multinode] Ray cluster of 3 nodes up after {time.monotonic() - started:.1f} s", file=sys.stderr)
            state.up = subprocess.Popen(
                hosts.command(
                    "head",
                    [
                        sys.executable,
                        "-m",
                        "expertmesh.cli.main",
                        "up",
                        "--model",
                        str(model),
                        "--ray-address",
                        ray.address,
                        "--gpu-placement",
                        str(work / "placement.json"),
                        "--topology",
                        str(work / "topology.yaml"),
                        "--state-url",
                        redis_url,
                        "--host",
                        hosts.address("head"),
                        "--port",
                        str(ROUTER_PORT),
                    ],
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                # groups bind every interface of their node and advertise its address (the node's IP in Ray)
                env={**ray.environ(), "EXPERTMESH_GROUP_HOST": "0.0.0.0"},
            )
            for line in state.up.stdout:
                state.up_lines.append(line)
                if "expertmesh is serving" in line:
                    state.target = serving_address(line)
                    break
            assert state.target, "".join(state.up_lines)[-3000:] + _ray_errors(ray)
            print(f"[multinode] serving after {time.monotonic() - started:.1f} s", file=sys.stderr)
            state.model = model
            yield state
        finally:
            if state.up is not None and state.up.poll() is None:
                state.up.terminate()
                try:
                    state.up.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    state.up.kill()
            redis.kill()
    # hosts.close() killed every process of every host (Ray's too) and deleted the namespaces


def test_the_ray_cluster_has_a_head_and_two_worker_nodes_at_their_hosts_addresses(bed):
    state = bed.json("head", RAY_STATE, bed.ray.address)
    alive = {n["ip"]: n["resources"] for n in state["nodes"] if n["alive"]}
    assert set(alive) == {bed.hosts.address(h) for h in ("head", "w1", "w2")}
    assert "GPU" not in alive[bed.hosts.address("head")]
    for node, island in (("w1", "nvl-w1"), ("w2", "nvl-w2")):
        resources = alive[bed.hosts.address(node)]
        assert resources["GPU"] == 1 and resources[island_resource(island)] == 1


def test_each_expert_group_runs_on_the_node_of_the_island_it_names(bed):
    state = bed.json("head", RAY_STATE, bed.ray.address)
    node_ip = {n["id"]: n["ip"] for n in state["nodes"]}
    replicas = {
        a["name"].split("#")[1].removeprefix("group-"): node_ip[a["node"]]
        for a in state["actors"]
        if a["state"] == "ALIVE" and a["name"].startswith("SERVE_REPLICA::") and "#group-" in a["name"]
    }
    assert replicas == {group: bed.hosts.address(node) for group, node in GROUP_NODE.items()}, state["actors"]


def test_the_router_on_the_head_reaches_the_groups_by_grpc_over_tcp_and_generates_what_transformers_does(bed):
    from transformers import AutoModelForCausalLM

    seen = bed.json("client", GENERATE, bed.target, json.dumps(PROMPT), str(NEW_TOKENS), bed.redis_url)
    stock = AutoModelForCausalLM.from_pretrained(bed.model, experts_implementation="eager").eval()
    assert seen["tokens"] == stock_greedy(stock, PROMPT, NEW_TOKENS)
    # Each group serves at its node's address, and the router's connections to it cross the bridge:
    # the head holds TCP connections to each group's port on its worker's address.
    assert set(seen["endpoints"]) == set(GROUP_NODE)
    head_conns = {remote for _, remote in bed.hosts.connections("head")}
    for group, node in GROUP_NODE.items():
        ip, port = seen["endpoints"][group].rsplit(":", 1)
        assert ip == bed.hosts.address(node)
        assert f"{ip}:{port}" in head_conns, (group, sorted(head_conns))
        assert seen["transports"][group] in ("grpc-stream", "grpc-unary"), seen["transports"]
