"""`expertmesh group serve`: expert groups as plain processes, without Ray.

Real processes on loopback: two groups register in a real Redis (database
``DATABASE``, this module's own) as RayService replicas do, a router over that
store reaches them by shared memory and answers exactly as stock transformers;
SIGTERM stops a group cleanly; a group started again after a live move loads what the
stored routing table lists it with, not what it was first started with; a wrong group name is a one-line
error; and
`expertmesh bench dispatch` and `bench serve` with `--groups-as process` run on such
groups with Ray, redis-py and the OpenTelemetry SDK unimportable (as on the GPU
machine), reporting transports, memory and that the answers are transformers'."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import redis
import torch
from tests.helpers import environment_without_gpu_machine_absentees
from transformers import AutoModelForCausalLM

from expertmesh.contracts import group_map as placement_mod
from expertmesh.contracts.routing_table import ModelIdentity, RoutingTable
from expertmesh.expert_group.local_server import runtime_dir
from expertmesh.expert_group.runtime import GroupSpec, start_pairs
from expertmesh.models.checkpoint import Checkpoint, experts_modules
from expertmesh.platform.group_processes import start_groups
from expertmesh.store import open_store
from helpers import bare_dispatcher, held_pairs

DATABASE = 13


@pytest.fixture
def store_url(redis_url):
    url = redis_url.rsplit("/", 1)[0] + f"/{DATABASE}"
    redis.Redis.from_url(url).flushdb()
    yield url
    redis.Redis.from_url(url).flushdb()


def test_plain_process_groups_register_and_serve_a_router_exactly(tiny_checkpoints, store_url):
    path = tiny_checkpoints("mixtral")
    spec = Checkpoint(path).spec
    groups = start_groups(["g0", "g1"], ["--model", str(path), "--groups", "2", "--state-url", store_url])
    store = open_store(store_url)
    try:
        assert store.endpoints() == {name: group.address for name, group in groups.items()}
        placement = placement_mod.contiguous(spec, 2)
        assert store.publish_routing_table(RoutingTable.from_placement(placement, spec.num_experts, version=1))
        dispatcher = bare_dispatcher(store, spec.moe_layers)
        stock = experts_modules(AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager"))
        g = torch.Generator().manual_seed(0)
        for layer in spec.moe_layers:
            hidden = torch.randn(10, spec.hidden_size, generator=g)  # [T, H]
            index = torch.stack([torch.randperm(spec.num_experts, generator=g)[: spec.top_k] for _ in range(10)])
            weights = torch.rand(10, spec.top_k, generator=g)
            with torch.no_grad():
                expected = stock[layer][1](hidden, index, weights)
            torch.testing.assert_close(dispatcher.dispatch(layer, hidden, index, weights), expected, rtol=0, atol=1e-6)
        assert dispatcher.transports() == {"g0": "shm", "g1": "shm"}
        dispatcher.close()
        pids = {str(group.proc.pid) for group in groups.values()}
        sockets = [p for p in runtime_dir().glob("*.sock") if p.name.split("-")[0] in pids]
        assert len(sockets) == 4, "each group listens on a gRPC unix socket and a shared-memory socket"
        assert all(group.stop() == 0 for group in groups.values()), "SIGTERM stops a group cleanly"
        assert not any(p.exists() for p in sockets), "their socket files go with them"
    finally:
        for group in groups.values():
            group.stop()
        store.close()


def test_a_group_started_again_loads_what_the_routing_table_lists_it_with(tiny_checkpoints, store_url):
    """g0 gains g1's first expert and gives away its own first one in (simulated) live moves: the table says so.
    Started again with the same arguments, as Kubernetes or Serve restarts a replica, g0 holds what the table
    lists, and a router dispatching the moved expert to it gets transformers' answer."""
    path = tiny_checkpoints("mixtral")
    spec = Checkpoint(path).spec
    argv = ["--model", str(path), "--groups", "2", "--state-url", store_url]
    groups = start_groups(["g0", "g1"], argv)
    store = open_store(store_url)
    try:
        placement = placement_mod.contiguous(spec, 2)
        g0, g1 = list(placement.groups["g0"]), list(placement.groups["g1"])
        assert held_pairs(groups["g0"].address) == set(g0)
        moved_in, moved_out = g1[0], g0[0]
        table = RoutingTable.from_placement(placement, spec.num_experts, version=1, model=ModelIdentity.of(spec))
        replicas = dict(table.replicas)
        replicas[moved_in] = ("g1", "g0")
        replicas[moved_out] = ("g1",)  # (its copy on g1 came first, make before break)
        assert store.publish_routing_table(RoutingTable(2, spec.num_experts, replicas, model=table.model))
        assert groups.pop("g0").stop() == 0
        groups.update(start_groups(["g0"], argv))
        assert held_pairs(groups["g0"].address) == {*g0, moved_in} - {moved_out}
        assert held_pairs(groups["g1"].address) == set(g1), "g1 was not restarted: it still holds what it started with"
        store.publish_routing_table(
            RoutingTable(3, spec.num_experts, {**replicas, moved_in: ("g0",)}, model=table.model)
        )
        dispatcher = bare_dispatcher(store, spec.moe_layers)
        stock = experts_modules(AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager"))
        layer, expert = moved_in
        hidden = torch.randn(4, spec.hidden_size, generator=torch.Generator().manual_seed(0))  # [T, H]
        index = torch.full((4, spec.top_k), expert)
        index[:, 1:] = torch.tensor([e for lay, e in g1 if lay == layer and e != expert][: spec.top_k - 1])  # on g1
        weights = torch.full((4, spec.top_k), 1 / spec.top_k)
        with torch.no_grad():
            expected = stock[layer][1](hidden, index, weights)
        torch.testing.assert_close(dispatcher.dispatch(layer, hidden, index, weights), expected, rtol=0, atol=1e-6)
        dispatcher.close()
    finally:
        for group in groups.values():
            group.stop()
        store.close()


def test_a_starting_group_takes_the_tables_pairs_only_from_a_newer_table_of_its_model_that_lists_it():
    model = ModelIdentity("abc", (0, 1), 4)
    spec = GroupSpec("g0", "/m", pairs=((0, 0), (1, 0)), table_after=3)
    moved = {(0, 0): ("g1",), (0, 1): ("g0",), (1, 0): ("g0",)}

    def table(version: int, replicas=moved, of=model) -> RoutingTable:
        return RoutingTable(version, 4, replicas, model=of)

    assert start_pairs(spec, table(4), model) == ((0, 1), (1, 0)), "a table after the deployer's: it wins"
    assert start_pairs(spec, table(3), model) == spec.pairs, "the table from before the deployer's first one"
    assert start_pairs(spec, None, model) == spec.pairs
    assert start_pairs(spec, table(4, of=ModelIdentity("other", (0, 1), 4)), model) == spec.pairs
    assert start_pairs(spec, table(4, {(0, 0): ("g1",)}), model) == spec.pairs, "a table that does not list it"
    stray = table(4, {**moved, (0, 9): ("g0",)})  # expert 9 of a 4-expert model: the router refuses this table
    assert start_pairs(spec, stray, model) == spec.pairs, "a table with a pair the model does not have"
    uneven = RoutingTable(4, 4, {**moved, (0, 1): ("g0", "g1")}, shares={(0, 1): (1.0,)}, model=model)
    assert start_pairs(spec, uneven, model) == spec.pairs, "a table whose shares do not match its replicas"
    assert start_pairs(GroupSpec("g0", "/m", pairs=((0, 0),)), table(1), model) == ((0, 1), (1, 0)), "no bound"
    assert start_pairs(spec, table(4, {(0, 0): ("g0",), (1, 0): ("g0", "g1")}), model) is spec.pairs, "the same"


def test_a_group_of_another_checkpoint_is_refused_before_it_loads_or_registers(tiny_checkpoints, store_url):
    """g1 started from another checkpoint of the same shapes (a wrong volume) into a deployment whose routing
    table is this model's: one line naming both checkpoints, exit 2, and g1's address in the store is still the
    good one's."""
    path, foreign = tiny_checkpoints("mixtral"), tiny_checkpoints("mixtral", seed=1)
    spec = Checkpoint(path).spec
    store = open_store(store_url)
    placement = placement_mod.contiguous(spec, 2)
    table = RoutingTable.from_placement(placement, spec.num_experts, version=1, model=ModelIdentity.of(spec))
    assert store.publish_routing_table(table)
    store.set_endpoint("g1", "127.0.0.1:50101")
    argv = ["group", "serve", "--model", str(foreign), "--groups", "2", "--group", "g1", "--state-url", store_url]
    result = subprocess.run(
        [sys.executable, "-m", "expertmesh.cli.main", *argv], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(
        "expertmesh group: error: expert group g1 holds another model than this deployment's routing table is for "
        f"(checkpoint fingerprint {Checkpoint(foreign).spec.fingerprint}, not {spec.fingerprint})"
    ), line
    assert store.endpoints() == {"g1": "127.0.0.1:50101"}
    store.close()


def test_a_group_the_placement_does_not_have_is_a_one_line_error(tiny_checkpoints):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "expertmesh.cli.main",
            "group",
            "serve",
            "--model",
            str(tiny_checkpoints("mixtral")),
            "--groups",
            "2",
            "--group",
            "g7",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "expertmesh group: error: the placement has no group 'g7'; its groups: g0, g1 (--empty: start it holding none)"
    )


def test_bench_dispatch_runs_on_plain_process_groups_without_ray(tiny_checkpoints, tmp_path):
    """As on the GPU machine: Ray, redis-py and the OpenTelemetry SDK are not importable at all."""
    env = environment_without_gpu_machine_absentees(tmp_path)
    out = tmp_path / "dispatch.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "expertmesh.cli.main",
            "bench",
            "dispatch",
            "--model",
            str(tiny_checkpoints("mixtral")),
            "--groups-as",
            "process",
            "--transport",
            "grpc",
            "--prefill-tokens",
            "16",
            "--batches",
            "1",
            "--decode-steps",
            "2",
            "--repeats",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 expert groups (plain processes), transport grpc (carried by grpc-stream)" in result.stdout
    assert "starting Ray" not in result.stderr
    data = json.loads(out.read_text())
    assert data["setup"]["transports"] == {"g0": "grpc-stream", "g1": "grpc-stream"}
    memory = data["memory"]
    assert set(memory["groups_peak_bytes"]) == {"g0", "g1"} and all(n > 0 for n in memory["groups_peak_bytes"].values())
    assert 0 < memory["baseline_bytes"] <= memory["monolithic_bytes"] <= memory["bench_process_peak_bytes"]
    assert memory["router_bytes"] >= memory["baseline_bytes"]


@pytest.mark.parametrize(
    "groups_as, runner", [("process", "groups as plain processes"), ("in-process", "groups in its process")]
)
def test_bench_serve_runs_on_groups_on_this_host_without_ray(tiny_checkpoints, tmp_path, groups_as, runner):
    """`bench serve --groups-as process`, as the GPU machine runs it: the serving engine, its gRPC API and the
    groups without Ray, redis-py or the OpenTelemetry SDK; the streamed tokens are transformers' own. The same
    with the groups in the router's process, called in place (`--groups-as in-process`): every MoE layer's call
    went in place (the router's per-transport call counts), and the answers are still transformers' own."""
    out = tmp_path / "serve.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "expertmesh.cli.main",
            "bench",
            "serve",
            "--model",
            str(tiny_checkpoints("mixtral")),
            "--groups-as",
            groups_as,
            "--clients",
            "2",
            "--requests-per-client",
            "1",
            "--max-new-tokens",
            "4",
            "--prompt-tokens",
            "16",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=environment_without_gpu_machine_absentees(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["setup"]["platform"].startswith(f"in-process expertmesh up (local data plane, {runner}")
    assert data["setup"]["transports"] == {
        g: "in-process" if groups_as == "in-process" else "shm" for g in ("g0", "g1")
    }
    assert data["setup"]["device"] == "cpu" and data["agreement"]["passed"]
    assert [r["tokens"] for r in data["runs"]] == [8, 8, 8]
    assert "same answers: PASS" in result.stdout and "starting Ray" not in result.stderr
