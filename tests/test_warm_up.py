"""Warm start (issue 44, item 4): the router's engine runs a prompt chunk and a decode step through its model runner
before it reports ready, and each expert group one compute per held layer at a decode and a prefill size before it
serves; neither counts or records anything.

The plan and the group's warm-up calls on plain data; a group's warm-up on a real ``HostedExperts``; then a real
router in this process (an expert group's gRPC server on loopback, ``DataPlane.attach`` over an in-process store,
``start_apis``: the engine, gRPC and HTTP APIs, ``/health`` and ``/metrics``) whose warm-up is held until the test
lets it go, so "not ready before, ready after" is seen rather than raced; and ``expertmesh group serve`` as a
process, with the warm-up on and off.
"""

from __future__ import annotations

import re
import threading
from contextlib import contextmanager
from types import SimpleNamespace

import grpc
import httpx2
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expertmesh.client import Client
from expertmesh.config.settings import DataPlaneConfig, ServingConfig, read_config_file
from expertmesh.contracts.group_map import GroupPlacement
from expertmesh.contracts.routing_table import ModelIdentity, RoutingTable
from expertmesh.expert_group.service import start_server
from expertmesh.infra.group_channels import group_channel
from expertmesh.models.checkpoint import Checkpoint
from expertmesh.models.hosted_experts import SMALL_RECORD_ROWS, HostedExperts, warm_up_call
from expertmesh.platform.data_plane import DataPlane
from expertmesh.platform.group_processes import start_groups
from expertmesh.platform.router_apis import start_apis
from expertmesh.serving.kv_cache_manager import KVCounters
from expertmesh.serving.model_runner import ModelRunner
from expertmesh.serving.warmup import WarmUpPlan, plan_warm_up
from expertmesh.store import open_store
from expertmesh.v1 import experts_pb2 as pb
from expertmesh.v1 import experts_pb2_grpc as pb_grpc
from helpers import serving_http, wait_for

# -- the plan ------------------------------------------------------------------------------------------------------


def test_the_plan_fills_the_step_budget_and_the_smallest_bucket():
    assert plan_warm_up(512, 32, 4096, 16, 1000) == WarmUpPlan(512, 16, 48)
    assert plan_warm_up(512, 4, 4096, 16, 1000) == WarmUpPlan(512, 4, 36), "no more decode sequences than may run"


def test_the_plan_keeps_within_the_context_and_the_pool():
    assert plan_warm_up(512, 32, 64, 16, 1000) == WarmUpPlan(48, 16, 19), "the chunk and a decode token fit 64"
    assert plan_warm_up(512, 32, 4096, 16, 40) == WarmUpPlan(512, 8, 40), "fewer decode sequences first"
    assert plan_warm_up(512, 32, 4096, 16, 20) == WarmUpPlan(256, 4, 20), "then a shorter chunk"
    assert plan_warm_up(512, 32, 4096, 16, 1) is None, "a pool of one block holds no chunk and decode step"
    assert plan_warm_up(512, 32, 16, 16, 1000) is None, "a context of 16 holds no whole block and a token after it"


def test_the_per_sequence_fallback_plans_one_decode_sequence_and_no_blocks():
    assert plan_warm_up(512, 32, 4096, 0, None) == WarmUpPlan(512, 1, 0)
    assert plan_warm_up(512, 32, 100, 0, None) == WarmUpPlan(99, 1, 0)


def test_a_group_warm_up_call_cycles_through_the_held_experts():
    hidden, ids, weights = warm_up_call((4, 6, 9), 2, 2, 8, torch.Generator().manual_seed(0))
    assert ids.tolist() == [[4, 6], [6, 9]] and hidden.shape == (2, 8)
    assert weights.tolist() == [[0.5, 0.5], [0.5, 0.5]]
    _, ids, _ = warm_up_call((3,), 4, 2, 8, torch.Generator())
    assert ids.tolist() == [[3]] * 4, "one held expert: K 1, never twice in a row"


# -- a group's warm-up -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return Checkpoint(tiny_checkpoints("mixtral"))


def test_a_group_warm_up_calls_every_held_layer_at_decode_and_prefill_size_and_records_nothing(checkpoint, monkeypatch):
    spec = checkpoint.spec
    hosted = HostedExperts(checkpoint)
    hosted.load([(layer, e) for layer in spec.moe_layers for e in (0, 1, 3)])
    calls = []
    computed = hosted._computed  # whichever path a call's size and the module take (the one fused op, or either)

    def sized(layer, held, hidden, ids, *a, **k):
        calls.append(("decode" if ids.numel() <= SMALL_RECORD_ROWS else "prefill", layer))
        return computed(layer, held, hidden, ids, *a, **k)

    monkeypatch.setattr(hosted, "_computed", sized)

    assert hosted.warm_up() > 0
    assert sorted(calls) == sorted((kind, layer) for layer in spec.moe_layers for kind in ("decode", "prefill"))
    assert all(s.calls == s.rows == s.normed == 0 for _, _, s in hosted.expert_stats()), "no statistics recorded"

    rows = 40  # a Dispatch past SMALL_RECORD_ROWS does record (what the assertion above would catch)
    assert rows * spec.top_k > SMALL_RECORD_ROWS
    layer = spec.moe_layers[0]
    hidden, ids, weights = warm_up_call((0, 1, 3), rows, spec.top_k, spec.hidden_size, torch.Generator())
    hosted.compute(layer, hidden, ids, weights)
    recorded = {e: s.rows for l, e, s in hosted.expert_stats() if l == layer}
    assert sum(recorded.values()) == rows * spec.top_k


