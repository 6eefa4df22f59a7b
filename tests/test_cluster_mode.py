"""The Kubernetes shape of the platform on one machine: expert groups built by
``build_app`` (what a KubeRay RayService runs from ``serveConfigV2``) that
register themselves in a real redis-server, the ``expertmesh orchestrator``
process publishing the routing table from a placement file it keeps watching,
and ``expertmesh up --router-only`` serving from what the store holds. Only the
Kubernetes API server and KubeRay operator are absent: Serve is driven
directly with the same applications (one per group) and args."""

import functools
import os
import re
import signal
import subprocess
import sys
import threading

import grpc
import pytest
import redis
import torch
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ray import serve
from transformers import AutoModelForCausalLM

from expertmesh.client import Client
from expertmesh.expert_group.deployment import build_app
from expertmesh.infra.ports import free_port_range
from expertmesh.models.tiny import make_tiny_checkpoint
from expertmesh.orchestrator.kube.groups import group_app
from expertmesh.store import open_store
from helpers import first_line, orchestrator_argv, serving_address, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.redis]


def _placement(hot_only: bool) -> dict:
    layer1_a = [1] if hot_only else [0, 1]
    return {"groups": {"a": {0: [0, 1], 1: layer1_a}, "b": {"*": ["2-3"]}, "hot": {1: [0]}}}


