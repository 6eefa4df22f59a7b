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

Then, on the same cluster, under load: a live migration of an expert from a group on one node to
a group on the other; a worker node lost whole (every process of its host killed); and that node
started again (``ray start`` in its host, the same resources: to Ray a new node), where Serve places
the group replica that waited for the node's island resource, the group registers its new address
and the router, its routing table unchanged, finds it there and dispatches to it again. Last, an
expert group added live on a named worker node (``expertmesh groups add --node <its IP> --wait``
against ``up --orchestrator``'s admin API; each worker declares a GPU more than its island, so the
node is the one named, not the only one with room): its Serve replica runs there, it registers that
node's address, live moves fill it and the router dispatches tokens to it across the bridge; then a
group on the other node removed (drained, its deployment gone from Serve); a ``--node`` no node has
refused with one line. No failed and no wrong request in any of them.

Marked ``multinode``, which ``make test`` deselects (``pytest -m multinode`` runs it, as root): three
Ray nodes, Serve and ``up`` take 25-45 s to start on two cores before the first assertion, the
module ~120-150 s in all (the node's return ~25 s of it, the group added and removed ~30 s), past the
~90 s a module may add to ``make test``.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
import yaml

from expertmesh.bench.chaos.hosts import TestHosts, check_can_create, plan
from expertmesh.bench.chaos.hosts_ray import HostsRayCluster, NodeSpec, island_nodes
from expertmesh.bench.report import BenchError
from expertmesh.contracts.topology import island_resource, topology_from_dict
from expertmesh.models.tiny import make_tiny_checkpoint
from helpers import serving_address, stock_greedy


def _why_not() -> str:
    try:
        check_can_create()
    except BenchError as err:
        return str(err)
    return ""


_WHY_NOT = _why_not()
pytestmark = [
    pytest.mark.multinode,
    pytest.mark.slow,
    pytest.mark.skipif(bool(_WHY_NOT), reason=_WHY_NOT or "namespaces work here"),
]

#: two worker nodes, one NVLink island of one GPU each: group gpu-0 on w1, gpu-1 on w2
TOPOLOGY = {
    "nodes": [
        {"name": "w1", "islands": [{"name": "nvl-w1", "gpus": [{"id": 0, "memory_gb": 80}]}]},
        {"name": "w2", "islands": [{"name": "nvl-w2", "gpus": [{"id": 1, "memory_gb": 80}]}]},
    ]
}
#: per MoE layer (tiny Mixtral: 2 layers x 4 experts): every expert on both GPUs (half its tokens
#: each way), except layer 0's expert 0 on GPU 0 alone (the one that moves, to GPU 1; after that a
#: lost node leaves every expert a replica on the other)
GPU_PLACEMENT = {
    "layers": [
        {
            "layer": layer,
            "experts": [
                {"expert": e, "replicas": [{"gpu": 0, "share": 1.0}]}
                if (layer, e) == (0, 0)
                else {"expert": e, "replicas": [{"gpu": 0, "share": 0.5}, {"gpu": 1, "share": 0.5}]}
                for e in range(4)
            ],
        }
        for layer in range(2)
    ]
}
GROUP_NODE = {"gpu-0": "w1", "gpu-1": "w2"}
#: GPUs each worker node declares beyond its topology's islands: room for a group added live on either
#: (``groups add --node``), so the node it lands on is the one named, not the only one with a GPU free
SPARE_GPUS = 1
ROUTER_PORT = 50051
ADMIN_PORT = 50052
#: admin calls cross hosts (the client's migrate to the orchestrator, the orchestrator's loads to the groups)
ADMIN_ENV = {"EXPERTMESH_ADMIN_TOKEN": secrets.token_hex(16)}
REDIS_PORT = 6379
PROMPT = [5, 9, 77, 3, 41]
NEW_TOKENS = 8


class Bed:
    """The hosts, the Ray cluster and ``expertmesh up`` on it, and probes run inside hosts."""

    def __init__(self, hosts: TestHosts, ray: HostsRayCluster, redis_url: str):
        self.hosts, self.ray, self.redis_url = hosts, ray, redis_url
        self.up: subprocess.Popen | None = None
        self.up_lines: list[str] = []
        self.target = ""
        self.model = None

    def drain_up(self) -> None:
        for line in self.up.stdout:
            self.up_lines.append(line)

    def up_tail(self, chars: int = 3000) -> str:
        """The last of what ``expertmesh up`` (the router and orchestrator on the head) wrote, but its
        line per finished request."""
        lines = [line for line in self.up_lines if '"logger": "expertmesh.serving.service"' not in line]
        return "--- expertmesh up:\n" + "".join(lines)[-chars:]

    def python(self, host: str, code: str, *args: str, timeout: float = 120) -> str:
        """``python -c code args`` inside ``host`` with the cluster's environment; its stdout."""
        done = subprocess.run(
            self.hosts.command(host, [sys.executable, "-c", code, *args]),
            capture_output=True,
            text=True,
            env={**self.ray.environ(), **ADMIN_ENV},
            timeout=timeout,
        )
        assert done.returncode == 0, f"probe on {host} failed:\n{done.stderr[-3000:]}"
        return done.stdout

    def json(self, host: str, code: str, *args: str, timeout: float = 120) -> object:
        return json.loads(self.python(host, code, *args, timeout=timeout).strip().splitlines()[-1])

    def cli(self, host: str, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """``expertmesh argv`` inside ``host`` against the orchestrator's admin API on the head."""
        return subprocess.run(
            self.hosts.command(host, [sys.executable, "-m", "expertmesh.cli.main", *argv]),
            capture_output=True,
            text=True,
            env={**self.ray.environ(), **ADMIN_ENV, "EXPERTMESH_ADMIN_ADDRESS": self.admin},
            timeout=timeout,
        )

    @property
    def admin(self) -> str:
        return f"{self.hosts.address('head')}:{ADMIN_PORT}"


#: inside the head: every node and every actor as the GCS knows them (ray.nodes(), and the actor table:
#: the state API's list_actors needs the dashboard, which these nodes do not run), and the resources free
RAY_STATE = """
import json, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
nodes = [{"id": n["NodeID"], "ip": n["NodeManagerAddress"], "alive": n["Alive"], "resources": n["Resources"]}
         for n in ray.nodes()]
actors = [{"name": a["Name"], "class": a["ActorClassName"], "node": a["Address"]["NodeID"], "state": a["State"]}
          for a in ray._private.state.actors().values()]
print(json.dumps({"nodes": nodes, "actors": actors, "available": ray.available_resources()}))
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
            workers = island_nodes(topology_from_dict(TOPOLOGY))
            ray.start(
                NodeSpec(num_cpus=0), {n: replace(w, num_gpus=w.num_gpus + SPARE_GPUS) for n, w in workers.items()}
            )
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
                        "--orchestrator",
                        "--admin-port",
                        str(ADMIN_PORT),
                    ],
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                # groups bind every interface of their node and advertise its address (the node's IP in Ray)
                env={**ray.environ(), "EXPERTMESH_GROUP_HOST": "0.0.0.0", **ADMIN_ENV},
            )
            for line in state.up.stdout:
                state.up_lines.append(line)
                if "expertmesh is serving" in line:
                    state.target = serving_address(line)
                    break
            assert state.target, "".join(state.up_lines)[-3000:] + _ray_errors(ray)
            # What `up` writes from now on (its warnings as groups fail over, say) is read as it comes: a pipe
            # nobody reads fills (64 KiB), and the router's next log line would block it mid-step.
            threading.Thread(target=state.drain_up, name="multinode-up-output", daemon=True).start()
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
        assert resources["GPU"] == 1 + SPARE_GPUS and resources[island_resource(island)] == 1


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


#: inside the client host: requests from ``clients`` threads until $TMPDIR/stop exists, each checked
#: against the expected tokens; "started" once the first has come back, then the counts as JSON
LOAD = """
import collections, json, os, sys, threading, time
from expertmesh.client import Client
target, prompt, n, expected, clients = sys.argv[1], *map(json.loads, sys.argv[2:6])
stop, lock, first = os.path.join(os.environ["TMPDIR"], "stop"), threading.Lock(), threading.Event()
counts = {"sent": 0, "failed": 0, "wrong": 0, "failures": collections.Counter()}
def load():
    with Client(target, timeout=60) as client:
        while not os.path.exists(stop):
            try:
                tokens = [t for c in client.generate(prompt, max_new_tokens=n, stop_at_eos=False) for t in c.token_ids]
                failure = None
            except Exception as err:
                tokens, failure = None, f"{type(err).__name__}: {str(err)[:200]}"
            with lock:
                counts["sent"] += 1
                counts["failed"] += failure is not None
                counts["wrong"] += failure is None and tokens != expected
                if failure:
                    counts["failures"][failure] += 1
            first.set()
threads = [threading.Thread(target=load) for _ in range(clients)]
for t in threads:
    t.start()
first.wait()
print("started", flush=True)
for t in threads:
    t.join()
print(json.dumps(counts))
"""

#: inside the client host: the store's replicas of each (layer, expert)
REPLICAS = """
import json, sys
from expertmesh.store import open_store
table = open_store(sys.argv[1]).routing_table()
print(json.dumps({f"{l}/{e}": list(groups) for (l, e), groups in table.replicas.items()}))
"""


class Load:
    """``LOAD`` running in the client host while the test does something to the platform."""

    def __init__(self, bed: Bed, clients: int = 2):
        from transformers import AutoModelForCausalLM

        stock = AutoModelForCausalLM.from_pretrained(bed.model, experts_implementation="eager").eval()
        expected = stock_greedy(stock, PROMPT, NEW_TOKENS)
        self.stop_file = bed.hosts.tmpdir("client") / "stop"
        self.stop_file.unlink(missing_ok=True)
        argv = [sys.executable, "-c", LOAD, bed.target, json.dumps(PROMPT), str(NEW_TOKENS), json.dumps(expected)]
        self.proc = subprocess.Popen(
            bed.hosts.command("client", [*argv, str(clients)]),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=bed.ray.environ(),
        )
        assert self.proc.stdout.readline().strip() == "started", self.proc.stderr.read()[-3000:]

    def finish(self, after_s: float) -> dict:
        """The counts, after ``after_s`` more seconds of load."""
        time.sleep(after_s)
        self.stop_file.touch()
        out, err = self.proc.communicate(timeout=180)
        assert self.proc.returncode == 0, err[-3000:]
        return json.loads(out.strip().splitlines()[-1])


def test_a_live_migration_between_groups_on_two_nodes_under_load_fails_no_request(bed):
    """Layer 0's expert 0 moves from gpu-0 (node w1) to gpu-1 (node w2) by the orchestrator's
    make-before-break migration while two clients generate: every request answers, and correctly."""
    load = Load(bed)
    migrate = bed.cli(
        "client", "migrate", "--layer", "0", "--expert", "0", "--from", "gpu-0", "--to", "gpu-1", "--wait"
    )
    counts = load.finish(after_s=2)
    print(f"[multinode] during the migration: {counts}", file=sys.stderr)
    assert migrate.returncode == 0, migrate.stdout + migrate.stderr
    assert "succeeded" in migrate.stdout, migrate.stdout
    assert counts["sent"] > 0 and counts["failed"] == 0 and counts["wrong"] == 0, counts
    replicas = bed.json("client", REPLICAS, bed.redis_url)
    assert replicas["0/0"] == ["gpu-1"], replicas


def test_a_lost_worker_node_fails_no_request_when_its_experts_have_replicas_on_the_other(bed):
    """Every process of node w1 killed (its raylet, workers and group gpu-0) under load: after the
    move above every expert has a replica on w2, so the router re-plans gpu-0's tokens onto gpu-1
    within the step and no request fails or changes."""
    replicas = bed.json("client", REPLICAS, bed.redis_url)
    assert all("gpu-1" in groups for groups in replicas.values()), replicas
    load = Load(bed)
    assert bed.ray.kill("w1") > 0
    counts = load.finish(after_s=8)
    print(f"[multinode] after node w1 was lost: {counts}", file=sys.stderr)
    assert counts["sent"] > 0 and counts["failed"] == 0 and counts["wrong"] == 0, f"{counts}\n{bed.up_tail()}"


#: inside the client host: Describe of group argv[2] at the address the store lists for it, every half second
#: until it answers (at most argv[3] seconds) and then until a router's stream has carried calls to it and it has
#: computed rows (at most argv[4] seconds more): when each first happened (seconds from the start) and the group's
#: last answer or failure
RETURNED = """
import json, sys, time
import grpc
from expertmesh.infra.group_channels import group_channel
from expertmesh.store import open_store
from expertmesh.v1 import experts_pb2 as pb, experts_pb2_grpc as pb_grpc
store, group, answer_in, call_in = open_store(sys.argv[1]), sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
start, seen = time.monotonic(), {"answered_s": None, "called_s": None}
def now():
    return round(time.monotonic() - start, 1)
while now() < (answer_in if seen["answered_s"] is None else seen["answered_s"] + call_in):
    address = store.endpoints().get(group, "")
    try:
        with group_channel(address or "127.0.0.1:1") as channel:
            r = pb_grpc.ExpertGroupStub(channel).Describe(pb.DescribeRequest(), timeout=2)
    except grpc.RpcError as err:
        seen["last"] = f"{address}: {err.code().name}"
    else:
        calls = {t.transport: t.calls for t in r.transports}
        held = sorted([e.layer, e.expert] for e in r.experts)
        rows = sum(s.rows for s in r.expert_stats)
        seen.update(address=address, pid=r.pid, calls=calls, rows=rows, held=held, last="answered")
        if seen["answered_s"] is None:
            seen["answered_s"] = now()
        if calls.get("grpc-stream") and rows:
            seen["called_s"] = now()
            break
    time.sleep(0.5)
print(json.dumps(seen))
"""
#: from the returned node's ``ray start`` until its group answers: Serve placing the replica that waited for
#: the island's resource, the replica loading its experts and registering its new address
RETURN_TIMEOUT_S = 120
#: from then until the router dispatches to it again: it finds the group at its new address (a lookup after a
#: failed call) and its circuit breaker lets a step try it (``CircuitBreakers``' cooldown)
REUSE_TIMEOUT_S = 30


def test_a_lost_worker_node_that_returns_gets_its_group_back_and_the_router_dispatches_to_it_again(bed):
    """Node w1 started again (``ray start`` in its host, the same resources) under load: Serve places
    gpu-0's replica, which has waited for w1's island resource since the node was lost, on the new node;
    it loads what the routing table lists it with (not 0/0, which moved away), registers its new address,
    the router dispatches to it again, and no request fails or changes meanwhile."""
    load = Load(bed)
    started = time.monotonic()
    bed.ray.rejoin("w1")
    joined = time.monotonic() - started
    probe = (RETURNED, bed.redis_url, "gpu-0", str(RETURN_TIMEOUT_S), str(REUSE_TIMEOUT_S))
    seen = bed.json("client", *probe, timeout=RETURN_TIMEOUT_S + REUSE_TIMEOUT_S + 60)
    counts = load.finish(after_s=1)
    print(f"[multinode] w1 rejoined in {joined:.1f} s; then gpu-0: {seen}; load: {counts}", file=sys.stderr)
    assert seen["answered_s"] is not None, (
        f"group gpu-0 did not answer within {RETURN_TIMEOUT_S} s of w1's return: {seen}\n"
        + _ray_errors(bed.ray)
        + bed.up_tail()
    )
    ip = seen["address"].rsplit(":", 1)[0]
    assert ip == bed.hosts.address("w1"), seen
    assert seen["called_s"] is not None, (
        f"the router sent gpu-0 nothing in the {REUSE_TIMEOUT_S} s after it answered again: {seen}\n{bed.up_tail()}"
    )
    # Ray: the lost node is dead, a new one is alive at w1's address, and gpu-0's replica is alive on it
    state = bed.json("head", RAY_STATE, bed.ray.address)
    at_w1 = [n for n in state["nodes"] if n["ip"] == bed.hosts.address("w1")]
    alive = [n["id"] for n in at_w1 if n["alive"]]
    assert len(at_w1) == 2 and len(alive) == 1, at_w1
    replicas = [
        a["node"]
        for a in state["actors"]
        if a["state"] == "ALIVE" and a["name"].startswith("SERVE_REPLICA::") and "#group-gpu-0#" in a["name"]
    ]
    assert replicas == alive, state["actors"]
    # the restarted replica loads what the table lists for gpu-0 (the migration above took 0/0 away), not
    # what it was first started with
    listed = sorted(
        [int(x) for x in key.split("/")]
        for key, groups in bed.json("client", REPLICAS, bed.redis_url).items()
        if "gpu-0" in groups
    )
    assert seen["held"] == listed and [0, 0] not in listed, seen
    assert counts["sent"] > 0 and counts["failed"] == 0 and counts["wrong"] == 0, f"{counts}\n{bed.up_tail()}"


#: inside the client host: the admin API's record of group argv[2] (GetGroup), as JSON
GROUP_STATUS = """
import json, sys
from google.protobuf.json_format import MessageToDict
from expertmesh.orchestrator.admin_client import call, connect
from expertmesh.v1 import admin_pb2 as pb
channel, stub = connect(sys.argv[1])
with channel:
    status = call(stub.GetGroup, pb.GetGroupRequest(name=sys.argv[2]))
print(json.dumps(MessageToDict(status, preserving_proto_field_name=True)))
"""

#: inside the head: the deployments of the groups application as Serve's controller lists them
SERVE_DEPLOYMENTS = """
import json, sys, ray
from ray import serve
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
app = serve.status().applications.get("expertmesh-groups")
print(json.dumps(sorted(app.deployments) if app else []))
"""
#: the worker node a group is added on by its IP, and the group on the other worker node removed after
ADDED_ON, REMOVED = "w1", "gpu-1"


def test_a_group_added_on_a_named_worker_node_under_load_serves_there_and_one_on_the_other_node_is_removed(bed):
    """``expertmesh groups add --node <w1's IP> --wait`` from the client host under load: Ray places the new,
    empty group's replica on w1 (its ``node:<ip>`` resource; w2 has a GPU free too), it registers w1's
    address, live moves fill it and the router on the head dispatches tokens to it across the bridge; then
    ``groups remove gpu-1`` (on w2) drains it and Serve drops its deployment. A ``--node`` no node has is
    refused with one line. No request fails or changes."""
    missing = bed.cli("client", "groups", "add", "--node", "w9", "--admin", bed.admin)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing.stdout + missing.stderr
    assert "error: FAILED_PRECONDITION: --node w9: no alive node of the Ray cluster" in missing.stderr, missing.stderr
    node_ip = bed.hosts.address(ADDED_ON)
    load = Load(bed)
    started = time.monotonic()
    add = bed.cli("client", "groups", "add", "--node", node_ip, "--wait", "--admin", bed.admin)
    add_s = time.monotonic() - started
    assert add.returncode == 0, add.stdout + add.stderr + _ray_errors(bed.ray) + bed.up_tail()
    name = add.stdout.split()[1]  # "group g0 starting"
    status = bed.json("client", GROUP_STATUS, bed.admin, name)
    seen = bed.json("client", RETURNED, bed.redis_url, name, "30", str(REUSE_TIMEOUT_S), timeout=REUSE_TIMEOUT_S + 90)
    state = bed.json("head", RAY_STATE, bed.ray.address)
    remove = bed.cli("client", "groups", "remove", REMOVED, "--wait", "--admin", bed.admin)
    counts = load.finish(after_s=2)
    since = {k: round(status.get(k, 0) - status["requested_at"], 1) for k in ("registered_at", "first_listed_at")}
    print(
        f"[multinode] groups add --node {node_ip}: {name} serving on {ADDED_ON} {since['registered_at']} s after "
        f"the add, listed for tokens at {since['first_listed_at']} s, {status['reason']} (the command: "
        f"{add_s:.1f} s); then {seen}; remove {REMOVED}: {remove.stdout.strip().splitlines()[-1]}; load: {counts}",
        file=sys.stderr,
    )
    # the new group: its replica on w1 (Ray's actor table), its address w1's, tokens from the head to it
    assert status["phase"] == "GROUP_PHASE_SERVING" and status["experts"] > 0, status
    node_ip_of = {n["id"]: n["ip"] for n in state["nodes"] if n["alive"]}
    replicas = [
        node_ip_of.get(a["node"])
        for a in state["actors"]
        if a["state"] == "ALIVE" and a["name"].startswith("SERVE_REPLICA::") and f"#group-{name}#" in a["name"]
    ]
    assert replicas == [node_ip], state["actors"]
    # there by the share of w1's own resource it asks for (w2 had a GPU free too)
    assert state["available"][f"node:{node_ip}"] < 1, state["available"]
    assert seen["address"].rsplit(":", 1)[0] == node_ip and status["address"] == seen["address"], (seen, status)
    assert seen["called_s"] is not None and seen["rows"] > 0, f"{seen}\n{bed.up_tail()}"
    assert seen["address"] in {remote for _, remote in bed.hosts.connections("head")}
    # the removed group: drained, stopped, its deployment gone from Serve and its name from the table
    assert remove.returncode == 0 and "stopped" in remove.stdout, remove.stdout + remove.stderr + bed.up_tail()
    deployments = bed.json("head", SERVE_DEPLOYMENTS, bed.ray.address)
    assert f"group-{REMOVED}" not in deployments and f"group-{name}" in deployments, deployments
    replicas = bed.json("client", REPLICAS, bed.redis_url)
    assert all(REMOVED not in groups for groups in replicas.values()), replicas
    assert any(name in groups for groups in replicas.values()), replicas
    assert counts["sent"] > 0 and counts["failed"] == 0 and counts["wrong"] == 0, f"{counts}\n{bed.up_tail()}"