# -- a router's warm start, end to end ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def group(checkpoint):
    """One expert group holding every expert (warmed up first, as ``RunningGroup`` does), on loopback."""
    hosted = HostedExperts(checkpoint)
    pairs = [(layer, e) for layer in checkpoint.spec.moe_layers for e in range(checkpoint.spec.num_experts)]
    hosted.load(pairs)
    server, port = start_server("g0", hosted, max_concurrent_dispatch=8, workers=2, warm_up_s=hosted.warm_up())
    yield SimpleNamespace(placement=GroupPlacement({"g0": tuple(pairs)}), address=f"127.0.0.1:{port}")
    server.stop(0)


def _describe(address: str) -> pb.DescribeResponse:
    with group_channel(address) as channel:
        return pb_grpc.ExpertGroupStub(channel).Describe(pb.DescribeRequest(), timeout=30)


def _grpc_health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = health_pb2.HealthCheckRequest(service="expertmesh.v1.Inference")
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status


@contextmanager
def served_router(checkpoint, group, monkeypatch, held: threading.Event | None = None, **settings):
    """A router over ``group`` in this process: (plane, apis, url). ``held``: its warm-up waits for this event
    (the real warm-up runs once it is set); ``settings``: DataPlaneConfig fields."""
    if held is not None:
        real = ModelRunner.warm_up

        def waiting(runner, plan):
            held.wait()
            return real(runner, plan)

        monkeypatch.setattr(ModelRunner, "warm_up", waiting)
    store = open_store("memory://")
    store.set_endpoint("g0", group.address)
    table = RoutingTable.from_placement(
        group.placement, checkpoint.spec.num_experts, version=1, model=ModelIdentity.of(checkpoint.spec)
    )
    assert store.publish_routing_table(table)
    config = DataPlaneConfig(
        model=checkpoint.path, hidden_sample_tokens=8, load_publish_s=3600, table_poll_s=0.05, **settings
    )
    plane = DataPlane.attach(config, store=store)
    apis = None
    try:
        apis = start_apis(plane, ServingConfig(port=0, http_port=0, max_active_sequences=4, max_new_tokens_cap=16))
        yield plane, apis, apis.http.url
    finally:
        if held is not None:
            held.set()
        if apis is not None:
            apis.drain_and_stop()
        plane.close()


def test_the_router_is_ready_only_once_warm_and_its_warm_up_counts_nothing(checkpoint, group, monkeypatch):
    held = threading.Event()
    with served_router(checkpoint, group, monkeypatch, held) as (plane, apis, url):
        engine = apis.grpc.engine
        forwards = []
        plane.model.register_forward_pre_hook(lambda *_: forwards.append(engine.warm_up_state.status))

        health = httpx2.get(f"{url}/health", timeout=30)
        assert health.status_code == 503
        body = health.json()
        assert body["warm_up"] in ("pending", "running") and body["warm_up_seconds"] is None
        assert any("warming up" in r for r in body["reasons"]), body["reasons"]
        assert _grpc_health(apis.grpc.port) == health_pb2.HealthCheckResponse.NOT_SERVING
        stats_before = [(e.layer, e.expert, e.calls, e.rows) for e in _describe(group.address).expert_stats]

        held.set()
        wait_for(lambda: httpx2.get(f"{url}/health", timeout=30).status_code == 200, "/health to turn ready")
        body = httpx2.get(f"{url}/health", timeout=30).json()
        assert body["status"] == "ready" and body["warm_up"] == "done" and body["warm_up_seconds"] > 0
        assert _grpc_health(apis.grpc.port) == health_pb2.HealthCheckResponse.SERVING
        assert forwards == ["running", "running"], "a prompt chunk and a decode step, through the model"

        # nothing counted: steps, KV pool and prefix cache, load window, hidden sample, group traffic, group statistics
        assert engine.steps == 0 and all(t.steps == 0 for t in engine.step_tally.totals().values())
        assert engine.kv.pool.used() == 0 and engine.kv.pool.cached() == 0 and engine.kv.counters == KVCounters()
        dispatcher = plane.dispatcher
        assert dispatcher.traffic.snapshot() == {} and dispatcher.traffic.group_tokens() == {}
        assert dispatcher.load_window.since_start().sum() == 0
        assert dispatcher.hidden_sampler.take() == {}
        stats_after = [(e.layer, e.expert, e.calls, e.rows) for e in _describe(group.address).expert_stats]
        assert stats_after == stats_before and all(calls == 0 for _, _, calls, _ in stats_after)

        # ... which a request served does move, every one of them
        with Client(f"127.0.0.1:{apis.grpc.port}", timeout=60) as client:
            list(client.generate([5, 6, 7, 8], max_new_tokens=3, stop_at_eos=False))
        assert engine.steps > 0 and dispatcher.traffic.group_tokens()
        assert dispatcher.load_window.since_start().sum() > 0 and dispatcher.hidden_sampler.take()
        assert any(e.calls > 0 for e in _describe(group.address).expert_stats)