def _spawn(*args):
    proc = subprocess.Popen(
        [sys.executable, "-m", "expertmesh.cli.main", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    return proc, lines


#: its processes start Ray Serve groups, an orchestrator and a router: longer than the default wait
_wait = functools.partial(wait_for, timeout_s=120, poll_s=0.2)


def _held(store, group: str) -> frozenset:
    """What ``group``'s Describe says it holds."""
    from expertmesh.orchestrator.migration.group_calls import GroupChannels

    channels = GroupChannels(store.endpoints)
    try:
        return channels.describe(group).pairs
    finally:
        channels.close()


def test_groups_orchestrator_and_router_only_through_redis(tmp_path, redis_url, ray_session):
    model = make_tiny_checkpoint("mixtral", tmp_path / "mixtral", with_tokenizer=True, vocab_size=300)
    store = open_store(redis_url)
    store._kv._client.flushdb()
    placement_file = tmp_path / "placement.yaml"
    placement_file.write_text(yaml.safe_dump(_placement(hot_only=False)))

    procs, apps = [], []
    try:
        port_base = free_port_range(3)
        # one application per group, as the chart renders serveConfigV2 (``group_app``; tests/helm checks the two)
        placement = yaml.safe_load(placement_file.read_text())["groups"]
        common = {"model": str(model), "state_url": redis_url, "host": "127.0.0.1", "port_base": port_base}
        apps = [
            group_app(g, common | {"num_cpus": 0.25}, port=port_base + i, gpus=0, island="", experts=placement[g])
            for i, g in enumerate(sorted(placement))
        ]
        serve.run_many([serve.RunTarget(build_app(a["args"]), name=a["name"], route_prefix=None) for a in apps])
        endpoints = store.endpoints()
        assert endpoints == {g: f"127.0.0.1:{port_base + i}" for i, g in enumerate(["a", "b", "hot"])}

        orchestrator, orch_log = _spawn(
            "orchestrator",
            "--state-url",
            redis_url,
            "--model",
            str(model),
            "--placement",
            str(placement_file),
            "--admin-port",
            "0",
            "--admin-host",
            "127.0.0.1",
            "--interval",
            "0.3",
        )
        procs.append(orchestrator)
        _wait(lambda: store.routing_table_version() == 1, "the first routing table")
        _wait(lambda: any("admin gRPC on" in line for line in orch_log), "the orchestrator's admin port")
        admin = next(re.search(r"admin gRPC on (\S+:\d+)", l).group(1) for l in orch_log if "admin gRPC on" in l)
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(admin))
        _wait(lambda: _serving(health), "the orchestrator's health")
        assert store.routing_table().replicas[(1, 0)] == ("a", "hot")

        router, router_log = _spawn(
            "up", "--router-only", "--model", str(model), "--state-url", redis_url, "--port", "0"
        )
        procs.append(router)
        banner = first_line(router, timeout=300)
        assert "expertmesh is serving" in banner, "".join(router_log)[-3000:]
        router_address = serving_address(banner)

        prompt = [5, 9, 77, 3]
        stock = AutoModelForCausalLM.from_pretrained(model, experts_implementation="eager").eval()
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(8):
                ids.append(int(stock(torch.tensor([ids])).logits[0, -1].argmax()))
        with Client(router_address) as client:

            def tokens():
                chunks = list(client.generate(prompt, max_new_tokens=8, stop_at_eos=False))
                return [t for c in chunks for t in c.token_ids]

            assert tokens() == ids[len(prompt) :]
            # An operator edits the placement: layer 1 expert 0 now only on "hot".
            placement_file.write_text(yaml.safe_dump(_placement(hot_only=True)))
            # applied as a live evict from "a" (make before break), not a table overwrite: "a" lets the expert go
            _wait(lambda: store.routing_table_version() == 2, "the orchestrator to publish version 2")
            assert store.routing_table().replicas[(1, 0)] == ("hot",)
            _wait(lambda: (1, 0) not in _held(store, "a"), "group a to unload layer 1 expert 0")
            assert tokens() == ids[len(prompt) :]
            assert client.models()[0].routing_table_version == 2
            # A broken edit is refused and the last good table stays.
            placement_file.write_text(yaml.safe_dump({"groups": {"a": {"*": [0]}}}))
            _wait(lambda: any("is invalid, keeping routing table version 2" in l for l in orch_log), "the refusal")
            assert store.routing_table_version() == 2

            # Redis flushed: the router serves on its cached table, the groups register again and the
            # orchestrator restores the table at a later version than any router has seen.
            placement_file.write_text(yaml.safe_dump(_placement(hot_only=True)))
            redis.Redis.from_url(redis_url).flushdb()
            assert tokens() == ids[len(prompt) :]
            _wait(lambda: store.routing_table_version() == 3, "the orchestrator to restore the table as version 3")
            _wait(lambda: set(store.endpoints()) == {"a", "b", "hot"}, "the groups to register again")
            # rebuilt from what the groups hold (the edit above was applied as an evict: "a" unloaded the expert)
            assert store.routing_table().replicas[(1, 0)] == ("hot",)
            assert (1, 0) not in _held(store, "a")
            _wait(lambda: client.models()[0].routing_table_version == 3, "the router to take version 3")
            assert tokens() == ids[len(prompt) :]

        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        assert router.wait(timeout=60) == 0
        assert orchestrator.wait(timeout=60) == 0

        # The router published its load window to Redis on the way out; export sums all routers.
        out = tmp_path / "stats.json"
        export = subprocess.run(
            [
                sys.executable,
                "-m",
                "expertmesh.cli.main",
                "stats",
                "export",
                "--state-url",
                redis_url,
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert export.returncode == 0, export.stderr
        stats = yaml.safe_load(out.read_text())
        routed = (len(prompt) + 7) * 4  # four generations: prompt prefill + 7 decode steps each
        assert [sum(row) for row in stats["load"]] == [routed * 2] * 2  # x top-2, in both MoE layers
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for app in apps:
            serve.delete(app["name"])
        store.close()


def _serving(health) -> bool:
    try:
        return (
            health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
            == health_pb2.HealthCheckResponse.SERVING
        )
    except grpc.RpcError:
        return False


def test_router_only_and_orchestrator_refuse_an_in_process_store(tmp_path):
    model = make_tiny_checkpoint("mixtral", tmp_path / "m")
    for args in (
        ["up", "--router-only", "--model", str(model)],
        ["orchestrator", "--model", str(model), "--placement", "x.yaml"],
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "expertmesh.cli.main", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={k: v for k, v in os.environ.items() if k != "EXPERTMESH_STATE_URL"},
        )
        assert proc.returncode == 2, proc.stderr
        assert "needs a shared --state-url" in proc.stderr.strip().splitlines()[-1]


def test_build_app_refuses_a_bad_placement_before_any_replica(tmp_path):
    from expertmesh.contracts.errors import PlacementError

    model = make_tiny_checkpoint("mixtral", tmp_path / "m")
    with pytest.raises(PlacementError, match="leaves 2 experts unhosted"):
        build_app({"model": str(model), "placement": {"groups": {"a": {"*": [0, 1, 2]}}}, "state_url": "redis://x"})
    with pytest.raises(ValueError, match="extra_forbidden|Extra inputs"):
        build_app({"model": str(model), "placement": {}, "state_url": "redis://x", "colour": "red"})


def test_orchestrator_on_a_taken_admin_port_exits_2(tmp_path, redis_url):
    import socket

    model = make_tiny_checkpoint("mixtral", tmp_path / "m")
    placement = tmp_path / "p.yaml"
    placement.write_text(yaml.safe_dump({"groups": {"a": {"*": ["0-3"]}}}))
    store = open_store(redis_url)
    store._kv._client.flushdb()
    store.close()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            orchestrator_argv(redis_url, model, placement, admin_port=port),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"expertmesh orchestrator: error: cannot bind the admin gRPC server to 127.0.0.1:{port}")


def test_each_group_keeps_its_version_and_port_when_another_group_changes(tmp_path):
    """``build_app``'s versions and ports, per group from its own spec: a group added (even one whose name sorts
    between others) or another group's experts changed leave a group's version and port as they were."""
    from expertmesh.contracts.errors import PlacementError
    from expertmesh.expert_group.deployment import GroupsAppArgs, group_specs, group_version

    model = make_tiny_checkpoint("mixtral", tmp_path / "m")
    base = {
        "model": str(model),
        "placement": {"groups": {"a": {"*": [0, 1]}, "b": {"*": [2, 3]}}},
        "state_url": "redis://x",
        "port_base": 50100,
    }

    def built(**changes) -> dict[str, tuple[int, str]]:
        return {s.name: (s.port, group_version(s)) for s in group_specs(GroupsAppArgs.model_validate(base | changes))}

    before = built()
    assert before == built() and [port for port, _ in before.values()] == [50100, 50101]
    assert before["a"][1] != before["b"][1]
    added = built(empty=["a2"], ports={"a2": 50102})  # "a2" sorts between "a" and "b"
    assert {n: added[n] for n in ("a", "b")} == before and added["a2"][0] == 50102
    moved = built(placement={"groups": {"a": {"*": [0, 1, 2]}, "b": {"*": [2, 3]}}})
    assert moved["b"] == before["b"] and moved["a"][0] == before["a"][0] and moved["a"][1] != before["a"][1]
    assert built(resources={"b": {"expertmesh.io/island-x": 1}})["b"][1] != before["b"][1]
    alone = built(placement=None, empty=["g9"], ports={"g9": 50107})  # an application of one group added live
    assert list(alone) == ["g9"] and alone["g9"][0] == 50107
    # an application of one chart group (the chart renders one per group): only its own experts, its own port
    one = dict(placement={"groups": {"b": {"*": [2, 3]}}}, ports={"b": 50101})
    assert built(**one, placement_complete=False) == {"b": before["b"]}
    with pytest.raises(PlacementError, match="the placement leaves 4 experts unhosted"):
        built(**one)
    for changes, message in [
        (dict(empty=["a"], ports={"a": 50109}), r"empty names groups that the placement has: \['a'\]"),
        (dict(empty=["c"]), r"empty groups need their port in ports: \['c'\]"),
        (dict(empty=["c"], ports={"c": 50101}), "two groups on one port"),
        (dict(ports={"z": 1}), r"resources or ports name groups that the application does not have: \['z'\]"),
        (dict(placement=None), "needs a placement or empty groups"),
    ]:
        with pytest.raises(ValueError, match=message):
            built(**changes)