def test_switched_off_the_router_is_ready_without_a_warm_up(checkpoint, group, monkeypatch):
    ran = []
    monkeypatch.setattr(ModelRunner, "warm_up", lambda runner, plan: ran.append(plan))
    with served_router(checkpoint, group, monkeypatch, warm_up=False) as (_, apis, url):
        wait_for(lambda: httpx2.get(f"{url}/health", timeout=30).status_code == 200, "/health to turn ready")
        body = httpx2.get(f"{url}/health", timeout=30).json()
        assert body["warm_up"] == "off" and body["warm_up_seconds"] is None
        assert ran == [] and apis.grpc.engine.warmed.is_set()


def test_the_warm_up_setting_comes_from_the_environment_a_flag_or_the_chart_key(tmp_path, monkeypatch):
    assert DataPlaneConfig(model="m").warm_up is True
    monkeypatch.setenv("EXPERTMESH_WARM_UP", "false")
    assert DataPlaneConfig(model="m").warm_up is False
    monkeypatch.delenv("EXPERTMESH_WARM_UP")
    values = tmp_path / "values.yaml"
    values.write_text("router:\n  warmUp: false\n")
    assert read_config_file(values).values == {"warm_up": False}


# -- `expertmesh up`: its /metrics ----------------------------------------------------------------------------------

#: /metrics samples that count requests, steps, tokens and group calls (the HTTP API's own responses aside: each
#: /health and /metrics call counts there)
COUNTED = re.compile(
    r"^(expertmesh_(engine_step_\w+_count|request_\w+_count|time_to_first_token\w*_count|expert_tokens_total"
    r"|group_call_duration\w*_count))(\{[^}]*\})? (\S+)$",
    re.M,
)


def _counted(url: str) -> dict[str, float]:
    text = httpx2.get(f"{url}/metrics", timeout=30).text
    return {m.group(1) + (m.group(3) or ""): float(m.group(4)) for m in COUNTED.finditer(text)}


@pytest.mark.slow
def test_up_reports_its_warm_up_and_its_metrics_count_no_request_until_one_comes(checkpoint, shared_ray_address):
    with serving_http(checkpoint.path, shared_ray_address) as served:
        wait_for(lambda: httpx2.get(f"{served.url}/health", timeout=30).status_code == 200, "/health to turn ready")
        body = httpx2.get(f"{served.url}/health", timeout=30).json()
        assert body["warm_up"] == "done" and body["warm_up_seconds"] > 0
        served.up.wait_for_stderr(r"warm-up took \S+s: a prompt chunk of \d+ tokens")
        assert not any(_counted(served.url).values()), "the warm-up is no request, step or group call"
        metrics = httpx2.get(f"{served.url}/metrics", timeout=30).text
        assert re.search(r"^expertmesh_router_weights_changed(\{[^}]*\})? 0(\.0)?$", metrics, re.M), "item 5's gauge"
        with Client(served.up.target, timeout=120) as client:
            list(client.generate([5, 6, 7, 8], max_new_tokens=3, stop_at_eos=False))
        counted = _counted(served.url)
        assert any(v > 0 for k, v in counted.items() if k.startswith("expertmesh_engine_step")), counted
        assert any(v > 0 for k, v in counted.items() if k.startswith("expertmesh_expert_tokens")), counted


# -- a group process's warm-up ----------------------------------------------------------------------------------------


def test_a_group_process_warms_up_before_it_serves_and_says_how_long_it_took(checkpoint):
    args = ["--model", str(checkpoint.path), "--groups", "2"]
    (warm,) = start_groups(["g0"], args).values()
    try:
        described = _describe(warm.address)
        assert described.warm_up_seconds > 0
        assert described.expert_stats and all(s.calls == s.rows == 0 for s in described.expert_stats)
        wait_for(lambda: any("warm-up" in line for line in warm.stderr), "the warm-up's time in the group's log")
    finally:
        warm.stop()
    (cold,) = start_groups(["g0"], [*args, "--warm-up", "false"]).values()
    try:
        assert _describe(cold.address).warm_up_seconds == 0
    finally:
        cold.stop()
